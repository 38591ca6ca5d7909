"""The parameter-server family: DDP buckets sent over RPC to the servers that own them, which
answer with the average (float32 or 16 bits on the wire), its sparse/dense hybrid, and the
node-aggregated form for hosts of several trainers (``ps_node``)."""

from __future__ import annotations

import functools
import threading
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.futures import Future

from ps_bench.metrics.timers import tensor_bytes
from ps_bench.runtime.topology import piece_ranges, slice_size
from ps_bench.servers.base import ParameterServer
from ps_bench.servers.replicas import failover
from ps_bench.strategies.allreduce import allreduce, gather_into, host_rows
from ps_bench.runtime.futures import device_future, issuing_stream, settle
from ps_bench.strategies.base import HookContext
from ps_bench.strategies.codecs import CODECS, check_ratio, named_codec
from ps_bench.strategies.compressors import Compressed, QSGDHook
from ps_bench.strategies.partitions import Partitioned, assembled
from ps_bench.strategies.record import HOOKS, RPC, SERVERS, SPARSE_SERVERS, Cost, Strategy


def send_to_server(ctx: HookContext, bucket: dist.GradBucket,
                   wire_dtype: torch.dtype | None = None) -> Future:
    """Sends the bucket whole to its server (cast to ``wire_dtype`` on the wire) and returns the
    global average it answers with, on the bucket's device and in its dtype."""
    (key, _, _, server), = ctx.pieces(bucket)
    return send_tensor(ctx, bucket.buffer(), key, server, wire_dtype)


def send_tensor(ctx: HookContext, tensor: torch.Tensor, key: int, server_index: int,
                wire_dtype: torch.dtype | None = None) -> Future:
    """Sends ``tensor`` as the server's bucket ``key`` and returns what the server answers, on
    the tensor's device and in its dtype."""
    server = ctx.servers[server_index]
    # CUDA sparse tensors cannot cross RPC, and device maps exist only CUDA-RPC <-> CUDA servers.
    on_device = ctx.cuda_rpc and server.cuda_rpc and not tensor.is_sparse
    # a sparse gradient's repeated rows summed where it was made: on a GPU the copy to the host
    # carries each row once (an embedding's gradient holds a row per lookup)
    payload = tensor.coalesce() if tensor.is_sparse else tensor
    payload = payload if on_device else payload.cpu()
    if wire_dtype is not None:
        payload = payload.to(wire_dtype)
    peer = server.rref.owner().id  # the server's rank in the job
    ctx.wire.add(sent=tensor_bytes(payload), peer=peer)
    reply = None if server_index in ctx.lost_servers else rpc.rpc_async(
        server.rref.owner(),
        ParameterServer.average_gradient,
        args=(server.rref, key, payload, ctx.iteration, ctx.trainer),
        timeout=ctx.rpc_timeout,
    )
    if ctx.replicas:  # a server gone: its replica answers
        reply = failover(ctx, reply, payload, key, server_index)

    def received(fut: Future) -> torch.Tensor:
        average = fut.value()
        ctx.wire.add(recv=tensor_bytes(average), peer=peer)
        return average.to(device=tensor.device, dtype=tensor.dtype)

    return reply.then(received)


@HOOKS.register("ps", aliases=("rpc_hook",),
                record=Strategy(RPC, "float32", lossless=True, sparse_buckets=SPARSE_SERVERS,
                                family=SERVERS, elastic=True,
                                replicated=True))
class PartitionedServers(Partitioned):
    """Every bucket to the parameter servers over RPC, cut into pieces dealt over all of them,
    which answer with the average; lossless."""

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        tensor = bucket.buffer()
        if tensor.is_sparse:  # its rows differ between trainers: sent whole
            return send_to_server(ctx, bucket, self.wire_dtype)
        return self.push(ctx, tensor, self.reserve(ctx.pieces(bucket, self.piece)), send_tensor)


@HOOKS.register("ps_fp16", record=Strategy(RPC, "float16", lossless=False,
                                           sparse_buckets=SPARSE_SERVERS, uncompressed="ps",
                                           family=SERVERS, elastic=True,
                                replicated=True))
class HalfPrecisionServers(PartitionedServers):
    """The ps strategy with float16 on the wire (servers add in float32); lossy."""

    wire_dtype = torch.float16


@HOOKS.register("ps_bf16", record=Strategy(RPC, "bfloat16", lossless=False,
                                           sparse_buckets=SPARSE_SERVERS, uncompressed="ps",
                                           family=SERVERS, elastic=True,
                                replicated=True))
class BrainFloatServers(PartitionedServers):
    """The ps strategy with bfloat16 on the wire (servers add in float32); lossy."""

    wire_dtype = torch.bfloat16


@HOOKS.register("sparse_ps", aliases=("sparse_rpc_hook",),
                record=Strategy(RPC, "float32", lossless=True, sparse_buckets=SPARSE_SERVERS,
                                family=SERVERS, for_sparse="allreduce"))
class SparseServers:
    """Sparse gradients to the parameter servers, dense ones all-reduced among trainers;
    lossless."""

    def __init__(self, ctx: HookContext) -> None:
        self.ctx = ctx

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        if bucket.buffer().is_sparse:
            return send_to_server(ctx, bucket)
        return allreduce(ctx, bucket)

    def floor_steps(self, buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """``--limits``: each dense bucket's all-reduce (the sparse ones' round trips are the
        floor of its own messages, ``messages.floor_messages``); the same sizes on every trainer,
        where a sparse bucket's rows differ."""
        return [("all_reduce", self.ctx.process_group, nbytes // 4)
                for _, (nbytes, sparse, _) in sorted(self.ctx.buckets.items()) if not sparse]


@HOOKS.register("ps_node", aliases=("ps_host", "byteps"),
                record=Strategy(RPC, "float32", lossless=True, sparse_buckets=None, family=SERVERS,
                                per_host=True, cost=Cost(like="ps")))
class NodeAggregated(Partitioned):
    """Parameter servers as deployed on nodes of several GPUs (BytePS's layout; TensorFlow's and
    MXNet's device-then-server kvstores): each bucket summed within the host (--per-host G),
    each of the host's trainers pushing its 1/G slice of the sum to the servers and pulling the
    average, then the slices all-gathered within the host; lossless.

    A host's link carries its gradient once each way, not G copies: 1/G of ``ps``'s bytes between
    hosts. Each slice is pushed as ``ps`` pushes a bucket: in pieces dealt over every server
    (``partition_mb``, ``window``, ``priority``, as ``ps`` takes them), and a bucket's pieces are
    on their way while the next bucket is summed, as BytePS keeps many partitions in flight. The
    sum goes a piece at a time: the columns of one piece of every trainer's slice summed on
    their own, so that the piece leaves once its own sum is done, as each BytePS partition
    passes through the node's reduce and then its push (on 2 emulated hosts of 2 trainers with
    4 co-located servers, 515 ms a batch against 535 with each bucket summed whole, 3 paired
    rounds). gloo has no reduce-scatter, so the sum within the host is an all-reduce (NCCL's
    reduce-scatter would move half). Every trainer issues the host's collectives on the host's
    group in the same order: the sums as DDP hands the buckets over, then, once the last is
    issued, the all-gathers in bucket order, each once its bucket's pieces are back (a second
    group for the gathers, issued as soon as each could be, was slower on the development
    machine: 549 against 467 ms a batch on 2 emulated hosts of 2 trainers). Dense models only: a
    sparse bucket's rows differ between the trainers of a host."""

    def __init__(self, ctx: HookContext, partition_mb: float | None = None, window: int = 0,
                 priority: bool = False) -> None:
        super().__init__(ctx, partition_mb, window, priority)
        size, per_host = ctx.process_group.size(), ctx.per_host
        hosts = [list(range(host * per_host, (host + 1) * per_host))
                 for host in range(size // per_host)]
        self.intra, _ = dist.new_subgroups_by_enumeration(hosts)
        self.local, self.per_host = dist.get_rank() % per_host, per_host
        self.lock = threading.Lock()
        self.handed = 0  # buckets handed over this iteration
        # place in the iteration -> (its all-gather, whether it is the iteration's last bucket)
        self.to_gather: dict[int, tuple[Callable[[], None], bool]] = {}
        self.gathered = 0  # all-gathers issued this iteration
        self.summed_all = False  # every sum of this iteration issued: the all-gathers may follow

    def floor_steps(self, buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """``--limits``: each bucket's sums within the host, a piece's columns each, and its
        all-gather (its slices' pushes and pulls are the floor of its own messages,
        ``messages.floor_messages(slices=G)``)."""
        return [step for elements in buckets for step in (
            *(("all_reduce", self.intra, self.per_host * length)
              for _, length in piece_ranges(slice_size(elements, self.per_host), self.piece)),
            ("all_gather", self.intra, elements))]

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        # every bucket, in order: it closes the layout
        first_place, pieces = self.reserve(ctx.pieces(bucket, self.piece, self.local,
                                                      self.per_host))
        place, self.handed = self.handed, 0 if bucket.is_last() else self.handed + 1
        tensor = bucket.buffer()
        numel, done = tensor.numel(), device_future(tensor.device)
        padded, rows = host_rows(tensor, self.per_host, self.scratch, bucket.index())

        def failed(error: Exception) -> None:
            if not done.done():
                done.set_exception(error)

        def gather(issuing: Callable) -> None:
            # issued from whichever thread's turn it is: on the stream that wrote this row
            with issuing():
                row = self.scratch.copy(("row", bucket.index()), rows[self.local])
                work = gather_into(padded, row, self.intra).get_future()
            work.add_done_callback(lambda finished: settled(
                finished, lambda: done.set_result(padded[:numel].view_as(tensor))))

        def pulled(answer: Future) -> None:
            def ready() -> None:
                answer.wait()  # the pieces' answers, in this trainer's row
                issuing = issuing_stream(tensor.device)
                self.gather_in_order(place, functools.partial(gather, issuing), bucket.is_last())
            settled(answer, ready)

        def settled(finished: Future, then: Callable[[], None]) -> None:
            try:
                finished.wait()
                then()
            except Exception as error:  # noqa: BLE001 - the trainer waits on ``done``
                failed(error)

        # each piece's columns of the host's rows summed on their own, in the order the pieces
        # go, so that a piece leaves once its own sum is done (BytePS's partitions each pass
        # through the node's reduce and their push as a pipeline)
        answers: dict[int, Future] = {}
        for order, (key, first, length, server) in enumerate(pieces):
            chunk = (rows if len(pieces) == 1
                     else self.scratch.copy(("columns", key), rows[:, first:first + length]))
            answers[first] = answer = device_future(tensor.device)
            summed = dist.all_reduce(chunk, group=self.intra, async_op=True).get_future()
            summed.add_done_callback(functools.partial(
                self.piece_summed, ctx, chunk, key, server, first_place + order, answer,
                settled))
        assembled([answers[first] for first in sorted(answers)],
                  rows[self.local]).add_done_callback(pulled)
        if bucket.is_last():
            self.gather_in_order(None, None, False)
        return done

    def piece_summed(self, ctx: HookContext, chunk: torch.Tensor, key: int, server: int,
                     place: int, answer: Future, settled: Callable, finished: Future) -> None:
        """A piece's columns are summed within the host: this trainer's row of them goes to the
        piece's server (a tensor of its own), and its answer to ``answer``."""
        def push() -> None:
            sent = self.submit(ctx, self.scratch.copy(key, chunk[self.local]), key, server, place,
                               send_tensor)
            sent.add_done_callback(functools.partial(settle, answer))
        settled(finished, push)

    def gather_in_order(self, place: int | None, gather: Callable[[], None] | None,
                        last: bool) -> None:
        """Issues the all-gathers of the buckets whose pieces are back, in the order DDP handed
        the buckets over, once every sum of the iteration has been issued, from whichever thread
        completes the next one in that order (``place`` None: the iteration's last sum has just
        been issued). Sums and gathers share the host's group, in the same order on every
        trainer: the iteration's sums, then its gathers."""
        with self.lock:
            if place is None:
                self.summed_all = True
            else:
                self.to_gather[place] = (gather, last)
            while self.summed_all and self.gathered in self.to_gather:
                issue, closes = self.to_gather.pop(self.gathered)
                self.gathered = 0 if closes else self.gathered + 1
                self.summed_all = not closes
                issue()


@HOOKS.register("ps_compressed", record=Strategy(
    RPC, "compressed", lossless=False, sparse_buckets=SPARSE_SERVERS, uncompressed="ps",
    family=SERVERS, compressor=named_codec, elastic=True))
class ServersCompressed(Compressed):
    """The compressors through the parameter servers: each dense bucket compressed by the
    ``compressor`` (topk, randomk, signsgd, qsgd or int8, with their options) and sent whole to
    its server, which decodes and adds every trainer's and answers with the average, compressed
    by the same compressor (``answer`` "compressed", the default: the signs of the sum back, as
    signSGD with majority vote, Bernstein et al. 2018) or dense (``answer`` "dense"); sparse
    buckets go as ``ps`` sends them; lossy."""

    floor_steps = None  # no collective of its own: --limits floors its buckets' round trips

    def __init__(self, ctx: HookContext, compressor: str = "topk", ratio: float = 0.01,
                 levels: int = 127, per_tensor: bool = False,
                 error_feedback: bool | None = None, answer: str = "compressed") -> None:
        self.codec = named_codec({"compressor": compressor, "ratio": ratio, "levels": levels,
                                  "per_tensor": per_tensor, "answer": answer})
        super().__init__(ctx, self.codec.error_feedback if error_feedback is None
                         else error_feedback)
        self.compressed_answer = not self.codec.dense_answer

    @staticmethod
    def check(compressor: str, ratio: float, levels: int, per_tensor: bool,
              error_feedback: bool | None, answer: str) -> None:
        if compressor not in CODECS:
            raise ValueError(f"hook option 'compressor' must be one of "
                             f"{', '.join(CODECS)}; got {compressor!r}")
        check_ratio(ratio)
        QSGDHook.check(levels, False)
        if answer not in ("compressed", "dense"):
            raise ValueError(f"hook option 'answer' must be compressed or dense; got {answer!r}")

    def exchange(self, ctx: HookContext, bucket: dist.GradBucket, message: torch.Tensor,
                 layout: tuple[int, int, list[int]]) -> Future:
        """The message to the bucket's server; its answer decoded where it is compressed."""
        (key, _, _, server_index), = ctx.pieces(bucket)
        server = ctx.servers[server_index]
        peer = server.rref.owner().id
        ctx.wire.add(sent=tensor_bytes(message), peer=peer)
        reply = rpc.rpc_async(server.rref.owner(), ParameterServer.average_compressed,
                              args=(server.rref, key, message.cpu(), self.codec, layout,
                                    self.compressed_answer, ctx.iteration, ctx.trainer),
                              timeout=ctx.rpc_timeout)
        tensor, (n, seed, sizes) = bucket.buffer(), layout

        def received(fut: Future) -> torch.Tensor:
            average = fut.value()
            ctx.wire.add(recv=tensor_bytes(average), peer=peer)
            if self.compressed_answer:
                average = self.codec.decode(average, n, seed, sizes)
            return average.to(device=tensor.device, dtype=tensor.dtype).view_as(tensor)

        return reply.then(received)

    def sparse(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        return send_to_server(ctx, bucket)
