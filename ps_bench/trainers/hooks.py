"""DDP communication hooks (gradient strategies), registered by the names users type.

A registry entry is a factory: ``factory(ctx, **options)`` returns a callable
``(HookContext, GradBucket) -> Future[Tensor]``. Stateless strategies are plain functions
(``@stateless``); stateful ones (PowerSGD) are classes whose keyword arguments are the hook's
options (``--hook-option KEY=VALUE`` or ``"hook_options"`` in JSON). Each is registered with
its ``Strategy`` record, the one place that says what it sends and what it costs: validation,
``--limits`` and the tests read the record. Every hook is wrapped by ``instrument``, which
measures ``comm`` (the time during which at least one of the iteration's hook futures was
outstanding) and, with ``--verify``, captures what went in and came out.

Adding a strategy is one function (or class) here, registered with its record.
"""

from __future__ import annotations

import functools
import inspect
import time
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    powerSGD_hook,
)
from torch.futures import Future

from ps_bench.config import as_type
from ps_bench.metrics.timers import IntervalTracker, tensor_bytes
from ps_bench.metrics.wire import ByteCounter
from ps_bench.registry import Registry
from ps_bench.servers.base import ParameterServer
from ps_bench.topology import balance_buckets

Hook = Callable[["HookContext", dist.GradBucket], Future]
COLLECTIVE, RPC = "collective", "rpc"  # transports
PAYLOADS = ("float32", "float16", "bfloat16", "low-rank factors", "nothing")
# What a strategy does with a sparse bucket: all-reduce it as it is on the trainers' group
# (NCCL cannot), all-reduce it through the CPU over gloo (needs gloo in the group: multi), or
# send it to a parameter server.
SPARSE_ALLREDUCE, SPARSE_GLOO, SPARSE_SERVERS = "allreduce", "gloo", "servers"


@dataclass(frozen=True)
class Strategy:
    """Everything ps_bench knows about a strategy without running it."""

    transport: str | None  # COLLECTIVE: all-reduce among trainers; RPC: buckets to parameter servers; None: nothing
    payload: str  # what crosses the transport, one of PAYLOADS
    lossless: bool  # every trainer receives the exact mean gradient
    sparse_buckets: str | None  # SPARSE_ALLREDUCE, SPARSE_GLOO, SPARSE_SERVERS; None: it moves nothing
    uncompressed: str | None = None  # a lossy strategy: the lossless one whose bytes it reduces
    factors: str | None = None  # low-rank factors of each "tensor", or of the "bucket" as one square matrix

    def __post_init__(self) -> None:
        if (self.transport not in (COLLECTIVE, RPC, None) or self.payload not in PAYLOADS
                or self.sparse_buckets not in (SPARSE_ALLREDUCE, SPARSE_GLOO, SPARSE_SERVERS, None)):
            raise ValueError(f"bad strategy record {self}")
        if self.transport is not None and self.lossless == (self.uncompressed is not None):
            raise ValueError(f"a lossy strategy names the lossless one it compresses, and only it: {self}")
        if (self.payload == "low-rank factors") != (self.factors in ("tensor", "bucket")):
            raise ValueError(f"a low-rank strategy says what it factors, each tensor or the bucket: {self}")

    @property
    def needs_servers(self) -> bool:
        return self.transport == RPC

    @property
    def floor(self) -> str | None:
        """The ``--limits`` floor it is held against: the raw transfer over its transport."""
        return self.transport


HOOKS: Registry = Registry("hook", record_type=Strategy)


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


@dataclass
class HookContext:
    """Everything a hook needs; one per trainer, shared across iterations."""

    process_group: dist.ProcessGroup
    servers: list[ServerHandle]
    mapping: str
    group_server: int | None
    cuda_rpc: bool
    rpc_timeout: float
    comm: IntervalTracker = field(default_factory=IntervalTracker)
    wire: ByteCounter = field(default_factory=ByteCounter)
    iteration: int = 0  # the trainer's current training iteration, from 1
    capturing: bool = False  # --verify: keep this iteration's buckets
    noting: bool = True  # record this iteration's bucket sizes (the trainer asks once per round)
    captures: list[Capture] = field(default_factory=list)
    # the last whole iteration's buckets, index -> (payload bytes, sparse, gradient shapes): the size
    # report, --limits
    buckets: dict[int, tuple[int, bool, list]] = field(default_factory=dict)
    _filling: dict[int, tuple[int, bool, list]] = field(default_factory=dict)
    _layout: dict[int, int] = field(default_factory=dict)
    _seen: dict[int, int] = field(default_factory=dict)
    _owners: dict[int, int] = field(default_factory=dict)

    def server_for(self, bucket: dist.GradBucket) -> int:
        """The server that owns this bucket.

        ``group``: this trainer's group server. ``shard``: owners balance bytes across servers;
        they are computed from the bucket layout of the previous iteration (DDP rebuilds its
        buckets after the first one, and launches buckets in index order, so ``is_last`` closes
        the layout). Sizes are dense sizes, identical on every trainer, so every trainer
        computes the same owners without talking to the others.
        """
        if self.mapping == "group":
            return self.group_server
        tensor = bucket.buffer()
        index = bucket.index()
        self._seen[index] = tensor.numel() * tensor.element_size()
        owner = self._owners.get(index, index % len(self.servers))
        if bucket.is_last():
            if self._seen != self._layout:
                self._layout = self._seen
                self._owners = balance_buckets(self._layout, len(self.servers))
            self._seen = {}
        return owner

    def note_bucket(self, bucket: dist.GradBucket) -> None:
        """Keeps the bucket sizes (and the shapes of its gradients) DDP hands the hook, one whole
        iteration at a time."""
        buffer = bucket.buffer()
        shapes = [list(gradient.shape) for gradient in bucket.gradients()] if not buffer.is_sparse else []
        self._filling[bucket.index()] = (tensor_bytes(buffer), buffer.is_sparse, shapes)
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


def option_types(name: str) -> dict[str, tuple[type, Any]]:
    """The options a hook takes: name -> (type, default)."""
    factory = HOOKS.get(name)
    target = factory.__init__ if inspect.isclass(factory) else factory
    hints = typing.get_type_hints(target)
    out = {}
    for parameter in list(inspect.signature(factory).parameters.values())[1:]:  # after ctx
        out[parameter.name] = (hints[parameter.name], parameter.default)
    return out


def hook_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options a hook runs with: its defaults, then ``options``."""
    return {**{key: default for key, (_, default) in option_types(name).items()}, **options}


def check_hook_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Validates options for a hook; raises ValueError with a sentence for people."""
    known = option_types(name)
    checked = {}
    for key, value in options.items():
        if key not in known:
            valid = ", ".join(known) if known else "none (this hook takes no options)"
            raise ValueError(f"hook {name!r} has no option {key!r}; its options: {valid}")
        kind = known[key][0]
        try:
            checked[key] = as_type(value, kind)
        except TypeError:
            raise ValueError(f"hook option {key!r} must be {kind.__name__}; got {value!r}") from None
    factory = HOOKS.get(name)
    if hasattr(factory, "check"):
        factory.check(**{k: d for k, (_, d) in known.items()} | checked)
    return checked


def instrument(hook: Hook) -> Hook:
    """Times the hook's future and, on captured iterations, keeps its input and output.

    Every bucket of every iteration pays for this wrapper: two clock reads and one append of
    ``(iteration, start, end)``; the trainer turns them into ``comm`` and the bucket timeline
    after the round (DDP hands the buckets over in index order, so an iteration's k-th start is
    bucket k's)."""
    clock = time.perf_counter

    def run(ctx, bucket):  # unannotated: DDP rejects string annotations
        iteration, capture = ctx.iteration, None
        if ctx.capturing:
            capture = Capture(iteration, bucket.index(), bucket.buffer().detach().clone())
            ctx.captures.append(capture)
        if ctx.noting:
            ctx.note_bucket(bucket)
        start = clock()
        future = hook(ctx, bucket)
        if future.done() and capture is None:  # finished already (noop, a local fast path): nothing to wait for
            ctx.comm.add((iteration, start, clock()))
            return future

        def finished(fut: Future) -> torch.Tensor:
            ctx.comm.add((iteration, start, clock()))
            value = fut.value()
            if capture is not None:
                capture.delivered = value.detach().clone()
            return value

        # A chained future, not a done callback: DDP waits on what the hook returns, and a done
        # callback may still be running (recording the interval, copying the answer) after that
        # wait has returned and the next iteration has begun.
        return future.then(finished)

    return run


# -- collectives -------------------------------------------------------------------------------
@stateless("allreduce", Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=SPARSE_ALLREDUCE),
           aliases=("allreduce_hook",))
def allreduce(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """All-reduce average over the trainer process group (DDP's default); lossless."""
    return default_hooks.allreduce_hook(ctx.process_group, bucket)


@stateless("hybrid", Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=SPARSE_GLOO),
           aliases=("hybrid_hook",))
def hybrid(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """All-reduce, sparse buckets through the CPU (gloo), dense on the trainer's device (nccl with --backend multi); lossless."""
    tensor = bucket.buffer()
    if not (tensor.is_sparse and tensor.is_cuda):
        return allreduce(ctx, bucket)
    host = tensor.cpu()
    host.div_(ctx.process_group.size())
    work = dist.all_reduce(host, group=ctx.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0].to(tensor.device))


def dense_only(compressed: Hook) -> Hook:
    """Compression applies to dense buckets; sparse ones are all-reduced as they are."""

    @functools.wraps(compressed)
    def run(ctx: HookContext, bucket: dist.GradBucket) -> Future:
        return allreduce(ctx, bucket) if bucket.buffer().is_sparse else compressed(ctx, bucket)

    return run


@stateless("fp16", Strategy(COLLECTIVE, "float16", lossless=False, sparse_buckets=SPARSE_ALLREDUCE,
                             uncompressed="allreduce"),
           aliases=("fp16_hook", "fp16_compress_hook"))
@dense_only
def fp16(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """All-reduce in float16 (torch's fp16_compress_hook); lossy."""
    return default_hooks.fp16_compress_hook(ctx.process_group, bucket)


@stateless("bf16", Strategy(COLLECTIVE, "bfloat16", lossless=False, sparse_buckets=SPARSE_ALLREDUCE,
                             uncompressed="allreduce"),
           aliases=("bf16_hook", "bf16_compress_hook"))
@dense_only
def bf16(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """All-reduce in bfloat16 (torch's bf16_compress_hook); lossy."""
    return default_hooks.bf16_compress_hook(ctx.process_group, bucket)


def settle(target: Future, source: Future) -> None:
    """Completes ``target`` as ``source`` completed: with its value or its exception."""
    try:
        target.set_result(source.value())
    except Exception as error:  # noqa: BLE001 - source's own failure, passed on
        target.set_exception(error)


class PowerSGD:
    """Low-rank compression around all-reduce (torch's PowerSGD, per tensor); lossy."""

    hook = staticmethod(powerSGD_hook.powerSGD_hook)

    def __init__(
        self,
        ctx: HookContext,
        matrix_approximation_rank: int = 2,
        start_powerSGD_iter: int = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        min_compression_rate: float = 2.0,
    ) -> None:
        self.state = powerSGD_hook.PowerSGDState(
            process_group=ctx.process_group,
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            min_compression_rate=min_compression_rate,
            random_seed=0,
        )
        self.previous: Future | None = None  # the last bucket's future (see after_previous)

    @staticmethod
    def check(matrix_approximation_rank: int, start_powerSGD_iter: int, use_error_feedback: bool,
              warm_start: bool, min_compression_rate: float) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(f"hook option 'matrix_approximation_rank' must be at least 1; got {matrix_approximation_rank}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("hook option 'start_powerSGD_iter' must be more than 1 with error feedback or warm "
                             "start (DDP rebuilds its buckets after the first iteration)")

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        if bucket.buffer().is_sparse:  # as dense_only does for the stateless hooks
            return self.after_previous(lambda: allreduce(ctx, bucket))
        return self.after_previous(lambda: self.hook(self.state, bucket))

    def after_previous(self, start: Callable[[], Future]) -> Future:
        """Starts a bucket's communication once the previous bucket's has finished.

        torch's PowerSGD issues its second and third all-reduce of a bucket from callbacks of
        the first. Over gloo those callbacks run whenever each CPU collective completes, so with
        several buckets in flight two trainers could issue the next bucket's all-reduce and
        this bucket's in different orders, a collective mismatch (gloo aborts, or hangs). One
        bucket at a time keeps the order the same on every trainer; over NCCL a future
        completes as soon as its kernel is queued, so the chain costs no overlap there.
        """
        previous, done = self.previous, Future()
        self.previous = done

        def launch(_: Future | None = None) -> None:
            try:
                start().add_done_callback(lambda finished: settle(done, finished))
            except Exception as error:  # noqa: BLE001 - the trainer waits on this future
                done.set_exception(error)

        if previous is None:
            launch()
        else:
            previous.add_done_callback(launch)
        return done


# Both PowerSGD hooks send all-reduces of low-rank factors (sparse buckets whole): per tensor, the
# tensors not worth compressing, then every P, then every Q; batched, the bucket's P, then its Q.
@HOOKS.register("powersgd", aliases=("powerSGD_hook",),
                record=Strategy(COLLECTIVE, "low-rank factors", lossless=False, sparse_buckets=SPARSE_ALLREDUCE,
                                uncompressed="allreduce", factors="tensor"))
class PowerSGDHook(PowerSGD):
    """Low-rank compression around all-reduce (torch's powerSGD_hook, per tensor); lossy."""


def _orthogonalize_one_or_many(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """torch 2.13's batched_powerSGD_hook hands ``_orthogonalize`` a single 2-D matrix, which it
    rejects (it expects a batch); a batch of one is the same computation, in place."""
    _orthogonalize_batch(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)


_orthogonalize_batch = powerSGD_hook._orthogonalize


@HOOKS.register("batched_powersgd", aliases=("batched_powerSGD_hook",),
                record=Strategy(COLLECTIVE, "low-rank factors", lossless=False, sparse_buckets=SPARSE_ALLREDUCE,
                                uncompressed="allreduce", factors="bucket"))
class BatchedPowerSGDHook(PowerSGD):
    """Low-rank compression of each whole bucket as one square matrix (torch's batched_powerSGD_hook); lossy."""

    hook = staticmethod(powerSGD_hook.batched_powerSGD_hook)


if getattr(powerSGD_hook._orthogonalize, "__name__", "") == "_orthogonalize":
    # Widens torch's check (3-D batches behave exactly as before) so the batched hook runs.
    powerSGD_hook._orthogonalize = _orthogonalize_one_or_many


# -- parameter servers -------------------------------------------------------------------------
def send_to_server(ctx: HookContext, bucket: dist.GradBucket, wire_dtype: torch.dtype | None = None) -> Future:
    """Sends the bucket to its server (cast to ``wire_dtype`` on the wire) and returns the
    global average it answers with, on the bucket's device and in its dtype."""
    tensor = bucket.buffer()
    server = ctx.servers[ctx.server_for(bucket)]
    # CUDA sparse tensors cannot cross RPC, and device maps exist only CUDA-RPC <-> CUDA servers.
    on_device = ctx.cuda_rpc and server.cuda_rpc and not tensor.is_sparse
    payload = tensor if on_device else tensor.cpu()
    if payload.is_sparse:
        payload = payload.coalesce()
    if wire_dtype is not None:
        payload = payload.to(wire_dtype)
    ctx.wire.add(sent=tensor_bytes(payload))
    reply = rpc.rpc_async(
        server.rref.owner(),
        ParameterServer.average_gradient,
        args=(server.rref, bucket.index(), payload, ctx.iteration),
        timeout=ctx.rpc_timeout,
    )

    def received(fut: Future) -> torch.Tensor:
        average = fut.value()
        ctx.wire.add(recv=tensor_bytes(average))
        return average.to(device=tensor.device, dtype=tensor.dtype)

    return reply.then(received)


@stateless("ps", Strategy(RPC, "float32", lossless=True, sparse_buckets=SPARSE_SERVERS), aliases=("rpc_hook",))
def parameter_server(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """Every bucket to its parameter server over RPC, which answers with the average; lossless."""
    return send_to_server(ctx, bucket)


@stateless("ps_fp16", Strategy(RPC, "float16", lossless=False, sparse_buckets=SPARSE_SERVERS, uncompressed="ps"))
def parameter_server_fp16(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """The ps strategy with float16 on the wire (servers add in float32); lossy."""
    return send_to_server(ctx, bucket, torch.float16)


@stateless("ps_bf16", Strategy(RPC, "bfloat16", lossless=False, sparse_buckets=SPARSE_SERVERS, uncompressed="ps"))
def parameter_server_bf16(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """The ps strategy with bfloat16 on the wire (servers add in float32); lossy."""
    return send_to_server(ctx, bucket, torch.bfloat16)


# held against the RPC floor: its dense buckets are all-reduced, but what it is for is the servers
@stateless("sparse_ps", Strategy(RPC, "float32", lossless=True, sparse_buckets=SPARSE_SERVERS),
           aliases=("sparse_rpc_hook",))
def sparse_parameter_server(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """Sparse gradients to the parameter servers, dense ones all-reduced among trainers; lossless."""
    if bucket.buffer().is_sparse:
        return send_to_server(ctx, bucket)
    return allreduce(ctx, bucket)


@HOOKS.register("noop", aliases=("noop_hook",),
                record=Strategy(None, "nothing", lossless=False, sparse_buckets=None))
def noop(ctx: HookContext) -> Hook:
    """No communication, the compute-only headroom: replicas drift apart by design."""
    return debugging_hooks.noop_hook  # torch's own, called directly: it ignores the state
