"""Clocks that report milliseconds: perf_counter on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
import socket
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch


# the bucket timeline, and the servers' lane beside it, come from this many iterations at the end
# of each round
TIMELINE_ITERATIONS = 8


def now_ms() -> float:
    return time.perf_counter() * 1000.0


@functools.lru_cache(maxsize=1)
def clock_id() -> str:
    """The clock ``now_ms`` reads: the kernel's boot, whose monotonic clock every process of the
    machine shares (emulated hosts, namespaces of one machine, included). Readings of two ids are
    on clocks of their own."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"host {socket.gethostname()}"


def clock_reading() -> tuple[str, float]:
    """This process's clock, as the master asks each rank for it: its id and ``now_ms``."""
    return clock_id(), now_ms()


def clock_offset(own_id: str, samples: list[tuple[float, tuple[str, float], float]]) -> dict:
    """A rank's clock against the master's from round trips ``(sent, (id, reading), received)``,
    ms on the master's clock, as Cristian's algorithm reads them (Distributed Computing 3(3),
    1989): the reading was taken within the round trip, so the rank's clock is ahead of the
    master's by the reading less the trip's midpoint, within half the trip; the shortest trip
    bounds it best. ``measured_ms`` is that estimate; ``offset_ms`` is 0 exactly where both
    read one clock (the same id: ``shared``), the estimate elsewhere."""
    sent, (rank_id, reading), received = min(samples, key=lambda s: s[2] - s[0])
    measured = reading - (sent + received) / 2.0
    shared = rank_id == own_id
    return {"offset_ms": 0.0 if shared else measured, "error_ms": 0.0 if shared else
            (received - sent) / 2.0, "measured_ms": measured, "trip_ms": received - sent,
            "shared": shared}


def ahead_ms(clocks: list[dict] | None, rank: int, of: int) -> float | None:
    """How far ``rank``'s clock is ahead of rank ``of``'s, from their ``clock_offset``s against
    the master's (``env.clocks``); None where either was not measured."""
    offsets = {clock["rank"]: clock["offset_ms"] for clock in clocks or []}
    return offsets[rank] - offsets[of] if rank in offsets and of in offsets else None


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Payload bytes of a tensor as it crosses the wire (sparse: indices plus values)."""
    if tensor.is_sparse:
        return tensor_bytes(tensor._indices()) + tensor_bytes(tensor._values())
    return tensor.numel() * tensor.element_size()


def sent_bytes(tensor: torch.Tensor) -> int:
    """Payload bytes of a tensor as it is sent: a sparse tensor's indices and values once its
    repeated indices are summed (gloo coalesces a sparse all-reduce's input before it gathers
    it; the parameter servers' strategies coalesce before they send), counted without summing
    them (an embedding's gradient holds a row per lookup, repeated rows many times over)."""
    if not tensor.is_sparse or tensor.is_coalesced():
        return tensor_bytes(tensor)
    indices, values = tensor._indices(), tensor._values()
    flat = indices[0]
    for dim in range(1, indices.size(0)):  # one number per place
        flat = flat * tensor.size(dim) + indices[dim]
    per_place = (indices.size(0) * indices.element_size()
                 + values[0].numel() * values.element_size() if values.size(0) else 0)
    return torch.unique(flat).numel() * per_place


class StepTimer:
    """Clock readings at the phase boundaries of each iteration, turned into milliseconds after
    the round, so the training loop pays only for the readings themselves.

    The loop calls ``clock()`` at each boundary and ``stop()`` at the last one of an iteration.
    On the CPU both are ``time.perf_counter``, a C call with no Python frame around it. On a GPU
    a reading is a recorded CUDA event, and ``stop()`` also waits for the device, so an
    iteration's clock stops only once the device has finished its work. ``phases(readings)``
    gives each iteration's phase durations in ms.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.clock = self._event if self.cuda else time.perf_counter
        self.stop = self._synchronized_event if self.cuda else time.perf_counter

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _synchronized_event(self) -> torch.cuda.Event:
        event = self._event()
        torch.cuda.synchronize()
        return event

    def phases(self, readings: list[tuple]) -> np.ndarray:
        """One row per iteration (at least one), one column per phase: the ms between
        consecutive readings."""
        if self.cuda:
            return np.array([[a.elapsed_time(b) for a, b in zip(row, row[1:])] for row in readings])
        return np.diff(np.asarray(readings, dtype=np.float64), axis=1) * 1000.0


class IntervalTracker:
    """Collects ``(iteration, start, end)`` intervals (``time.perf_counter`` seconds) from
    several threads; ``drain()`` returns them, sorted, and clears them.

    ``add`` is the deque's own append, a C call: it runs once per bucket on every iteration,
    from the hook's thread or a future's callback. Deque appends and pops are atomic, and
    ``drain`` pops only what was there when it began, so an interval added meanwhile waits
    for the next drain instead of being lost."""

    def __init__(self) -> None:
        self._intervals: deque[tuple[int, float, float]] = deque()
        self.add = self._intervals.append

    def drain(self) -> list[tuple[int, float, float]]:
        pop = self._intervals.popleft
        return sorted(pop() for _ in range(len(self._intervals)))


def covered_ms(intervals: list[tuple[int, float, float]]) -> dict[int, float]:
    """Per iteration, the ms during which at least one of its (sorted) intervals was open."""
    # one bucket: nothing to merge
    if len({interval[0] for interval in intervals}) == len(intervals):
        return {iteration: 1000.0 * (end - start) for iteration, start, end in intervals}
    return {iteration: 1000.0 * covered_seconds([(start, end) for _, start, end in group])
            for iteration, group in itertools.groupby(intervals, key=operator.itemgetter(0))}


def bucket_offsets(intervals: list[tuple[int, float, float]],
                   backward_started: dict[int, float],
                   held: list[tuple[int, float, float]] = ()) -> dict[int, list[tuple]]:
    """Per bucket, ``(ready, done, held)`` ms for the iterations in ``backward_started``
    (iteration -> perf_counter seconds): when DDP handed the bucket to the hook and when the
    hook's future completed, after its iteration's backward began, and how long the hook held
    backward's thread (from the sorted ``held`` intervals, handed over -> returned; 0 without
    them). ``intervals`` are sorted, so an iteration's k-th is the k-th bucket DDP handed over:
    bucket k (DDP hands them over in index order)."""
    returned = {(iteration, start): end for iteration, start, end in held}
    offsets: dict[int, list[tuple]] = {}
    for iteration, group in itertools.groupby(intervals, key=operator.itemgetter(0)):
        began = backward_started.get(iteration)
        if began is not None:
            for bucket, (_, start, end) in enumerate(group):
                holding = returned.get((iteration, start), start) - start
                offsets.setdefault(bucket, []).append((1000.0 * (start - began),
                                                       1000.0 * (end - began), 1000.0 * holding))
    return offsets


def server_offsets(began: dict | None, recent: dict | None,
                   ahead_ms: float | None = None) -> dict[int, list[tuple]]:
    """Per piece a server answered, ``(first arrival, last arrival, answered)`` ms after a
    trainer's backward began, from the server's last answers of each piece (``recent``:
    ``{"clock", "spans": {key: [(first, last, answered) ms]}}``) and that trainer's backward
    starts of the round's last iterations (``began``: ``{"clock", "ms": [...]}``, in order). A
    piece's answer is of the iteration whose backward began last before it: it needs that
    iteration's gradient, and the next iteration's backward needs it. Where the two read
    different clocks, the server's is taken as ``ahead_ms`` ahead of the trainer's (their
    ``clock_offset``s' difference); nothing where that is not known."""
    if not began or not recent:
        return {}
    shift = 0.0 if began["clock"] == recent["clock"] else ahead_ms
    if shift is None:
        return {}
    starts, offsets = began["ms"], {}
    for key, spans in recent["spans"].items():
        for span in spans:
            place = bisect.bisect_right(starts, span[-1] - shift) - 1
            if place >= 0:
                offsets.setdefault(key, []).append(tuple(at - shift - starts[place]
                                                         for at in span))
    return offsets


def server_lane(offsets: dict[tuple[int, int], list[tuple]], pieces: int) -> list[dict] | None:
    """The servers' lane of the bucket timeline: per server and piece (its key its slice times
    ``pieces`` plus its place in the slice: ``runtime.topology.PIECES``; a slice is the bucket's
    index, but for ``ps_node``, which cuts each bucket into a slice per trainer of a host), the
    p50 ``server_offsets`` over every round; None without any."""
    if not offsets:
        return None
    rows = [{"server": server, "slice": key // pieces, "piece": key % pieces,
             **{name: float(np.median([span[place] for span in spans]))
                for place, name in enumerate(("first_ms", "last_ms", "answered_ms"))}}
            for (server, key), spans in offsets.items()]
    return sorted(rows, key=lambda row: (row["first_ms"], row["server"]))


def cuda_bucket_offsets(ready_events: list[tuple[int, "torch.cuda.Event"]],
                        backward: dict[int, tuple["torch.cuda.Event",
                                                  "torch.cuda.Event"]]) -> dict[int, list]:
    """On a GPU, per bucket, ``(ready, done)`` ms after its iteration's backward began, on the
    device's clock, for the iterations in ``backward`` (iteration -> the CUDA events that began
    and ended its backward): ``ready`` when the device had made the bucket (the event recorded
    as DDP handed it over, an iteration's k-th being bucket k), ``done`` the end of backward, by
    which DDP has waited for every bucket (an upper bound: the GPU's collectives run on streams
    of their own, whose completion the CPU learns late). Every event must have completed."""
    offsets: dict[int, list[tuple[float, float]]] = {}
    for iteration, group in itertools.groupby(ready_events, key=operator.itemgetter(0)):
        span = backward.get(iteration)
        if span is not None:
            began, ended = span
            done = began.elapsed_time(ended)
            for bucket, (_, made) in enumerate(group):
                offsets.setdefault(bucket, []).append((began.elapsed_time(made), done))
    return offsets


def covered_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` spans sorted by start."""
    covered, (low, high) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > high:
            covered += high - low
            low, high = start, end
        else:
            high = max(high, end)
    return covered + high - low


def folded(phases: np.ndarray, trailing: int) -> np.ndarray:
    """Each iteration's forward and backward ms, then its ``trailing`` last phases, from the ms
    between its readings: the start, each micro-batch's end of forward and of backward
    (``--grad-accum``: several), then the ends of the phases that follow; the forwards summed,
    the backwards summed."""
    micro = phases.shape[1] - trailing
    if micro == 2:
        return phases
    return np.concatenate([phases[:, 0:micro:2].sum(axis=1, keepdims=True),
                           phases[:, 1:micro:2].sum(axis=1, keepdims=True), phases[:, micro:]],
                          axis=1)



def exposed_ms(handed: list[tuple[int, float, float]],
               collectives: list[tuple[int, float, float, bool]],
               computing: dict[int, tuple[float, float]]) -> dict[int, float] | None:
    """Per iteration, the ms of communication no computation hid: while a hook's bucket was open
    (``handed``, sorted: hand-over to its future's end) or a collective (``collectives``:
    iteration, start, end, blocking) and the iteration was not computing. An iteration computes
    from its start (``computing``: iteration -> start, end of its last backward, perf_counter
    seconds) to the end of its last backward, or, where hooks were handed buckets in it, to the
    last hand-over: what follows, DDP waiting for the hooks' futures, is a hooked strategy's
    exposed communication; a collective after backward (a local strategy's synchronisation, an
    optimizer's broadcast) is exposed whole. A blocking collective (its caller waited in the
    call) computes nothing while it lasts, wherever it falls: FSDP2's gathers and
    reduce-scatters on the CPU, inside forward and backward, are exposed whole.

    None where an asynchronous collective other than a hook's own ran inside forward or backward
    (DeepSpeed's): the loop's clock cannot tell how much of it the computation waited for."""
    hooks: dict[int, list[tuple[float, float]]] = {}
    blocked: dict[int, list[tuple[float, float]]] = {}
    issued: dict[int, list[tuple[float, float]]] = {}
    for iteration, start, stop in handed:
        hooks.setdefault(iteration, []).append((start, stop))
    for iteration, start, stop, blocking in collectives:
        (blocked if blocking else issued).setdefault(iteration, []).append((start, stop))
    out = {}
    opened = sorted(handed + [collective[:3] for collective in collectives])
    for iteration, group in itertools.groupby(opened, key=operator.itemgetter(0)):
        if iteration not in computing:
            continue
        began, backward_end = computing[iteration]
        own = hooks.get(iteration, [])
        if any(start < backward_end and stop > began
               and not any(low <= start <= high for low, high in own)  # not a hook's own
               for start, stop in issued.get(iteration, [])):
            return None
        end = min(max((start for start, _ in own), default=backward_end), backward_end)
        spans = [(start, stop) for _, start, stop in group]
        computed = without((began, end), sorted(blocked.get(iteration, [])))
        hidden = sorted((max(start, low), min(stop, high)) for start, stop in spans
                        for low, high in computed if min(stop, high) > max(start, low))
        out[iteration] = 1000.0 * (covered_seconds(spans)
                                   - (covered_seconds(hidden) if hidden else 0.0))
    return out


def without(window: tuple[float, float],
            spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``window`` less the ``spans`` (sorted by start): what is left of it, in order."""
    left, (low, high) = [], window
    for start, stop in spans:
        if start > low:
            left.append((low, min(start, high)))
        low = max(low, stop)
        if low >= high:
            return left
    return left + [(low, high)] if high > low else left
