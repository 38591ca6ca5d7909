"""What every strategy shares at run time: the context a trainer hands it, and how a strategy
wraps and steps a trainer's model (its record and ``HOOKS`` are ``ps_bench.strategies.record``).

A registry entry is a factory: ``factory(ctx, **options)`` returns either a DDP communication
hook, a callable ``(HookContext, GradBucket) -> Future[Tensor]``, or a ``Synchroniser``, which
also says how the model is wrapped (DDP, FSDP2), which optimizer steps it and what runs after
each step (model averaging, an outer optimizer). Stateless hooks are plain functions
(``@stateless``); stateful strategies are classes whose keyword arguments are their options
(``--hook-option KEY=VALUE`` or ``"hook_options"`` in JSON). Each is registered with its
``Strategy`` record, the one place that says what it sends and what it costs: validation,
``--limits`` and the tests read the record. Every hook is wrapped by ``instrument``, which
measures ``comm`` (the time during which at least one of the iteration's hook futures was
outstanding) and, with ``--verify``, captures what went in and came out.

One module per family: ``allreduce`` (all-reduce and compression, hierarchical), ``servers``
(parameter servers) and ``stale`` (their stale-synchronous mode, ``--staleness``), ``sharded``
(FSDP2, HSDP, ZeRO), ``local`` (local SGD, DiLoCo). Adding a strategy is one function or class
in its family's module, registered with its record.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from ps_bench.metrics.memory import state_tensors
from ps_bench.metrics.timers import IntervalTracker, sent_bytes
from ps_bench.metrics.wire import ByteCounter
from ps_bench.runtime.membership import MEMBERSHIP
from ps_bench.runtime.topology import PIECES, piece_owners, piece_ranges, piece_root, slice_size
from ps_bench.strategies.record import HOOKS, Strategy
from ps_bench.strategies.scratch import Scratch

Hook = Callable[["HookContext", dist.GradBucket], Future]


@dataclass
class ServerHandle:
    rref: rpc.RRef
    cuda_rpc: bool


@dataclass
class Capture:
    """One bucket of a verified iteration: the local gradient and what the strategy returned."""

    iteration: int
    bucket_index: int
    raw: torch.Tensor
    delivered: torch.Tensor | None = None
    # --trainer-timeout: the trainers dropped when it was delivered (its mean is the others')
    dropped: frozenset = frozenset()


@dataclass
class HookContext:
    """Everything a hook needs; one per trainer, shared across iterations."""

    process_group: dist.ProcessGroup
    servers: list[ServerHandle]
    mapping: str
    group_server: int | None
    cuda_rpc: bool
    rpc_timeout: float
    per_host: int | None = None  # --per-host: trainers per host (hsdp's shard group)
    comm: IntervalTracker = field(default_factory=IntervalTracker)
    # per bucket, (iteration, handed over, hook returned): what of the hook ran on backward's
    # thread, holding backward (a CPU compressor's encoding, a cast)
    held: IntervalTracker = field(default_factory=IntervalTracker)
    wire: ByteCounter = field(default_factory=ByteCounter)
    iteration: int = 0  # the trainer's current training iteration, from 1
    trainer: int = 0  # this trainer's index (who sent, to servers that may drop a trainer)
    replicas: int = 0  # --server-replicas: a lost server's replica answers for it
    # what the master runs beside the job for this strategy (``beside``: torchft's lighthouse)
    beside: dict | None = None
    rejoined: bool = False  # a trainer started again after its failure, outside the rounds
    lost_servers: set[int] = field(default_factory=set)  # the servers found gone
    # on a GPU: (iteration, CUDA event recorded as DDP handed a bucket over), in hand-over order
    ready_events: list | None = None
    capturing: bool = False  # --verify: keep this iteration's buckets
    # --verify, a strategy without a hook: the captured iteration's (inputs, targets)
    batch: tuple | None = None
    noting: bool = True  # record this iteration's bucket sizes (the trainer asks once per round)
    captures: list[Capture] = field(default_factory=list)
    # an engine's config, resolved when the job was validated (Job.engine_config)
    engine_config: dict | None = None
    # --verify with an engine: keep the engine's own counts of its collectives
    engine_bytes: bool = False
    verifying: bool = False  # --verify: some iterations will be captured
    # --reduce-dtype (or --precision's): what an engine with a policy of its own communicates in
    reduce_dtype: torch.dtype | None = None
    # the last whole iteration's buckets, index -> (payload bytes, sparse, gradient shapes): the
    # size report, --limits
    buckets: dict[int, tuple[int, bool, list]] = field(default_factory=dict)
    _filling: dict[int, tuple[int, bool, list]] = field(default_factory=dict)
    # bucket index -> (dense elements, sparse): the last whole iteration's, and this one's so far
    _layout: dict[int, tuple[int, bool]] = field(default_factory=dict)
    _seen: dict[int, tuple[int, bool]] = field(default_factory=dict)
    _piece: int | None = None  # the elements of a piece of a dense bucket (None: whole)
    _owners: dict[int, int] = field(default_factory=dict)

    def pieces(self, bucket: dist.GradBucket, piece: int | None = None, part: int = 0,
               parts: int = 1) -> list[tuple[int, int, int, int]]:
        """``(key, first element, elements, server)`` of each piece this trainer sends of the
        bucket: its ``part``-th of ``parts`` equal slices (node-aggregated servers: a slice per
        trainer of a host), cut into pieces of at most ``piece`` elements (None: whole), each a
        key of its own (``topology.piece_owners``).

        ``group``: every piece to this trainer's group server. ``shard``: the pieces are dealt
        over every server from the bucket layout of the previous iteration (DDP rebuilds its
        buckets after the first one, and launches buckets in index order, so ``is_last`` closes
        the layout), a sparse bucket whole and after the dense pieces (``piece_owners``). Sizes
        are dense sizes, identical on every trainer, so every trainer computes the same owners
        without talking to the others. Every bucket the strategy pushes passes here once an
        iteration, in order; where the last is not among them (``sparse_ps`` all-reduces the
        dense ones), the first bucket seen twice closes the layout.
        """
        tensor = bucket.buffer()
        index, elements = bucket.index(), tensor.numel()
        if index in self._seen:  # a new iteration, and the last bucket did not pass here
            self._close_layout(parts)
        self._seen[index] = (elements, tensor.is_sparse)
        if not tensor.is_sparse:
            self._piece = piece  # the strategy's, the same for every dense bucket
        first_key = (index * parts + part) * PIECES
        ranges = piece_ranges(slice_size(elements, parts), piece)
        owned = [(first_key + place, first, length) for place, (first, length) in enumerate(ranges)]
        if self.mapping == "group":
            servers = [self.group_server] * len(owned)
        else:
            servers = [self._owners.get(key, piece_root(key, len(self.servers)))
                       for key, _, _ in owned]
        if bucket.is_last():
            self._close_layout(parts)
        return [(key, first, length, server)
                for (key, first, length), server in zip(owned, servers)]

    def _close_layout(self, parts: int) -> None:
        """The buckets seen since the last close are a whole iteration's: where they differ from
        the layout the owners were dealt from, deal again."""
        if self._seen != self._layout:
            self._layout = self._seen
            self._owners = piece_owners(
                {index: size for index, (size, _) in self._layout.items()}, parts,
                len(self.servers), self._piece,
                sparse=[index for index, (_, sparse) in self._layout.items() if sparse])
        self._seen = {}

    def note_bucket(self, bucket: dist.GradBucket) -> None:
        """Keeps the bucket sizes (and the shapes of its gradients) DDP hands the hook, one whole
        iteration at a time."""
        buffer = bucket.buffer()
        shapes = ([list(gradient.shape) for gradient in bucket.gradients()]
                  if not buffer.is_sparse else [])
        self._filling[bucket.index()] = (sent_bytes(buffer), buffer.is_sparse, shapes)
        if bucket.is_last():
            self.buckets, self._filling = self._filling, {}


def stateless(name: str, record: Strategy, aliases: tuple[str, ...] = ()) -> Callable[[Hook], Hook]:
    """Registers a plain hook function (it takes no options)."""

    def decorator(function: Hook) -> Hook:
        def factory(ctx: HookContext) -> Hook:
            return function

        factory.__doc__ = function.__doc__
        HOOKS.register(name, aliases, record)(factory)
        return function

    return decorator


def build_hook(name: str, ctx: HookContext, options: dict[str, Any]) -> Hook:
    return HOOKS.get(name)(ctx, **options)


@dataclass(frozen=True)
class OptimizerSpec:
    """The run's optimizer (``--optimizer``): its class and keyword arguments, built by whoever
    steps the parameters (the trainer, or ZeRO around its shard)."""

    kind: type
    options: dict[str, Any]

    def build(self, parameters) -> torch.optim.Optimizer:
        return self.kind(parameters, **self.options)


OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def optimizer_spec(name: str, lr: float, momentum: float, weight_decay: float) -> OptimizerSpec:
    options = {"lr": lr, "weight_decay": weight_decay}
    if name == "sgd":
        options["momentum"] = momentum
    return OptimizerSpec(OPTIMIZERS[name], options)


class Synchroniser:
    """How a strategy wraps a trainer's model and steps it. This base is DDP with the strategy's
    hook and the run's optimizer; a family overrides what differs. ``after_step(ctx, model)``,
    where a strategy has one, runs after every optimizer step inside the iteration's clock and
    returns True where the replicas are now the same model; communication it does is timed into
    ``ctx.comm`` and counted on the wire like the hook's."""

    hook: Hook | None = None
    after_step: Callable[[HookContext, nn.Module], bool] | None = None
    input_dtype: torch.dtype | None = None  # an engine that casts the model: its float inputs' type
    casts_itself = False  # an engine that runs its own precision (no torch.autocast around it)
    scales_micro_losses = True  # --grad-accum: each micro-batch's loss divided by the count here

    def accumulating(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's forward and backward: ``sync`` on the step's last, where the
        gradients are synchronised; before it they are only accumulated (DDP's ``no_sync``; a
        model that is not DDP's has nothing to skip)."""
        if sync or not hasattr(model, "no_sync"):
            return contextlib.nullcontext()
        return model.no_sync()

    def micro_step(self) -> None:
        """After each micro-batch but the step's last (an engine that counts them steps here)."""

    def optimizer_for(self, ctx: HookContext, optimizer: OptimizerSpec) -> OptimizerSpec:
        """The optimizer this strategy steps the model with, from the run's (an engine's config
        may add arguments of its own); ``wrap`` builds it, and ``--limits`` steps its
        compute-only copy with the same."""
        return optimizer

    def wrap(self, network: nn.Module, ctx: HookContext, ddp_options: dict[str, Any],
             optimizer: OptimizerSpec | None) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """The model the loop trains and the optimizer that steps it."""
        model = DistributedDataParallel(network, **ddp_options)
        model.register_comm_hook(ctx, instrument(self.hook))
        return model, None if optimizer is None else optimizer.build(model.parameters())

    def backward(self, loss: torch.Tensor) -> None:
        """The backward pass, inside the clock (an engine of its own runs it its way)."""
        loss.backward()

    def note_synchronised(self, model: nn.Module) -> None:
        """Right after ``after_step`` said True, outside the clock."""

    def close(self) -> None:
        """Once training is over, on every trainer at once: stops what the strategy started."""

    def commit_log(self) -> list[dict]:
        """Each step committed, where a strategy's groups heal from a live peer: when, its step,
        the digest of what it synchronised (a group started again is compared with these)."""
        return []

    def floor_steps(self, ctx: HookContext, sends: tuple[tuple[str, str], ...], elements: int,
                    buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """``--limits``: the collectives it issues besides DDP's buckets, ``(collective, group,
        float32 elements)``, for the floor of its own steps: by default its record's ``sends``,
        each over the model's ``elements`` on the trainers' group (``buckets``: DDP's, in
        elements, for a hook that works bucket by bucket)."""
        return [(collective, ctx.process_group, elements) for collective, _ in sends]

    def held_tensors(self, model: nn.Module,
                     optimizer: torch.optim.Optimizer | None) -> dict[str, list[torch.Tensor]]:
        """The model states this trainer holds, as tensors (``metrics.memory.held_bytes`` counts
        them): its parameters (an FSDP2 shard's local part), their gradients and the
        optimizer's state (ZeroRedundancyOptimizer's: its shard's, in ``optim``)."""
        parameters = list(model.parameters())
        inner = getattr(optimizer, "optim", optimizer)
        return {"parameters": parameters,
                "gradients": [p.grad for p in parameters if p.grad is not None],
                "optimizer": [] if inner is None else state_tensors(inner.state)}

    def kept_bytes(self) -> int:
        """Bytes of the communication buffers it keeps from one iteration to the next
        (``Scratch``): not model states, but held through the next forward all the same."""
        return 0

    def end_round(self, ctx: HookContext, model: nn.Module) -> None:
        """After a round, outside the clock: whatever ``parameters_vector`` needs."""

    def parameters_vector(self, model: nn.Module) -> torch.Tensor:
        """This replica's parameters, flattened on the CPU, as its record's ``identical`` says."""
        return flat_parameters(model.parameters()).cpu()

    def full_parameters(self, model: nn.Module) -> torch.Tensor:
        """This replica's whole parameters now, flattened on its device (every trainer at once)."""
        return flat_parameters(model.parameters())


class HookOnly(Synchroniser):
    """A DDP communication hook, and nothing else."""

    def __init__(self, hook: Hook) -> None:
        self.hook = hook

    def kept_bytes(self) -> int:
        """Its ``Scratch``'s, and what else the hook says it keeps (``kept_bytes``: error
        feedback's residuals, PowerSGD's error and factor memory)."""
        scratch = getattr(self.hook, "scratch", None)
        own = getattr(self.hook, "kept_bytes", None)
        return ((scratch.nbytes() if isinstance(scratch, Scratch) else 0) +
                (own() if callable(own) else 0))

    def floor_steps(self, ctx: HookContext, sends: tuple[tuple[str, str], ...], elements: int,
                    buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """A hook that steps through groups of its own says which (``floor_steps(buckets)``)."""
        steps = getattr(self.hook, "floor_steps", None)
        return (steps(buckets) if steps is not None
                else super().floor_steps(ctx, sends, elements, buckets))


def flat_parameters(parameters) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in parameters])


def fingerprint(vector: torch.Tensor) -> dict:
    """A replica's parameters in a few bytes, for the replica check: a digest of their exact bits
    and their norm. Equal digests mean identical replicas, so the master fetches the vectors
    themselves only when the digests differ (VGG-16's would be 553 MB from every trainer)."""
    vector = vector.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.blake2b(vector.view(torch.uint8).numpy(), digest_size=32).hexdigest()
    return {"digest": digest, "norm": parameter_norm(vector)}


def parameter_norm(vector: torch.Tensor, chunk: int = 1 << 22) -> float:
    """The 2-norm of a flat vector, summed in float64 a chunk at a time (no float64 copy of the
    whole model); not finite when any parameter is not."""
    return math.sqrt(sum(torch.linalg.vector_norm(part, dtype=torch.float64).item() ** 2
                         for part in vector.split(chunk)))


def build_synchroniser(name: str, ctx: HookContext, options: dict[str, Any]) -> Synchroniser:
    made = build_hook(name, ctx, options)
    return made if isinstance(made, Synchroniser) else HookOnly(made)


def timed_collective(ctx: HookContext, run: Callable[[], Any]) -> Any:
    """Runs a collective that ``after_step`` issues; its interval is the iteration's comm."""
    start = time.perf_counter()
    try:
        return run()
    finally:
        ctx.comm.add((ctx.iteration, start, time.perf_counter()))


def instrument(hook: Hook) -> Hook:
    """Times the hook's future and, on captured iterations, keeps its input and output.

    Every bucket of every iteration pays for this wrapper: three clock reads and two appends, of
    ``(iteration, start, end)`` and ``(iteration, start, returned)``; the trainer turns them into
    ``comm`` and the bucket timeline after the round (DDP hands the buckets over in index order,
    so an iteration's k-th start is bucket k's), the second into how long the hook held backward."""
    clock = time.perf_counter

    def run(ctx, bucket):  # unannotated: DDP rejects string annotations
        iteration, capture = ctx.iteration, None
        if ctx.capturing:
            capture = Capture(iteration, bucket.index(), bucket.buffer().detach().clone())
            ctx.captures.append(capture)
        if ctx.noting:
            ctx.note_bucket(bucket)
        start = clock()
        # a GPU: when the device had made the bucket, on its own clock
        if ctx.ready_events is not None:
            made = torch.cuda.Event(enable_timing=True)
            made.record()
            ctx.ready_events.append((iteration, made))
        future = hook(ctx, bucket)
        returned = clock()
        ctx.held.add((iteration, start, returned))
        # finished already (noop, a local fast path): nothing to wait for
        if future.done() and capture is None:
            ctx.comm.add((iteration, start, returned))
            return future

        def finished(fut: Future) -> torch.Tensor:
            ctx.comm.add((iteration, start, clock()))
            value = fut.value()
            if capture is not None:
                capture.delivered = value.detach().clone()
                capture.dropped = frozenset(MEMBERSHIP.dropped)
            return value

        # A chained future, not a done callback: DDP waits on what the hook returns, and a done
        # callback may still be running (recording the interval, copying the answer) after that
        # wait has returned and the next iteration has begun.
        return future.then(finished)

    return run


