"""Floors (``--limits``): what the transports and the machine can do with the run's exact bytes.

Measured in the same job, by the same processes, over the same RPC agent and trainer process
group, a share of the repetitions after each timed round (so that a machine whose speed drifts
moves floors and strategy alike), fewer of them where each is slow (``affordable``):

- the raw RPC floor: every trainer sends each of its buckets to the bucket's server at once;
  the server adds it into a preallocated buffer and answers with that buffer (the round trip
  a parameter server costs with nothing of ours around it); where the run's tensors cross RPC
  on the GPU (every trainer and server over device maps), CUDA tensors both ways, each
  repetition's clock stopped once the device is done;
- the raw collective floor: the same bucket tensors all-reduced among the trainers (a sparse
  bucket all-gathered, as gloo's sparse all-reduce moves it: its rows differ between them);
- the strategy's own floor, for a strategy that sends something else than its float32 buckets:
  the raw transfer of exactly what it puts on the wire (``floor_messages``: half-size buffers of
  its dtype for 16-bit strategies; PowerSGD's uncompressed tensors, P and Q factors, per bucket,
  in its order), over its transport;
- the memory-copy bandwidth of one process (the ceiling of one machine);
- the compute-only iteration: the run's forwards, backwards (each micro-batch of
  ``--grad-accum``, under ``--precision``'s autocast and scaler) and optimizer step on a copy of
  the model with no DDP and no hook, every trainer at once (what an iteration costs with no
  communication).
- the link: one message at each of ``LINK_SIZES``, all-reduced among the trainers (a round trip
  to a server when there is one trainer), from which ``fit_link`` takes the link's latency α and
  bandwidth B (the calibration of ``bench.py predict``).

Bandwidths follow nccl-tests: ``algbw = bytes / time``; for an all-reduce
``busbw`` (``costs.busbw_gbps``), comparable across trainer counts and with the hardware's link
bandwidth. ``efficiency`` is the strategy's own floor (the raw transfer of what it sends, over
the transport its ``Strategy`` record names) divided by its measured cost (trainer ``comm``
p50): 1.0 means the strategy costs no more than moving its bytes. ``gain_over_float32`` is the
float32 floor of the same transport over that cost: above 1, compression paid. ``comm`` includes
the backward compute it overlaps; the exposed cost, trainer ``batch`` p50 minus the compute-only
p50, is what communication adds to an iteration, and ``exposed_value`` is the floor over it.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from ps_bench.metrics import costs
from ps_bench.metrics.costs import busbw_gbps
from ps_bench.metrics.messages import DTYPES
from ps_bench.metrics.timers import now_ms
from ps_bench.runtime.resident import Resident

CPU = torch.device("cpu")  # where the RPC floors' tensors are unless the run's cross on the GPU

FLOOR_WARMUP = 3  # untimed repetitions before each floor: connections, allocations, caches
FLOOR_ITERATIONS = 20  # per floor and trainer, spread over the timed rounds
FLOOR_MIN_PER_ROUND = 4
# A floor whose repetitions are slow (a large model, a slow link) takes fewer of them: about this
# long per floor and round, never fewer than FLOOR_MIN_TIMED timed ones; no more warm-up after a
# first repetition this slow (what warm-up is for is paid by then)
FLOOR_BUDGET_MS = 2000.0
FLOOR_MIN_TIMED = 3
SLOW_REPETITION_MS = 100.0
MEMCPY_ITERATIONS = 20
LINK_SIZES = (4 * 1024, 1024 * 1024, 16 * 1024 * 1024)  # bytes of the link probe's messages


# -- pure arithmetic ---------------------------------------------------------------------------
def algbw_gbps(nbytes: float, milliseconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes): the payload over the time it took."""
    return nbytes / (milliseconds / 1000.0) / 1e9 if milliseconds > 0 else 0.0


def efficiency(floor_ms: float | None, cost_ms: float | None) -> float | None:
    """Floor time over the measured cost; None when either is missing or the cost is zero."""
    if floor_ms is None or cost_ms is None or cost_ms <= 0:
        return None
    return floor_ms / cost_ms


def link_terms(method: str, peers: int) -> tuple[float, float]:
    """How many latencies and how many times the message crosses a link in one probe: a ring
    all-reduce among n ranks (``costs.ring_allreduce_ms``); an RPC round trip, ``2α + 2S/B``."""
    if method == "allreduce":
        return float(costs.ring_steps(peers)), costs.ring_share(peers)
    return 2.0, 2.0


def fit_link(points: list[tuple[int, float]], method: str, peers: int) -> dict:
    """The link's latency α (µs) and bandwidth B (Gbit/s) from ``(bytes, ms)`` probe points of
    the probe's model (``link_terms``), as the Hockney model is read off a ping-pong: B from the
    slope between the two largest messages (what a large message gets, past the latency and
    past a shaper's burst, which speeds a middle-sized message beyond the line rate), α from
    what the smallest message takes beyond its bytes at B. Needs two sizes or more."""
    a, b = link_terms(method, peers)
    ordered = sorted(points)
    (small, small_ms), (below, below_ms), (large, large_ms) = (
        ordered[0], ordered[-2], ordered[-1])
    ms_per_byte = (large_ms - below_ms) / (b * (large - below))
    if ms_per_byte <= 0:  # the sizes did not separate latency from bandwidth: all of it bandwidth
        return {"latency_us": 0.0, "bandwidth_gbit_s": 8.0 * b * large / large_ms / 1e6}
    alpha_ms = max(0.0, (small_ms - b * small * ms_per_byte) / a)
    return {"latency_us": alpha_ms * 1000.0, "bandwidth_gbit_s": 8.0 / ms_per_byte / 1e6}


def link_summary(samples: dict[int, list[float]], method: str, peers: int) -> dict | None:
    """The link probe's p50 per message size and the link fitted to them (None without two
    sizes)."""
    points = [(size, statistics.median(values))
              for size, values in sorted(samples.items()) if values]
    if len(points) < 2:
        return None
    return {"method": method, "peers": peers,
            "points": [{"bytes": size, "p50_ms": ms} for size, ms in points],
            **fit_link(points, method, peers)}


def floor_summary(samples_ms: list[float], nbytes: int, world: int | None = None,
                  gathered_bytes: int = 0) -> dict:
    """p50/p90 of a floor's samples, its algbw and, for collectives (``world``), busbw: what
    each trainer's link carries over the time, ``2(n-1)/n`` of the all-reduced bytes and
    ``n-1`` times the ``gathered_bytes`` (sparse buckets, all-gathered: each trainer's rows to
    every other)."""
    ordered = sorted(samples_ms)
    p50 = statistics.median(ordered)
    out = {
        "count": len(ordered),
        "p50_ms": p50,
        "p90_ms": ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))],
        "algbw_gbps": algbw_gbps(nbytes, p50),
    }
    if world is not None:
        out["busbw_gbps"] = (busbw_gbps(algbw_gbps(nbytes - gathered_bytes, p50), world)
                             + algbw_gbps(gathered_bytes * (world - 1), p50))
    return out


def repeats_per_round(rounds: int) -> int:
    """Timed repetitions of each floor after each of ``rounds`` timed rounds."""
    return max(FLOOR_MIN_PER_ROUND, -(-FLOOR_ITERATIONS // max(1, rounds)))


def affordable(repeat: int, first_ms: float) -> tuple[int, int]:
    """(untimed, timed) repetitions still to run of a floor whose first, untimed repetition took
    ``first_ms`` (the slowest trainer's, so that every trainer runs as many): ``repeat`` timed
    ones within ``FLOOR_BUDGET_MS`` where they fit, else as many as fit, at least
    ``FLOOR_MIN_TIMED``; the rest of the warm-up unless that first one was slow already."""
    warmups = 0 if first_ms >= SLOW_REPETITION_MS else FLOOR_WARMUP - 1
    fit = int(FLOOR_BUDGET_MS // first_ms) if first_ms > 0 else repeat
    return warmups, min(repeat, max(FLOOR_MIN_TIMED, fit))


# -- the server side of the RPC floor ----------------------------------------------------------
class RpcFloorTarget(Resident):
    """Lives on a parameter server: one preallocated buffer per message (``messages``: bucket
    index -> its ``(elements, dtype)`` messages, each sent on its own: a piece, or the bucket
    whole), nothing else."""

    def __init__(self, messages: dict[int, list[tuple]], device: str = "cpu") -> None:
        """``device``: where the run's tensors arrive (a CUDA server's GPU over device maps). A
        message answered with other bytes (``(elements, dtype, answered)``) is answered with a
        float32 buffer of its own of that many elements."""
        self.buffers = {(index, place): torch.zeros(count, dtype=DTYPES[dtype], device=device)
                        for index, parts in messages.items()
                        for place, (count, dtype, *_) in enumerate(parts)}
        self.answers = {(index, place): torch.zeros(answer[0], device=device)
                        for index, parts in messages.items()
                        for place, (_, _, *answer) in enumerate(parts) if answer}

    @staticmethod
    def add_and_answer(target: rpc.RRef, key: tuple[int, int],
                       tensor: torch.Tensor) -> torch.Tensor:
        floor = target.local_value()
        buffer = floor.buffers[key]
        buffer.add_(tensor)  # trainers race on it: the floor's numbers are never used
        return floor.answers.get(key, buffer)


# -- the trainer side --------------------------------------------------------------------------
def slowest(group: dist.ProcessGroup | None, device: torch.device | str = "cpu"):
    """``ms -> ms``: the largest of every trainer's value (an all-reduce over ``group``, on
    ``device`` for NCCL), so that every trainer picks the same repetitions; None: this process's."""
    def agree(ms: float) -> float:
        if group is None:
            return ms
        value = torch.tensor([ms], dtype=torch.float64, device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return value.item()
    return agree


def finished(device: torch.device) -> None:
    """Returns once ``device`` has done what was issued to it, on every stream (an answer over
    device maps arrives on a stream of TensorPipe's; its future's ``wait`` does not wait for
    the device)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(repeat: int, once, sync, agree=slowest(None)) -> list[float]:
    """ms of each timed repetition of ``once``, each after ``sync``: ``affordable``'s share of
    ``repeat``, after a first untimed one (agreed among the trainers by ``agree``)."""
    sync()
    start = now_ms()
    once()
    warmups, repeat = affordable(repeat, agree(now_ms() - start))
    samples = []
    for index in range(warmups + repeat):
        sync()
        start = now_ms()
        once()
        if index >= warmups:
            samples.append(now_ms() - start)
    return samples


def rpc_floor_ms(messages: dict[int, list[tuple[int, str]]],
                 owners: dict[tuple[int, int], rpc.RRef], group: dist.ProcessGroup,
                 device: torch.device, repeat: int = FLOOR_ITERATIONS,
                 place: torch.device = CPU) -> list[float]:
    """Round trips of every message (``(bucket index, place)``: a piece, or a bucket whole) to its
    owner's floor target, all sent at once, per iteration; the tensors on ``place`` (``device``
    where the run's cross RPC on the GPU, through its device maps)."""
    tensors = {(index, part): torch.ones(count, dtype=DTYPES[dtype], device=place)
               for index, parts in messages.items()
               for part, (count, dtype, *_) in enumerate(parts)}

    def once() -> None:
        futures = [rpc.rpc_async(owners[i].owner(), RpcFloorTarget.add_and_answer,
                                 args=(owners[i], i, t))
                   for i, t in tensors.items()]
        torch.futures.wait_all(futures)
        finished(place)

    return _timed(repeat, once, lambda: dist.barrier(group=group), slowest(group, device))


def echo(tensor: torch.Tensor) -> torch.Tensor:
    """Runs on a server: the message back as it came (the link probe's round trip)."""
    return tensor


def echo_ms(nbytes: int, target: rpc.RRef, group: dist.ProcessGroup, device: torch.device,
            repeat: int = FLOOR_ITERATIONS, place: torch.device = CPU) -> list[float]:
    """Round trips of one ``nbytes`` message to ``target``'s process and back, per iteration
    (``place``: as ``rpc_floor_ms``'s)."""
    tensor = torch.ones(nbytes // 4, device=place)

    def once() -> None:
        rpc.rpc_sync(target.owner(), echo, args=(tensor,))
        finished(place)

    return _timed(repeat, once, lambda: dist.barrier(group=group), slowest(group, device))


def collective_floor_ms(messages: dict[int, list[tuple[int, str]]], device: torch.device,
                        group: dist.ProcessGroup, repeat: int = FLOOR_ITERATIONS,
                        gathered: frozenset[int] = frozenset()) -> list[float]:
    """All-reduces of every bucket's messages among the trainers, all launched at once (in bucket
    and message order), per iteration; the buckets in ``gathered`` all-gathered instead, each
    trainer's message to every other (a sparse bucket: its rows differ between the trainers, and
    gloo's sparse all-reduce all-gathers them, ``costs.allgather_ms``)."""
    size = group.size()
    calls = []
    for index, parts in messages.items():
        for count, dtype, *_ in parts:
            mine = torch.ones(count, dtype=DTYPES[dtype], device=device)
            if index in gathered:
                every = torch.empty(count * size, dtype=mine.dtype, device=device)
                calls.append(functools.partial(dist.all_gather_into_tensor, every, mine,
                                               group=group, async_op=True))
            else:
                calls.append(functools.partial(dist.all_reduce, mine, group=group,
                                               async_op=True))

    def sync() -> None:
        dist.barrier(group=group)
        finished(device)

    def once() -> None:
        works = [call() for call in calls]
        for work in works:
            work.wait()
        finished(device)

    return _timed(repeat, once, sync, slowest(group, device))


def run_collective(kind: str, whole: torch.Tensor, group: dist.ProcessGroup) -> None:
    """One raw collective over ``whole`` (an all-reduce's buffer, an all-gather's output, a
    reduce-scatter's input, a broadcast's buffer from the group's first rank), waited for."""
    size = group.size()
    if kind == "all_reduce":
        dist.all_reduce(whole, group=group)
    elif kind == "broadcast":
        dist.broadcast(whole, src=dist.get_global_rank(group, 0), group=group)
    elif kind == "all_gather":
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
            whole, whole[:whole.numel() // size].clone(), group=group)
    else:  # reduce_scatter
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            whole[:whole.numel() // size].clone(), whole, group=group)


def steps_floor_ms(steps: list[tuple[str, dist.ProcessGroup, int]], device: torch.device,
                   group: dist.ProcessGroup, repeat: int = FLOOR_ITERATIONS,
                   dtype: str = "float32") -> dict[str, list[float]]:
    """A strategy's own collectives with nothing of it around them: ``steps``, ``(collective,
    group, elements)`` of ``dtype`` (its wire's), one after the other as the strategy issues
    them, each waited for; per repetition, the ms of each collective (summed over the steps of
    that kind) and their ``total``. Buffers of each step's size, padded to a multiple of its
    group's size."""
    buffers = [(kind, on, torch.ones(-(-elements // on.size()) * on.size(), device=device,
                                     dtype=DTYPES[dtype]))
               for kind, on, elements in steps]
    spent: list[dict[str, float]] = []  # per repetition, untimed ones too

    def once() -> None:
        spent.append({})
        for kind, on, buffer in buffers:
            start = now_ms()
            run_collective(kind, buffer, on)
            finished(device)
            spent[-1][kind] = spent[-1].get(kind, 0.0) + now_ms() - start

    totals = _timed(repeat, once, lambda: dist.barrier(group=group), slowest(group, device))
    samples: dict[str, list[float]] = {"total": totals}
    for repetition in spent[len(spent) - len(totals):]:
        for kind, ms in repetition.items():
            samples.setdefault(kind, []).append(ms)
    return samples


def compute_floor_ms(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                     targets: torch.Tensor, batch_size: int, group: dist.ProcessGroup | None,
                     optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                     repeat: int = FLOOR_ITERATIONS, micro_batches: int = 1,
                     autocast: Callable[[], contextlib.AbstractContextManager] =
                     contextlib.nullcontext,
                     scaler: torch.amp.GradScaler | None = None) -> list[float]:
    """The run's compute with nothing synchronised, per iteration: ``micro_batches`` forwards
    (under ``autocast``), losses and backwards of ``batch_size`` samples each (the loss a share
    of the step's, scaled by ``scaler`` where fp16 has one), then the step of ``optimizer`` (what
    builds the run's), on ``model`` (a copy, outside DDP). ``group``: the trainers, who start
    each repetition together (None: this process alone)."""
    stepper = optimizer(model.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    step_size = batch_size * micro_batches
    x, y = tuple(t[:step_size] for t in inputs), targets[:step_size]
    micro = [(tuple(t[start:start + batch_size] for t in x), y[start:start + batch_size])
             for start in range(0, step_size, batch_size)]

    def sync() -> None:
        if group is not None:
            dist.barrier(group=group)
        finished(y.device)

    def once() -> None:
        stepper.zero_grad(set_to_none=True)
        for features, labels in micro:
            with autocast():
                loss = loss_fn(model(*features), labels)
            share = loss / micro_batches if micro_batches > 1 else loss
            (scaler.scale(share) if scaler is not None else share).backward()
        if scaler is not None:
            scaler.step(stepper)
            scaler.update()
        else:
            stepper.step()
        finished(y.device)

    return _timed(repeat, once, sync, slowest(group, y.device))


def memcpy_floor(nbytes: int, repeat: int = MEMCPY_ITERATIONS) -> dict:
    """Copy bandwidth of this process: ``nbytes`` from one preallocated buffer into another."""
    source = torch.ones(max(1, nbytes // 4))
    target = torch.empty_like(source)
    samples = _timed(repeat, lambda: target.copy_(source), lambda: None)
    p50 = statistics.median(samples)
    return {"bytes": source.numel() * 4, "count": len(samples), "p50_ms": p50,
            "gbps": algbw_gbps(source.numel() * 4, p50)}
