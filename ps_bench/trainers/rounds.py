"""What a trainer's round recorded, made into what it reports: the per-iteration samples, the
bucket timeline and the time each kind of collective was open. The loop itself records only
clock readings and byte counts (``DdpTrainer.run_round``); everything here runs after it, but
the contexts of ``--precision`` the loop computes in (``mixed_precision``)."""

from __future__ import annotations

import bisect
import contextlib
import math
from typing import Any, Callable

import numpy as np
import torch

from ps_bench.metrics import traces
from ps_bench.metrics.timers import (TIMELINE_ITERATIONS, StepTimer, bucket_offsets,
                                     clock_id, covered_ms, cuda_bucket_offsets, exposed_ms,
                                     folded)

VERIFIED_PER_ROUND = 4  # --verify checks at most this many evenly spaced iterations per round


def mixed_precision(device: torch.device, precision: str,
                    synchroniser: Any) -> tuple[Callable[[], Any], Any]:
    """``--precision``: a context for forward under ``torch.autocast`` in bf16 or fp16, and for
    fp16 a gradient scaler (``torch.amp.GradScaler``, on a GPU); for fp32, or a strategy whose
    engine casts the model itself (DeepSpeed), nothing."""
    if precision == "fp32" or synchroniser.casts_itself:
        return contextlib.nullcontext, None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    return (lambda: torch.autocast(device.type, dtype=dtype)), scaler


def verified_steps(iterations: int) -> set[int]:
    """Which iterations of a round ``--verify`` checks (left out of the timings): evenly spaced,
    at most VERIFIED_PER_ROUND, never two in a row, so that a short round keeps timed ones."""
    stride = max(2, math.ceil(iterations / VERIFIED_PER_ROUND))
    return set(range(0, iterations, stride))


def recorded(timer: StepTimer, records: list[tuple], before: tuple[int, int],
             intervals: list[tuple], timings: list[tuple], first_iteration: int,
             untimed: set[int], ready_events: list | None,
             held: list[tuple] = ()) -> tuple[np.ndarray, dict, dict, dict | None]:
    """A round's phases (forward, backward, optimizer ms an iteration), samples, bucket timeline
    and when its last iterations' backward began (on the CPU: the servers' lane is placed from
    it, ``timers.server_offsets``), from its loop's ``records`` (each iteration's clock readings
    and the bytes sent and received so far, ``before`` the round's first), the hooks' open
    ``intervals`` (and how long each ``held`` backward) and the collectives' ``timings`` of the
    timed iterations. ``untimed`` steps (captured or traced) count their bytes, not their
    times."""
    readings = [record[0] for record in records]
    if traces.PENDING and not timer.cuda:  # --profile, --trace: the traced iterations' spans
        traces.add_spans(traces.trainer_spans(readings, intervals, first_iteration))
    phases = folded(timer.phases(readings), 1)
    moved = np.diff([before] + [record[1:] for record in records], axis=0)
    # comm: while a bucket's hook or any collective was open (FSDP2, ZeRO and DeepSpeed have no
    # hook)
    opened = sorted(intervals + [timing[:3] for timing in timings]) if timings else intervals
    # exposed: on the CPU's clock (a GPU's compute runs on the device's; not measured there)
    exposed = None if timer.cuda else exposed_ms(intervals, [(*timing[:3], timing[4])
                                                             for timing in timings], {
        first_iteration + step: (reading[0], reading[-2]) for step, reading in enumerate(readings)})
    samples = round_samples(phases, moved, covered_ms(opened), first_iteration, untimed, exposed)
    # when each bucket became ready and was done, after backward began, in the round's last
    # timed iterations: on the CPU's clock, or on a GPU the device's (CUDA events)
    timeline, began = {}, None
    steps = [step for step in range(len(records)) if step not in untimed][-TIMELINE_ITERATIONS:]
    if steps and not timer.cuda:
        tail = intervals[bisect.bisect_left(intervals, (first_iteration + steps[0],)):]
        # the synchronised micro-batch's backward: the last
        timeline = bucket_offsets(tail, {first_iteration + step: readings[step][-3]
                                         for step in steps}, held)
        began = {"clock": clock_id(),
                 "ms": [reading[-3] * 1000.0 for reading in readings[-TIMELINE_ITERATIONS:]]}
    elif steps and ready_events:
        timeline = cuda_bucket_offsets(ready_events, {first_iteration + step: readings[step][-3:-1]
                                                      for step in steps})
    return phases, samples, timeline, began


def round_samples(phases: np.ndarray, moved: np.ndarray, comm: dict[int, float],
                  first_iteration: int, untimed: set[int],
                  exposed: dict[int, float] | None = None) -> dict[str, list]:
    """A round's per-iteration samples: ``phases`` (forward, backward, optimizer ms per
    iteration), ``moved`` (bytes sent and received per iteration), ``comm`` (iteration -> ms
    during which a bucket's communication was open) and ``exposed`` (-> ms of it no computation
    hid, ``timers.exposed_ms``; None: not measured). Bytes count every iteration; times leave
    out ``untimed`` steps (captured or traced)."""
    timed = [step for step in range(len(phases)) if step not in untimed]
    phases = phases[timed]
    return {
        "batch": phases.sum(axis=1).tolist(),
        "forward": phases[:, 0].tolist(),
        "backward": phases[:, 1].tolist(),
        "optimizer": phases[:, 2].tolist(),
        "comm": [comm.get(first_iteration + step, 0.0) for step in timed],
        **({"exposed": [exposed.get(first_iteration + step, 0.0) for step in timed]}
           if exposed is not None else {}),
        "bytes_sent": moved[:, 0].tolist(),
        "bytes_recv": moved[:, 1].tolist(),
    }


def collective_ms(timings: list[tuple]) -> dict[str, float]:
    """Per kind of collective, the ms during which one of that kind was open in the timed
    iterations (``timings``: iteration, start, end, kind, blocking)."""
    return {kind: sum(covered_ms([timing[:3] for timing in timings if timing[3] == kind]).values())
            for kind in sorted({timing[3] for timing in timings})}
