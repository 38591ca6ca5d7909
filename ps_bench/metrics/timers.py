"""Clocks that report milliseconds: perf_counter on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import threading
import time

import torch


def now_ms() -> float:
    return time.perf_counter() * 1000.0


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Payload bytes of a tensor as it crosses the wire (sparse: indices plus values)."""
    if tensor.is_sparse:
        return tensor_bytes(tensor._indices()) + tensor_bytes(tensor._values())
    return tensor.numel() * tensor.element_size()


class StepTimer:
    """Marks phases of one iteration; ``intervals()`` returns ms between consecutive marks.

    On a GPU, marks are CUDA events and ``intervals()`` synchronises before reading them,
    so the clock stops only once the device has finished the work.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((name, event))
        else:
            self.marks.append((name, now_ms()))

    def intervals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (_, start), (name, end) in zip(self.marks, self.marks[1:]):
            out[name] = start.elapsed_time(end) if self.cuda else end - start
        self.marks.clear()
        return out


class IntervalTracker:
    """Collects (start, end) intervals from several threads; ``drain()`` gives the time in ms
    during which at least one interval was open, and clears them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []

    def add(self, start_ms: float, end_ms: float) -> None:
        with self._lock:
            self._intervals.append((start_ms, end_ms))

    def drain(self) -> float:
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
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
