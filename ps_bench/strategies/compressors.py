"""Gradient compression as researchers compare it: sparsification (``topk``, ``randomk``),
1-bit signs (``signsgd``) and quantisation (``qsgd``, ``int8``), each with error feedback as an
option, exchanged by all-gather among the trainers.

A compressed gradient does not add up inside a ring: each trainer all-gathers every trainer's
message (one ``uint8`` buffer: values, indices, packed bits, scales, as ``Codec.encode`` lays
them out), decodes each and averages them, so what a trainer receives grows with the trainers,
``(n-1) x`` its message (GRACE, Xu et al., "GRACE: A Compressed Communication Framework for
Distributed Machine Learning", ICDCS 2021; Agarwal et al., "On the Utility of Gradient
Compression in Distributed Training Systems", MLSys 2022). A message's bytes are
``Codec.message_bytes``, the formula the tests hold the run's byte counts to.

Error feedback (Seide et al. 2014; Stich et al., "Sparsified SGD with Memory", 2018;
Karimireddy et al., "Error Feedback Fixes SignSGD", 2019) keeps, per bucket, what compression
left out and adds it to the next iteration's gradient: on by default for top-k, random-k and
signs, off for the unbiased or near-lossless quantisers (QSGD, int8)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.futures import Future

from ps_bench.metrics import costs
from ps_bench.strategies.allreduce import allreduce, gather_into
from ps_bench.strategies.base import HookContext
from ps_bench.strategies.codecs import (QSGD, Codec, ErrorFeedback, Int8, RandomK, Signs, Sparse,
                                        TopK, averaged, check_ratio)
from ps_bench.strategies.record import COLLECTIVE, HOOKS, SPARSE_ALLREDUCE, Cost, Nodes, Strategy

class Compressed:
    """A DDP hook that all-gathers each dense bucket compressed by its ``Codec`` and averages
    what every trainer sent; sparse buckets are all-reduced as they are. With error feedback,
    what compression left out of a bucket is added to its next gradient."""

    codec: Codec

    def __init__(self, ctx: HookContext, error_feedback: bool) -> None:
        self.feedback = ErrorFeedback() if error_feedback else None
        self.ctx, self.group = ctx, ctx.process_group

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        tensor = bucket.buffer()
        if tensor.is_sparse:
            return self.sparse(ctx, bucket)
        flat, index, codec = tensor.detach().reshape(-1).float(), bucket.index(), self.codec
        n, sizes = flat.numel(), [g.numel() for g in bucket.gradients()]
        seed, rank = ctx.iteration * 4099 + index, dist.get_rank(ctx.process_group)
        message = (self.feedback.encode(codec, index, flat, seed, rank, sizes) if self.feedback
                   else codec.encode(flat, seed, rank, sizes))
        return self.exchange(ctx, bucket, message, (n, seed, sizes))

    def kept_bytes(self) -> int:
        """Error feedback's residuals (none without it)."""
        return self.feedback.kept_bytes() if self.feedback else 0

    def sparse(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        """A sparse bucket, as it is."""
        return allreduce(ctx, bucket)

    def exchange(self, ctx: HookContext, bucket: dist.GradBucket, message: torch.Tensor,
                 layout: tuple[int, int, list[int]]) -> Future:
        """Every trainer's message all-gathered, each decoded, their average."""
        (n, seed, sizes), codec, tensor = layout, self.codec, bucket.buffer()
        world = ctx.process_group.size()
        gathered = message.new_empty(world * message.numel())
        work = gather_into(gathered, message, ctx.process_group)

        def average(_: Future) -> torch.Tensor:
            return averaged(codec, gathered, world, n, seed, sizes).to(tensor.dtype).view_as(tensor)

        return work.get_future().then(average)

    def floor_steps(self, buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """``--limits``: each dense bucket's all-gather of its message, as the bucket's tensors
        make it (a ``per_tensor`` scale each), and each sparse bucket's all-gather of its rows,
        in float32 elements of the whole gathered buffer (the buckets: the last iteration's,
        ``HookContext.buckets``)."""
        world = self.group.size()
        return [("all_gather", self.group,
                 -(-(nbytes if sparse else self.codec.message_bytes(nbytes // 4, len(shapes)))
                   // 4) * world)
                for _, (nbytes, sparse, shapes) in sorted(self.ctx.buckets.items())]


def gathered_ms(nodes: Nodes, nbytes: float, gloo: bool) -> float:
    """predict's cost of a bucket whose message is ``nbytes`` (its codec's ``message_bytes`` at
    the options predict costs the hook at): the all-gather of the message, from each trainer to
    every other, over the nodes' slowest link."""
    link = nodes.within() if nodes.count == 1 else nodes.network
    return costs.allgather_ms(nodes.count * nodes.per_node, nbytes, link)


def register(name: str, codec_of):
    """Registers a compressor's hook; its record's ``compressor`` makes its codec from the hook's
    options (the bytes of its messages), its cost the all-gather of each message."""
    def decorate(cls):
        record = Strategy(COLLECTIVE, "compressed", lossless=False,
                          sparse_buckets=SPARSE_ALLREDUCE, uncompressed="allreduce",
                          cost=Cost(bucket_ms=gathered_ms), compressor=codec_of)
        return HOOKS.register(name, record=record)(cls)
    return decorate


class Sparsified(Compressed):
    """A sparsifier's hook (``sparsifier``: its codec): the ``ratio`` of each bucket's values kept,
    error feedback on by default."""

    sparsifier: type[Sparse]

    def __init__(self, ctx: HookContext, ratio: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__(ctx, error_feedback)
        self.codec = self.sparsifier(ratio)

    @staticmethod
    def check(ratio: float, error_feedback: bool) -> None:
        check_ratio(ratio)


@register("topk", TopK.of)
class TopKHook(Sparsified):
    """Top-k sparsification: the ``ratio`` of each bucket's values largest in magnitude, with
    their indices, all-gathered; error feedback on by default; lossy."""

    sparsifier = TopK


@register("randomk", RandomK.of)
class RandomKHook(Sparsified):
    """Random-k sparsification: the ``ratio`` of each bucket's values at places every trainer
    draws alike, the values alone all-gathered; error feedback on by default; lossy."""

    sparsifier = RandomK


@register("signsgd", Signs.of)
class SignHook(Compressed):
    """signSGD with error feedback (EF-SignSGD): one bit a value and the mean magnitude of the
    bucket (``per_tensor``: of each tensor), all-gathered; lossy."""

    def __init__(self, ctx: HookContext, per_tensor: bool = False,
                 error_feedback: bool = True) -> None:
        super().__init__(ctx, error_feedback)
        self.codec = Signs(per_tensor)


@register("qsgd", QSGD.of)
class QSGDHook(Compressed):
    """QSGD: each value stochastically rounded to one of ``levels`` levels of the bucket's
    norm, a byte each, all-gathered; unbiased, error feedback off by default; lossy."""

    def __init__(self, ctx: HookContext, levels: int = 127, error_feedback: bool = False) -> None:
        super().__init__(ctx, error_feedback)
        self.codec = QSGD(levels)

    @staticmethod
    def check(levels: int, error_feedback: bool) -> None:
        if not 1 <= levels <= 32767:
            raise ValueError(f"hook option 'levels' must be 1 to 32767; got {levels}")


@register("int8", Int8.of)
class Int8Hook(Compressed):
    """int8: each value rounded to 255 levels of the bucket's largest magnitude, a byte each
    and a float32 scale, all-gathered; error feedback off by default; lossy."""

    def __init__(self, ctx: HookContext, error_feedback: bool = False) -> None:
        super().__init__(ctx, error_feedback)
        self.codec = Int8()
