"""Clocks that report milliseconds: perf_counter on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import time
from collections import deque

import torch


def now_ms() -> float:
    return time.perf_counter() * 1000.0


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Payload bytes of a tensor as it crosses the wire (sparse: indices plus values)."""
    if tensor.is_sparse:
        return tensor_bytes(tensor._indices()) + tensor_bytes(tensor._values())
    return tensor.numel() * tensor.element_size()


class StepTimer:
    """Times the phases of one iteration: ``start()``, then ``mark()`` at the end of each phase;
    ``intervals()`` returns the phases' durations in ms, in order.

    On a GPU, marks are CUDA events and ``intervals()`` synchronises before reading them, so
    the clock stops only once the device has finished the work. On the CPU a mark is one clock
    read (every timed iteration pays for it).
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def start(self) -> None:
        self.marks.clear()
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        marks = self.marks
        if self.cuda:
            torch.cuda.synchronize()
            return [marks[i].elapsed_time(marks[i + 1]) for i in range(len(marks) - 1)]
        return [(marks[i + 1] - marks[i]) * 1000.0 for i in range(len(marks) - 1)]


class IntervalTracker:
    """Collects (start, end) intervals from several threads; ``drain()`` gives the time in ms
    during which at least one interval was open, and clears them.

    Lock-free, since ``add`` runs once per bucket on every iteration: deque appends and pops
    are atomic, and ``drain`` pops only what was there when it began, so an interval added
    meanwhile waits for the next drain instead of being lost."""

    def __init__(self) -> None:
        self._intervals: deque[tuple[float, float]] = deque()

    def add(self, start_ms: float, end_ms: float) -> None:
        self._intervals.append((start_ms, end_ms))

    def drain(self) -> float:
        pop = self._intervals.popleft
        intervals = [pop() for _ in range(len(self._intervals))]
        if len(intervals) < 2:  # the common case of one bucket, paid every iteration
            return intervals[0][1] - intervals[0][0] if intervals else 0.0
        intervals.sort()
        covered, current_start, current_end = 0.0, None, None
        for start, end in intervals:
            if current_end is None or start > current_end:
                if current_end is not None:
                    covered += current_end - current_start
                current_start, current_end = start, end
            else:
                current_end = max(current_end, end)
        if current_end is not None:
            covered += current_end - current_start
        return covered
