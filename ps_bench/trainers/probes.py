"""What a trainer measures besides its training: the ``--limits`` floors (``FloorProbes``, a
part of the trainer), and ``--profile``'s trace of a few iterations."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from ps_bench.metrics import limits, traces
from ps_bench.metrics.messages import wire_dtype
from ps_bench.models.base import build_model
from ps_bench.runtime.failures import fatal_on_error
from ps_bench.runtime.futures import on_default_stream
from ps_bench.runtime.topology import PIECES, piece_owners, piece_ranges, slice_size
from ps_bench.strategies import RPC


class FloorProbes:
    """The trainer's ``--limits`` measurements; it has the trainer's model entry, inputs, hook
    context, synchroniser and strategy record, optimizer spec, micro-batches and precision."""

    @fatal_on_error
    @on_default_stream
    def measure_floors(self, messages: dict[int, list], own: dict[int, list] | None,
                       targets: list[list[rpc.RRef]], repeat: int,
                       piece: int | None = None, on_device: bool = False,
                       gathered: tuple[int, ...] = ()) -> dict[str, list[float]]:
        """``--limits``: ``repeat`` repetitions of the raw RPC floor (to ``targets[0]``, one per
        server, when there are servers) and of the raw collective floor, moving ``messages`` (the
        float32 buckets); of the strategy's ``own`` floor, its own messages over its own transport
        (to ``targets[1]`` for RPC), when they differ; of its own steps besides the buckets (its
        synchroniser's ``floor_steps``: each collective it issues, on its groups, as ``step_*``);
        of the link probe and of the compute-only iteration. ``piece``: the elements of a piece
        the strategy cuts what it pushes into (``metrics.messages.piece_elements``; None:
        buckets whole). ``on_device``: the run's tensors cross RPC on the GPU, and so do the
        floors' (``targets`` hold their buffers there). ``gathered``: the sparse buckets, which
        the collective floors all-gather (``limits.collective_floor_ms``) and the RPC floors
        send whole. Nothing here counts as wire bytes. Every trainer must call it at once (each
        repetition starts with a barrier)."""
        ctx = self.hook_context
        out: dict[str, list[float]] = {}
        place = self.device if on_device else limits.CPU  # the RPC floors' tensors
        if self._compute_copy is None:  # the model whole, outside DDP, FSDP2 or an engine
            self._compute_copy = build_model(
                self.entry.class_name, self.entry.kwargs, self.seed).to(
                    self.device, dtype=self.synchroniser.input_dtype)
        ctx.wire.paused = True
        try:
            if targets:
                out["rpc_ms"] = limits.rpc_floor_ms(messages,
                                                    self.floor_owners(messages, targets[0],
                                                                      sparse=gathered),
                                                    ctx.process_group, self.device, repeat,
                                                    place)
            out["collective_ms"] = limits.collective_floor_ms(messages, self.device,
                                                              ctx.process_group, repeat,
                                                              frozenset(gathered))
            if own is not None and self.strategy.transport == RPC:
                out["own_ms"] = limits.rpc_floor_ms(own, self.floor_owners(
                    messages, targets[-1], self.strategy.rpc_slices(ctx.per_host), piece,
                    gathered),
                    ctx.process_group, self.device, repeat, place)
            elif own is not None:
                out["own_ms"] = limits.collective_floor_ms(own, self.device, ctx.process_group,
                                                           repeat, frozenset(gathered))
            for nbytes in limits.LINK_SIZES:  # the link itself, one message at a time
                if ctx.process_group.size() > 1:
                    out[f"link_{nbytes}"] = limits.collective_floor_ms(
                        {0: [(nbytes // 4, "float32")]}, self.device, ctx.process_group, repeat)
                elif targets:
                    out[f"link_{nbytes}"] = limits.echo_ms(nbytes, targets[0][0], ctx.process_group,
                                                           self.device, repeat, place)
            steps = self.synchroniser.floor_steps(
                ctx, self.strategy.sends, self.elements,
                [nbytes // 4 for nbytes, _, _ in ctx.buckets.values()])
            if steps:
                out.update({f"step_{kind}_ms": values for kind, values in limits.steps_floor_ms(
                    steps, self.device, ctx.process_group, repeat,
                    wire_dtype(self.strategy.payload)).items()})
            out["compute_ms"] = limits.compute_floor_ms(
                self._compute_copy, self.inputs, self.targets, self.batch_size,
                ctx.process_group, self.optimizer_spec.build, repeat, self.accum, self.autocast,
                None if self.scaler is None else scaler_like(self.scaler, self.device.type))
        finally:
            ctx.wire.paused = False
        return out

    def floor_owners(self, messages: dict[int, list], targets: list[rpc.RRef], slices: int = 1,
                     piece: int | None = None, sparse: tuple[int, ...] = ()
                     ) -> dict[tuple[int, int], rpc.RRef]:
        """The server of each message (``(bucket index, place)``) this trainer sends, as the
        strategy deals them (``HookContext.pieces``): its group's, or its piece's owner among
        every server; ``messages`` are the float32 buckets whole (their sizes), ``slices`` the
        slices of a bucket (this trainer sends its own), ``piece`` the elements of a piece (None:
        each slice whole), ``sparse`` the buckets sent whole whatever ``piece`` is."""
        sizes = {index: sum(part[0] for part in parts) for index, parts in messages.items()}
        part = dist.get_rank() % slices
        places = {index: 1 if index in sparse
                  else len(piece_ranges(slice_size(size, slices), piece))
                  for index, size in sizes.items()}
        if self.hook_context.mapping == "group":
            server = targets[self.hook_context.group_server]
            return {(index, place): server
                    for index, count in places.items() for place in range(count)}
        owners = piece_owners(sizes, slices, len(targets), piece, sparse)
        return {(index, place): targets[owners[(index * slices + (0 if index in sparse else part))
                                               * PIECES + place]]
                for index, count in places.items() for place in range(count)}


def scaler_like(scaler: torch.amp.GradScaler, device_type: str) -> torch.amp.GradScaler:
    """A gradient scaler of its own for the compute-only copy, at the run's scale and growth
    tracker: a fresh one starts at 2**16, where fp16 gradients overflow and its first steps are
    skipped, cheaper than the run's."""
    own = torch.amp.GradScaler(device_type)
    state = scaler.state_dict()
    if state:  # empty where the run's scaler is disabled
        own.load_state_dict(state)
    return own


PROFILED_OPERATORS = 30  # rows of each table of --profile's summary
KINETO_QUIET = "6"  # above Kineto's every level (its USDT markers are 5, errors 4)


def finish_profile(profiler: torch.profiler.profile, path: str) -> None:
    """Stops ``profiler``, writes its Chrome trace to ``path`` and beside it (``.txt``) torch's
    tables of the traced operators by self time, on the CPU and, where it traced one, on the
    device; returns None, the profiler's new state."""
    profiler.stop()
    traces.PENDING.append((path, traces.OPENED[0], time.perf_counter()))  # for the round's spans
    trace = Path(path)
    trace.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(trace))
    averages = profiler.key_averages()
    clocks = [("CPU", "self_cpu_time_total")]
    if torch.profiler.ProfilerActivity.CUDA in profiler.activities:
        clocks.insert(0, ("device", "self_device_time_total"))
    tables = [f"The traced iterations' operators by self {name} time (the trace: {trace.name})\n"
              + averages.table(sort_by=key, row_limit=PROFILED_OPERATORS, max_name_column_width=90)
              for name, key in clocks]
    trace.with_suffix(".txt").write_text("\n".join(tables))


def start_profiler(device: torch.device, debug: bool = False) -> torch.profiler.profile:
    """torch.profiler, started, on the CPU and ``device``. Unless ``debug``, quiet: without a
    line from Kineto at each start and stop (``USDT: ... profiler_start``; its log level, which
    it reads as it logs), and without autograd's warning, for each RPC a traced iteration makes,
    that the call's far side is not traced (docs/floors.md, Traces, says whose work is)."""
    if not debug:
        os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET
        warnings.filterwarnings("ignore", message="Profiling a distributed call with the Kineto")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    traces.OPENED[0] = time.perf_counter()
    return profiler
