"""The parameter-server family: DDP buckets sent over RPC to the servers that own them, which
answer with the average (float32 or 16 bits on the wire), and its sparse/dense hybrid."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.futures import Future

from ps_bench.metrics.timers import tensor_bytes
from ps_bench.servers.base import ParameterServer
from ps_bench.strategies.allreduce import allreduce
from ps_bench.strategies.base import RPC, SERVERS, SPARSE_SERVERS, HookContext, Strategy, stateless


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
    peer = server.rref.owner().id  # the server's rank in the job
    ctx.wire.add(sent=tensor_bytes(payload), peer=peer)
    reply = rpc.rpc_async(
        server.rref.owner(),
        ParameterServer.average_gradient,
        args=(server.rref, bucket.index(), payload, ctx.iteration),
        timeout=ctx.rpc_timeout,
    )

    def received(fut: Future) -> torch.Tensor:
        average = fut.value()
        ctx.wire.add(recv=tensor_bytes(average), peer=peer)
        return average.to(device=tensor.device, dtype=tensor.dtype)

    return reply.then(received)


@stateless("ps", Strategy(RPC, "float32", lossless=True, sparse_buckets=SPARSE_SERVERS, family=SERVERS),
           aliases=("rpc_hook",))
def parameter_server(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """Every bucket to its parameter server over RPC, which answers with the average; lossless."""
    return send_to_server(ctx, bucket)


@stateless("ps_fp16", Strategy(RPC, "float16", lossless=False, sparse_buckets=SPARSE_SERVERS, uncompressed="ps",
                                   family=SERVERS))
def parameter_server_fp16(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """The ps strategy with float16 on the wire (servers add in float32); lossy."""
    return send_to_server(ctx, bucket, torch.float16)


@stateless("ps_bf16", Strategy(RPC, "bfloat16", lossless=False, sparse_buckets=SPARSE_SERVERS, uncompressed="ps",
                                   family=SERVERS))
def parameter_server_bf16(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """The ps strategy with bfloat16 on the wire (servers add in float32); lossy."""
    return send_to_server(ctx, bucket, torch.bfloat16)


# held against the RPC floor: its dense buckets are all-reduced, but what it is for is the servers
@stateless("sparse_ps", Strategy(RPC, "float32", lossless=True, sparse_buckets=SPARSE_SERVERS, family=SERVERS,
                                 for_sparse="allreduce"),
           aliases=("sparse_rpc_hook",))
def sparse_parameter_server(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """Sparse gradients to the parameter servers, dense ones all-reduced among trainers; lossless."""
    if bucket.buffer().is_sparse:
        return send_to_server(ctx, bucket)
    return allreduce(ctx, bucket)


