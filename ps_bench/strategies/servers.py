"""The parameter-server family: DDP buckets sent over RPC to the servers that own them, which
answer with the average (float32 or 16 bits on the wire), its sparse/dense hybrid, and the
node-aggregated form for hosts of several trainers (``ps_node``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.futures import Future

from ps_bench.metrics.timers import tensor_bytes
from ps_bench.servers.base import ParameterServer
from ps_bench.strategies.allreduce import InOrder, allreduce, gather_into
from ps_bench.strategies.base import HookContext, stateless
from ps_bench.strategies.record import HOOKS, RPC, SERVERS, SPARSE_SERVERS, Cost, Strategy


def send_to_server(ctx: HookContext, bucket: dist.GradBucket,
                   wire_dtype: torch.dtype | None = None) -> Future:
    """Sends the bucket to its server (cast to ``wire_dtype`` on the wire) and returns the
    global average it answers with, on the bucket's device and in its dtype."""
    return send_tensor(ctx, bucket.buffer(), bucket.index(), ctx.server_for(bucket), wire_dtype)


def send_tensor(ctx: HookContext, tensor: torch.Tensor, key: int, server_index: int,
                wire_dtype: torch.dtype | None = None) -> Future:
    """Sends ``tensor`` as the server's bucket ``key`` and returns what the server answers, on
    the tensor's device and in its dtype."""
    server = ctx.servers[server_index]
    # CUDA sparse tensors cannot cross RPC, and device maps exist only CUDA-RPC <-> CUDA servers.
    on_device = ctx.cuda_rpc and server.cuda_rpc and not tensor.is_sparse
    payload = tensor if on_device else tensor.cpu()
    if payload.is_sparse:
        payload = payload.coalesce()
    if wire_dtype is not None:
        payload = payload.to(wire_dtype)
    peer = server.rref.owner().id  # the server's rank in the job
    ctx.wire.add(sent=tensor_bytes(payload), peer=peer)
    reply = rpc.rpc_async(
        server.rref.owner(),
        ParameterServer.average_gradient,
        args=(server.rref, key, payload, ctx.iteration),
        timeout=ctx.rpc_timeout,
    )

    def received(fut: Future) -> torch.Tensor:
        average = fut.value()
        ctx.wire.add(recv=tensor_bytes(average), peer=peer)
        return average.to(device=tensor.device, dtype=tensor.dtype)

    return reply.then(received)


@stateless("ps", Strategy(RPC, "float32", lossless=True, sparse_buckets=SPARSE_SERVERS,
                          family=SERVERS),
           aliases=("rpc_hook",))
def parameter_server(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """Every bucket to its parameter server over RPC, which answers with the average; lossless."""
    return send_to_server(ctx, bucket)


@stateless("ps_fp16", Strategy(RPC, "float16", lossless=False, sparse_buckets=SPARSE_SERVERS,
                               uncompressed="ps", family=SERVERS))
def parameter_server_fp16(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """The ps strategy with float16 on the wire (servers add in float32); lossy."""
    return send_to_server(ctx, bucket, torch.float16)


@stateless("ps_bf16", Strategy(RPC, "bfloat16", lossless=False, sparse_buckets=SPARSE_SERVERS,
                               uncompressed="ps", family=SERVERS))
def parameter_server_bf16(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """The ps strategy with bfloat16 on the wire (servers add in float32); lossy."""
    return send_to_server(ctx, bucket, torch.bfloat16)


# held against the RPC floor: its dense buckets are all-reduced, but what it is for is the servers
@stateless("sparse_ps", Strategy(RPC, "float32", lossless=True, sparse_buckets=SPARSE_SERVERS,
                                 family=SERVERS, for_sparse="allreduce"),
           aliases=("sparse_rpc_hook",))
def sparse_parameter_server(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """Sparse gradients to the parameter servers, dense ones all-reduced among trainers;
    lossless."""
    if bucket.buffer().is_sparse:
        return send_to_server(ctx, bucket)
    return allreduce(ctx, bucket)


@HOOKS.register("ps_node", aliases=("ps_host", "byteps"),
                record=Strategy(RPC, "float32", lossless=True, sparse_buckets=None, family=SERVERS,
                                per_host=True, cost=Cost(like="ps")))
class NodeAggregated(InOrder):
    """Parameter servers as deployed on nodes of several GPUs (BytePS's layout; TensorFlow's and
    MXNet's device-then-server kvstores): each bucket summed within the host (--per-host G),
    each of the host's trainers pushing its 1/G slice of the sum to the slice's server and pulling
    the average, then the slices all-gathered within the host; lossless.

    A host's link carries its gradient once each way, not G copies: 1/G of ``ps``'s bytes between
    hosts. gloo has no reduce-scatter, so the sum within the host is an all-reduce (NCCL's
    reduce-scatter would move half). Buckets go one at a time, each step issued when the previous
    one completes, so every trainer issues the host's collectives in the same order. Dense models
    only: a sparse bucket's rows differ between the trainers of a host."""

    def __init__(self, ctx: HookContext) -> None:
        size, per_host = ctx.process_group.size(), ctx.per_host
        hosts = size // per_host
        self.intra, _ = dist.new_subgroups_by_enumeration(
            [list(range(host * per_host, (host + 1) * per_host)) for host in range(hosts)])
        self.local, self.per_host = dist.get_rank() % per_host, per_host

    def floor_steps(self, buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """``--limits``: each bucket's sum and all-gather within the host (its slices' pushes and
        pulls are the floor of its own messages, ``limits.floor_messages(slices=G)``)."""
        return [step for elements in buckets for step in (
            ("all_reduce", self.intra, elements), ("all_gather", self.intra, elements))]

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        # every bucket, in order: it closes the layout
        server = ctx.server_for(bucket, self.local, self.per_host)
        return self.after_previous(lambda: self.aggregated(ctx, bucket, server))

    def aggregated(self, ctx: HookContext, bucket: dist.GradBucket, server: int) -> Future:
        tensor = bucket.buffer()
        numel, done, key = tensor.numel(), Future(), bucket.index() * self.per_host + self.local
        padded = (torch.cat([tensor, tensor.new_zeros(-numel % self.per_host)])
                  if numel % self.per_host else tensor.clone())
        rows = padded.view(self.per_host, -1)

        def step(run, then) -> None:
            def next_step(finished: Future) -> None:
                try:
                    then(finished.wait())
                except Exception as error:  # noqa: BLE001 - the trainer waits on ``done``
                    done.set_exception(error)
            run().add_done_callback(next_step)

        def gathered(_) -> None:
            done.set_result(padded[:numel].view_as(tensor))

        def pulled(average: torch.Tensor) -> None:
            rows[self.local].copy_(average)
            step(lambda: gather_into(padded, rows[self.local].clone(), self.intra).get_future(),
                 gathered)

        def summed(_) -> None:
            step(lambda: send_tensor(ctx, rows[self.local].contiguous(), key, server), pulled)

        step(lambda: dist.all_reduce(padded, group=self.intra, async_op=True).get_future(), summed)
        return done
