"""``--trace``: ps_bench's own spans in the traces of the last timed round, and every rank's
trace merged into one file on one clock.

torch.profiler (Kineto) stamps a trace's events in microseconds from the file's
``baseTimeNanoseconds``, on the wall clock; ps_bench's own times come from
``time.perf_counter``, the host's monotonic clock, which every process of a host shares. Each
file says how its stamps map onto the monotonic clock (``ps_bench_clock``:
``monotonic_minus_trace_us``, measured in the rank as it writes the file: the monotonic clock
less the wall clock, plus the file's base), and ``merge`` puts every rank's events on the
master's: a rank's monotonic clock less how far it is ahead of the master's (0 on the master's
host; another host's measured over RPC once the job was ready, ``timers.clock_offset``), one
process track a rank, in rank order. A server traces no operators (its work is RPC callbacks
on TensorPipe's threads): its file holds its spans alone, already on the monotonic clock.

The spans: a trainer's ``iteration N`` with its ``forward``, ``backward`` and ``optimizer``
(the loop's own clock readings), and on a track of their own each bucket from its hand-over
to the hook's answer (``bucket K``); a server's ``piece B.P: receive`` (its first contribution's
arrival to its last's) and ``piece B.P: aggregate and answer`` (to the answers' sending), B the
bucket's slice, P the piece's place in it (``runtime.topology.PIECES``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

SPANS = "ps_bench"  # the trainer's track of phases
BUCKETS = "ps_bench buckets"  # its track of buckets
MERGED = "merged.json"
# traces the profiler wrote this round, (path, opened, closed: perf_counter seconds), for the
# round's spans (``trainers.probes``)
PENDING: list[tuple[str, float, float]] = []
OPENED = [0.0]  # when the running profiler started


def monotonic_minus_wall_us() -> float:
    return (time.perf_counter() - time.time()) * 1e6


def span(name: str, start_s: float, end_s: float, track: str, pid: int | str,
         offset_us: float = 0.0) -> dict:
    """A complete event of ps_bench's on ``track``, from perf_counter seconds to the file's stamps
    (``offset_us``: its monotonic_minus_trace_us)."""
    return {"ph": "X", "cat": "ps_bench", "name": name, "pid": pid, "tid": track,
            "ts": start_s * 1e6 - offset_us, "dur": max(0.0, (end_s - start_s) * 1e6)}


def trainer_spans(readings: list[list[float]], intervals: list[tuple[int, float, float]],
                  first_iteration: int) -> list[tuple[str, float, float, str]]:
    """(name, start, end, track) of each iteration the profiler traced this round: its phases
    from the loop's readings (start, each micro-batch's end of forward and of backward, end),
    and its buckets from the hooks' intervals (the k-th of an iteration: bucket k)."""
    if not PENDING:
        return []
    _, opened, closed = PENDING[-1]
    out, kth = [], {}
    for step, reading in enumerate(readings):
        if not opened <= reading[0] <= closed:
            continue
        iteration = first_iteration + step
        out.append((f"iteration {iteration}", reading[0], reading[-1], SPANS))
        for at in range(0, len(reading) - 2, 2):  # each micro-batch's forward and backward
            out.append(("forward", reading[at], reading[at + 1], SPANS))
            out.append(("backward", reading[at + 1], reading[at + 2], SPANS))
        out.append(("optimizer", reading[-2], reading[-1], SPANS))
        kth[iteration] = 0
    for iteration, start, end in intervals:
        if iteration in kth:
            out.append((f"bucket {kth[iteration]}", start, end, BUCKETS))
            kth[iteration] += 1
    return out


def add_spans(spans: list[tuple[str, float, float, str]]) -> None:
    """Writes ``spans`` into the trace the profiler wrote this round, with the clock it is on."""
    while PENDING:
        path, _, _ = PENDING.pop()
        trace = json.loads(Path(path).read_text())
        events = trace.setdefault("traceEvents", [])
        pid = next((event["pid"] for event in events if event.get("ph") == "X"), 0)
        offset = trace.get("baseTimeNanoseconds", 0) / 1000.0 + monotonic_minus_wall_us()
        events += [span(name, start, end, track, pid, offset) for name, start, end, track in spans]
        trace["ps_bench_clock"] = {"monotonic_minus_trace_us": offset}
        Path(path).write_text(json.dumps(trace))


def write_server_spans(path: str, spans: list[tuple[int, float, float, float]],
                       pieces: int) -> None:
    """A server's trace: each piece's (key, first arrival, last arrival, answered: ms on the
    monotonic clock) as its receiving and its aggregation and answer, named ``piece B.P`` (a
    key is the bucket's slice B times ``pieces``, plus the piece's place P in it)."""
    events = []
    for key, first, last, answered in spans:
        name = f"piece {key // pieces}.{key % pieces}"
        events.append(span(f"{name}: receive", first / 1e3, last / 1e3, SPANS, 0))
        events.append(span(f"{name}: aggregate and answer", last / 1e3, answered / 1e3, SPANS, 0))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                      "ps_bench_clock": {"monotonic_minus_trace_us": 0.0}}))


def merge(folder: str, ranks: list[tuple[str, str, int, int, dict | None]]
          ) -> tuple[str, list[str]]:
    """``merged.json`` in ``folder``: every rank's trace found (``ranks``: its file, role, index,
    rank and its clock against the master's, ``timers.clock_offset``, None: taken as the
    master's), each a process track named by role, index and rank, its events on the master's
    monotonic clock. Returns its path and the files not found (a rank of another host writes on
    its own)."""
    events, clocks, missing = [], [], []
    for file, role, index, rank, clock in ranks:
        path = Path(file)
        if not path.exists():
            missing.append(path.name)
            continue
        trace = json.loads(path.read_text())
        own = trace.get("ps_bench_clock", {}).get("monotonic_minus_trace_us", 0.0)
        ahead_us = 1000.0 * clock["offset_ms"] if clock else 0.0
        offset = own - ahead_us  # the file's stamps onto the master's clock
        clocks.append({"rank": rank, "role": role, "index": index, "file": path.name,
                       "monotonic_minus_trace_us": own, "ahead_of_master_us": ahead_us,
                       "ahead_error_us": 1000.0 * clock["error_ms"] if clock else 0.0})
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"{role} {index} (rank {rank})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for event in trace.get("traceEvents", []):
            if event.get("ph") == "M" and event.get("name") in ("process_name",
                                                                "process_sort_index"):
                continue
            moved = {**event, "pid": rank}
            if "ts" in moved:
                moved["ts"] = float(moved["ts"]) + offset
            events.append(moved)
    merged = Path(folder) / MERGED
    merged.write_text(json.dumps({
        "traceEvents": events, "displayTimeUnit": "ms",
        "ps_bench": {"clock": "the master's monotonic clock, in microseconds: each rank's stamps "
                              "moved by its monotonic_minus_trace_us, less how far its clock is "
                              "ahead of the master's (ahead_of_master_us, measured once the job "
                              "was ready, within ahead_error_us; 0 on the master's host)",
                     "ranks": clocks, "missing": missing}}))
    return str(merged), missing
