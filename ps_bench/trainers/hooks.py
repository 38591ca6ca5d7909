"""DDP communication hooks: one ``Callable[[HookContext, GradBucket], Future[Tensor]]`` each.

Every hook is wrapped by ``timed`` so the trainer can report ``comm``: the time during which
at least one of the iteration's hook futures was outstanding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.futures import Future

from ps_bench.metrics.timers import IntervalTracker, now_ms, tensor_bytes
from ps_bench.registry import Registry
from ps_bench.servers.base import ParameterServer
from ps_bench.topology import balance_buckets

Hook = Callable[["HookContext", dist.GradBucket], Future]
HOOKS: Registry[Hook] = Registry("hook")
# Hooks that send gradients to parameter servers (they need at least one server).
SERVER_HOOKS = {"ps", "sparse_ps"}


@dataclass
class ServerHandle:
    rref: rpc.RRef
    cuda_rpc: bool


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
    bytes_sent: int = 0
    bytes_recv: int = 0
    iteration: int = 0  # the trainer's current training iteration, from 1
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _layout: dict[int, int] = field(default_factory=dict)
    _seen: dict[int, int] = field(default_factory=dict)
    _owners: dict[int, int] = field(default_factory=dict)

    def count(self, sent: int = 0, recv: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_recv += recv

    def take_bytes(self) -> tuple[int, int]:
        with self._lock:
            out = (self.bytes_sent, self.bytes_recv)
            self.bytes_sent = self.bytes_recv = 0
        return out

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


def timed(hook: Hook) -> Hook:
    def run(ctx, bucket):  # unannotated: DDP rejects string annotations
        start = now_ms()

        def finished(fut: Future) -> torch.Tensor:
            ctx.comm.add(start, now_ms())
            return fut.value()

        return hook(ctx, bucket).then(finished)

    run.__name__ = hook.__name__
    return run


def ring_allreduce_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


@HOOKS.register("allreduce", aliases=("allreduce_hook",))
def allreduce(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """All-reduce average over the trainer process group (DDP's default)."""
    tensor = bucket.buffer()
    world = ctx.process_group.size()
    if tensor.is_sparse:  # gloo's sparse all-reduce gathers every rank's indices and values
        moved = (world - 1) * tensor_bytes(tensor.coalesce())
    else:
        moved = ring_allreduce_bytes(tensor_bytes(tensor), world)
    ctx.count(sent=moved, recv=moved)
    return default_hooks.allreduce_hook(ctx.process_group, bucket)


@HOOKS.register("ps", aliases=("rpc_hook",))
def parameter_server(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """Every bucket to its server over RPC; the answer is the global average."""
    tensor = bucket.buffer()
    server = ctx.servers[ctx.server_for(bucket)]
    # CUDA sparse tensors cannot cross RPC, and device maps exist only CUDA-RPC <-> CUDA servers.
    on_device = ctx.cuda_rpc and server.cuda_rpc and not tensor.is_sparse
    payload = tensor if on_device else tensor.cpu()
    if payload.is_sparse:
        payload = payload.coalesce()
    ctx.count(sent=tensor_bytes(payload))
    reply = rpc.rpc_async(
        server.rref.owner(),
        ParameterServer.average_gradient,
        args=(server.rref, bucket.index(), payload, ctx.iteration),
        timeout=ctx.rpc_timeout,
    )

    def received(fut: Future) -> torch.Tensor:
        average = fut.value()
        ctx.count(recv=tensor_bytes(average))
        return average.to(tensor.device)

    return reply.then(received)


@HOOKS.register("sparse_ps", aliases=("sparse_rpc_hook",))
def sparse_parameter_server(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """Sparse gradients to the parameter servers, dense ones all-reduced among trainers."""
    if bucket.buffer().is_sparse:
        return parameter_server(ctx, bucket)
    return allreduce(ctx, bucket)


@HOOKS.register("noop", aliases=("noop_hook",))
def noop(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """No communication, the compute-only headroom: replicas drift apart by design."""
    return debugging_hooks.noop_hook(None, bucket)
