"""The all-reduce family: DDP's all-reduce, its hybrid for sparse gradients, compression around
it (fp16, bf16, PowerSGD), and no communication at all (the compute-only headroom)."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import (debugging_hooks, default_hooks,
                                                         powerSGD_hook)
from torch.futures import Future

from ps_bench.metrics import costs
from ps_bench.runtime.futures import device_future, issuing_stream, settle
from ps_bench.strategies.base import Hook, HookContext, stateless
from ps_bench.strategies.record import (COLLECTIVE, HOOKS, SPARSE_ALLREDUCE, SPARSE_GLOO, Cost,
                                        Strategy)
from ps_bench.strategies.scratch import Scratch, storages_nbytes


@stateless("allreduce", Strategy(COLLECTIVE, "float32", lossless=True,
                                 sparse_buckets=SPARSE_ALLREDUCE),
           aliases=("allreduce_hook",))
def allreduce(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """All-reduce average over the trainer process group (DDP's default); lossless."""
    return default_hooks.allreduce_hook(ctx.process_group, bucket)


@stateless("hybrid", Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=SPARSE_GLOO,
                              for_sparse="allreduce"),
           aliases=("hybrid_hook",))
def hybrid(ctx: HookContext, bucket: dist.GradBucket) -> Future:
    """All-reduce, sparse buckets through the CPU (gloo), dense on the trainer's device (nccl with
    --backend multi); lossless."""
    tensor = bucket.buffer()
    if not (tensor.is_sparse and tensor.is_cuda):
        return allreduce(ctx, bucket)
    host = tensor.coalesce().cpu()  # each row once across to the host, as gloo will send it
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


def gather_into(output: torch.Tensor, chunk: torch.Tensor, group) -> dist.Work:
    """All-gathers every rank's ``chunk`` into the flat ``output``, in rank order: the single-tensor
    collective (gloo gathers a list of outputs through extra copies, 5 times slower for a 29 MB
    bucket on the development machine); torch 2.14 names it ``all_gather_single``."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output, chunk, group=group, async_op=True)


def host_rows(tensor: torch.Tensor, per_host: int, scratch: Scratch,
              key: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of the flat ``tensor`` in ``scratch``'s tensor for ``key``, zero-padded to a
    multiple of ``per_host``, and the same storage as ``per_host`` rows: a host's trainers each
    own one row of the bucket."""
    numel = tensor.numel()
    padded = scratch.empty(("rows", key), numel + -numel % per_host, tensor)
    padded[:numel].copy_(tensor.reshape(-1))
    padded[numel:].zero_()
    return padded, padded.view(per_host, -1)


class InOrder:
    """A stateful hook whose buckets communicate one at a time (``after_previous``)."""

    previous: Future | None = None  # the last bucket's future

    def after_previous(self, bucket: dist.GradBucket, start: Callable[[], Future]) -> Future:
        """Starts ``bucket``'s communication once the previous bucket's has finished.

        torch's PowerSGD issues its second and third all-reduce of a bucket from callbacks of
        the first. Over gloo those callbacks run whenever each CPU collective completes, so with
        several buckets in flight two trainers could issue the next bucket's all-reduce and
        this bucket's in different orders, a collective mismatch (gloo aborts, or hangs). One
        bucket at a time keeps the order the same on every trainer; over NCCL a future
        completes as soon as its kernel is queued, so the chain costs no overlap there. On a
        GPU the bucket is started on the stream DDP handed it over on, not the callback's.
        """
        device = bucket.buffer().device
        previous, done = self.previous, device_future(device)
        self.previous, issuing = done, issuing_stream(device)

        def launch(_: Future | None = None) -> None:
            try:
                with issuing():
                    started = start()
                started.add_done_callback(lambda finished: settle(done, finished))
            except Exception as error:  # noqa: BLE001 - the trainer waits on this future
                done.set_exception(error)

        if previous is None:
            launch()
        else:
            previous.add_done_callback(launch)
        return done


class PowerSGD(InOrder):
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

    @staticmethod
    def check(matrix_approximation_rank: int, start_powerSGD_iter: int, use_error_feedback: bool,
              warm_start: bool, min_compression_rate: float) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(f"hook option 'matrix_approximation_rank' must be at least 1; "
                             f"got {matrix_approximation_rank}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("hook option 'start_powerSGD_iter' must be more than 1 with error "
                             "feedback or warm start (DDP rebuilds its buckets after the first "
                             "iteration)")
        if not min_compression_rate >= 0:
            raise ValueError(f"hook option 'min_compression_rate' must be 0 or more (0: factor "
                             f"every matrix); got {min_compression_rate}")

    def kept_bytes(self) -> int:
        """What torch's PowerSGD state keeps between iterations, on the buckets' device: error
        feedback's error of each bucket (its size) and warm start's P and Q factors."""
        state = self.state
        return storages_nbytes([*state.error_dict.values(), *state.p_memory_dict.values(),
                                *state.q_memory_dict.values()])

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        if bucket.buffer().is_sparse:  # as dense_only does for the stateless hooks
            return self.after_previous(bucket, lambda: allreduce(ctx, bucket))
        return self.after_previous(bucket, lambda: self.hook(self.state, bucket))



# Both PowerSGD hooks send all-reduces of low-rank factors (sparse buckets whole): per tensor, the
# tensors not worth compressing, then every P, then every Q; batched, the bucket's P, then its Q.
@HOOKS.register("powersgd", aliases=("powerSGD_hook",),
                record=Strategy(COLLECTIVE, "low-rank factors", lossless=False,
                                sparse_buckets=SPARSE_ALLREDUCE, uncompressed="allreduce",
                                factors="tensor"))
class PowerSGDHook(PowerSGD):
    """Low-rank compression around all-reduce (torch's powerSGD_hook, per tensor); lossy."""


def _orthogonalize_one_or_many(matrices: torch.Tensor, epsilon: float = 0) -> None:
    """torch 2.13's batched_powerSGD_hook hands ``_orthogonalize`` a single 2-D matrix, which it
    rejects (it expects a batch); a batch of one is the same computation, in place."""
    _orthogonalize_batch(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)


_orthogonalize_batch = powerSGD_hook._orthogonalize


@HOOKS.register("batched_powersgd", aliases=("batched_powerSGD_hook",),
                record=Strategy(COLLECTIVE, "low-rank factors", lossless=False,
                                sparse_buckets=SPARSE_ALLREDUCE, uncompressed="allreduce",
                                factors="bucket"))
class BatchedPowerSGDHook(PowerSGD):
    """Low-rank compression of each whole bucket as one square matrix (torch's
    batched_powerSGD_hook); lossy."""

    hook = staticmethod(powerSGD_hook.batched_powerSGD_hook)


if getattr(powerSGD_hook._orthogonalize, "__name__", "") == "_orthogonalize":
    # Widens torch's check (3-D batches behave exactly as before) so the batched hook runs.
    powerSGD_hook._orthogonalize = _orthogonalize_one_or_many



@HOOKS.register("hierarchical", aliases=("hierarchical_allreduce", "2d_allreduce"),
                record=Strategy(COLLECTIVE, "float32", lossless=True,
                                sparse_buckets=SPARSE_ALLREDUCE, per_host=True,
                                cost=Cost(bucket_ms=costs.hierarchical_ms)))
class Hierarchical(InOrder):
    """Two-level all-reduce over hosts of --per-host G trainers (host k is trainers [kG, (k+1)G)):
    each bucket all-reduced within the host, then chunk j of it all-reduced across hosts by each
    host's j-th trainer, then the chunks all-gathered within the host; lossless.

    Each host's link carries 2(H-1)/H of a bucket each way for H hosts, split over its G
    trainers, where a flat ring over every trainer carries 2(HG-1)/(HG) of it on every edge that
    leaves a host (as NCCL's rings and trees within and across nodes, and Horovod's hierarchical
    all-reduce, do). gloo runs a reduce-scatter as a whole all-reduce, so the first step is one;
    sparse buckets are all-reduced flat. Buckets go one at a time (as PowerSGD's do), each step
    issued when the previous one completes."""

    def __init__(self, ctx: HookContext) -> None:
        size, per_host = ctx.process_group.size(), ctx.per_host
        hosts = size // per_host
        self.intra, _ = dist.new_subgroups_by_enumeration(
            [list(range(host * per_host, (host + 1) * per_host)) for host in range(hosts)])
        self.inter, _ = dist.new_subgroups_by_enumeration(
            [[host * per_host + local for host in range(hosts)] for local in range(per_host)])
        self.local, self.per_host, self.size = dist.get_rank() % per_host, per_host, size
        self.scratch = Scratch(lambda: ctx.iteration)

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        if bucket.buffer().is_sparse:
            return self.after_previous(bucket, lambda: allreduce(ctx, bucket))
        return self.after_previous(bucket, lambda: self.two_level(bucket.buffer(), bucket.index()))

    def floor_steps(self, buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """``--limits``: each bucket's three steps on the groups it runs them on."""
        return [step for elements in buckets for step in (
            ("all_reduce", self.intra, elements),
            ("all_reduce", self.inter, -(-elements // self.per_host)),
            ("all_gather", self.intra, elements))]

    def two_level(self, tensor: torch.Tensor, index: int) -> Future:
        numel, done = tensor.numel(), device_future(tensor.device)
        padded, rows = host_rows(tensor, self.per_host, self.scratch, index)

        def step(run: Callable[[], Future], then: Callable[[], None]) -> None:
            def next_step(finished: Future) -> None:
                try:
                    finished.wait()
                    then()
                except Exception as error:  # noqa: BLE001 - the trainer waits on ``done``
                    done.set_exception(error)
            run().add_done_callback(next_step)

        def gathered() -> None:
            done.set_result(padded[:numel].div_(self.size).view_as(tensor))

        def across() -> None:
            step(lambda: gather_into(padded, self.scratch.copy(("row", index), rows[self.local]),
                                     self.intra).get_future(), gathered)

        def within() -> None:
            step(lambda: dist.all_reduce(rows[self.local], group=self.inter,
                                         async_op=True).get_future(), across)

        step(lambda: dist.all_reduce(padded, group=self.intra, async_op=True).get_future(), within)
        return done


@HOOKS.register("noop", aliases=("noop_hook",),
                record=Strategy(None, "nothing", lossless=False, sparse_buckets=None))
def noop(ctx: HookContext) -> Hook:
    """No communication, the compute-only headroom: replicas drift apart by design."""
    return debugging_hooks.noop_hook  # torch's own, called directly: it ignores the state
