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

import functools
import inspect
import math

import torch
import torch.distributed as dist
from torch.futures import Future

from ps_bench.metrics import costs
from ps_bench.strategies.allreduce import allreduce, gather_into
from ps_bench.strategies.base import HookContext
from ps_bench.strategies.record import COLLECTIVE, HOOKS, SPARSE_ALLREDUCE, Cost, Nodes, Strategy
from ps_bench.strategies.scratch import storages_nbytes

BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)  # a byte's bits, first high
SCALE = 4  # bytes: a float32 scale or norm


def as_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def pack_signs(flat: torch.Tensor) -> torch.Tensor:
    """One bit a value, 1 where it is not negative, eight to a byte (the last byte padded)."""
    bits = (flat >= 0).to(torch.uint8)
    bits = torch.cat([bits, bits.new_zeros(-bits.numel() % 8)]).view(-1, 8)
    return (bits * BITS.to(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """+1 or -1 for each of ``n`` values."""
    bits = (packed.unsqueeze(1) & BITS.to(packed.device)).ne(0).view(-1)[:n]
    return bits.float() * 2 - 1


class Codec:
    """One compressor: a bucket's flat float32 gradient to a ``uint8`` message and back.
    ``seed`` is the same on every trainer for a bucket and iteration; ``rank`` is the
    trainer's; ``sizes`` are the bucket's tensors' element counts."""

    error_feedback = True  # the literature's default for it

    @classmethod
    def of(cls, options: dict) -> "Codec":
        """The codec a hook's options make (its own options; ``error_feedback`` is the hook's)."""
        return cls(**{name: options[name] for name in inspect.signature(cls).parameters})

    def message_bytes(self, n: int, tensors: int = 1) -> int:
        raise NotImplementedError

    def encode(self, flat: torch.Tensor, seed: int, rank: int, sizes: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, message: torch.Tensor, n: int, seed: int,
               sizes: list[int]) -> torch.Tensor:
        raise NotImplementedError


def check_ratio(ratio: float) -> None:
    if not (isinstance(ratio, float) and 0 < ratio <= 1):
        raise ValueError(f"hook option 'ratio' must be above 0 and at most 1; got {ratio}")


class Sparse(Codec):
    """A sparsifier: ``k = ceil(ratio x n)`` of a bucket's ``n`` values, at least one."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio

    def k(self, n: int) -> int:
        return max(1, min(n, math.ceil(self.ratio * n)))


class TopK(Sparse):
    """The ``ratio`` of the values largest in magnitude: float32 values and int32 indices,
    ``8k`` bytes."""

    def message_bytes(self, n: int, tensors: int = 1) -> int:
        return 8 * self.k(n)

    def encode(self, flat, seed, rank, sizes):
        indices = flat.abs().topk(self.k(flat.numel()), sorted=False).indices
        return as_bytes(flat[indices], indices.to(torch.int32))

    def decode(self, message, n, seed, sizes):
        k = self.k(n)
        values, indices = message[:4 * k].view(torch.float32), message[4 * k:].view(torch.int32)
        return torch.zeros(n, device=message.device).index_put_((indices.long(),), values)


class RandomK(Sparse):
    """The values at ``k`` places drawn from ``seed``, the same places on every trainer, so only
    the float32 values travel: ``4k`` bytes."""

    def places(self, n: int, seed: int, device: torch.device) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(n, generator=generator)[:self.k(n)].to(device)

    def message_bytes(self, n: int, tensors: int = 1) -> int:
        return 4 * self.k(n)

    def encode(self, flat, seed, rank, sizes):
        return as_bytes(flat[self.places(flat.numel(), seed, flat.device)])

    def decode(self, message, n, seed, sizes):
        places = self.places(n, seed, message.device)
        values = message.view(torch.float32)
        return torch.zeros(n, device=message.device).index_put_((places,), values)


class Signs(Codec):
    """One bit a value, its sign, times the mean magnitude (EF-SignSGD's scale) of the bucket,
    or of each tensor (``per_tensor``): ``ceil(n / 8)`` bytes and a float32 scale for each."""

    def __init__(self, per_tensor: bool) -> None:
        self.per_tensor = per_tensor

    def parts(self, n: int, sizes: list[int]) -> list[int]:
        return sizes if self.per_tensor else [n]

    def message_bytes(self, n: int, tensors: int = 1) -> int:
        return -(-n // 8) + SCALE * (tensors if self.per_tensor else 1)

    def encode(self, flat, seed, rank, sizes):
        parts = flat.split(self.parts(flat.numel(), sizes))
        scales = torch.stack([part.abs().mean() for part in parts])
        return as_bytes(scales.float(), pack_signs(flat))

    def decode(self, message, n, seed, sizes):
        parts = self.parts(n, sizes)
        scales = message[:SCALE * len(parts)].view(torch.float32)
        signs = unpack_signs(message[SCALE * len(parts):], n)
        return signs * scales.repeat_interleave(torch.tensor(parts, device=message.device))


class QSGD(Codec):
    """QSGD's stochastic quantisation (Alistarh et al., 2017): each value's magnitude over the
    bucket's norm, on ``levels`` levels, rounded up or down at random so that the expectation is
    the value; a signed level a byte (two above 127 levels) and the float32 norm."""

    error_feedback = False

    def __init__(self, levels: int) -> None:
        self.levels = levels
        self.dtype = torch.int8 if levels <= 127 else torch.int16

    def message_bytes(self, n: int, tensors: int = 1) -> int:
        return n * (1 if self.dtype == torch.int8 else 2) + SCALE

    def encode(self, flat, seed, rank, sizes):
        norm = flat.norm()
        scaled = flat.abs() / norm.clamp_min(torch.finfo(torch.float32).tiny) * self.levels
        generator = torch.Generator(device=flat.device).manual_seed(seed * 65_537 + rank)
        floor = scaled.floor()
        up = torch.rand(flat.shape, generator=generator, device=flat.device) < scaled - floor
        levels = (floor + up) * flat.sign()
        return as_bytes(norm.reshape(1).float(), levels.to(self.dtype))

    def decode(self, message, n, seed, sizes):
        norm = message[:SCALE].view(torch.float32)
        return message[SCALE:].view(self.dtype).float() * (norm / self.levels)


class Int8(Codec):
    """Each value rounded to one of 255 levels of the bucket's largest magnitude (a float32
    scale a bucket, as low-communication training across data centres sends it): ``n + 4``
    bytes."""

    error_feedback = False

    def message_bytes(self, n: int, tensors: int = 1) -> int:
        return n + SCALE

    def encode(self, flat, seed, rank, sizes):
        scale = flat.abs().max() / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return as_bytes(scale.reshape(1).float(), (flat / scale).round().to(torch.int8))

    def decode(self, message, n, seed, sizes):
        return message[SCALE:].view(torch.int8).float() * message[:SCALE].view(torch.float32)


class Compressed:
    """A DDP hook that all-gathers each dense bucket compressed by its ``Codec`` and averages
    what every trainer sent; sparse buckets are all-reduced as they are. With error feedback,
    what compression left out of a bucket is added to its next gradient."""

    codec: Codec

    def __init__(self, ctx: HookContext, error_feedback: bool) -> None:
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}
        self.group = ctx.process_group

    def __call__(self, ctx: HookContext, bucket: dist.GradBucket) -> Future:
        tensor = bucket.buffer()
        if tensor.is_sparse:
            return self.sparse(ctx, bucket)
        flat, index, codec = tensor.detach().reshape(-1).float(), bucket.index(), self.codec
        n, sizes = flat.numel(), [g.numel() for g in bucket.gradients()]
        seed, rank = ctx.iteration * 4099 + index, dist.get_rank(ctx.process_group)
        residual = self.residuals.get(index)
        if self.error_feedback and residual is not None and residual.numel() == n:
            flat = flat + residual
        message = codec.encode(flat, seed, rank, sizes)
        if self.error_feedback:
            self.residuals[index] = flat - codec.decode(message, n, seed, sizes)
        return self.exchange(ctx, bucket, message, (n, seed, sizes))

    def kept_bytes(self) -> int:
        """Error feedback's residuals, a float32 copy of each dense bucket, kept on its device."""
        return storages_nbytes(self.residuals.values())

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

        def averaged(_: Future) -> torch.Tensor:
            total = sum(codec.decode(chunk, n, seed, sizes)
                        for chunk in gathered.view(world, -1))
            return (total / world).to(tensor.dtype).view_as(tensor)

        return work.get_future().then(averaged)

    def floor_steps(self, buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """``--limits``: each bucket's all-gather of its message (float32 elements of the whole
        gathered buffer)."""
        world = self.group.size()
        return [("all_gather", self.group, -(-self.codec.message_bytes(n) // 4) * world)
                for n in buckets]


def gathered_ms(codec: Codec, nodes: Nodes, nbytes: float, gloo: bool) -> float:
    """predict's cost of a bucket (with the codec bound, ``gathered_at``): the all-gather of
    its message, from each trainer to every other, over the nodes' slowest link."""
    link = nodes.within() if nodes.count == 1 else nodes.network
    return costs.allgather_ms(nodes.count * nodes.per_node, codec.message_bytes(int(nbytes // 4)),
                              link)


def gathered_at(codec_of, options: dict):
    """``gathered_ms`` with the codec the hook's ``options`` make (``Cost.bucket_ms_at``; a
    function of the module, so that the record pickles into the ranks)."""
    return functools.partial(gathered_ms, codec_of(options))


def register(name: str, codec_of):
    """Registers a compressor's hook; its record's ``compressor`` makes its codec from the hook's
    options (the bytes of its messages), its cost the all-gather of its messages at the options
    predict costs the hook at (``bucket_ms_at``)."""
    def decorate(cls):
        record = Strategy(COLLECTIVE, "compressed", lossless=False,
                          sparse_buckets=SPARSE_ALLREDUCE, uncompressed="allreduce",
                          cost=Cost(bucket_ms_at=functools.partial(gathered_at, codec_of)),
                          compressor=codec_of)
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


CODECS = {"topk": TopK, "randomk": RandomK, "signsgd": Signs, "qsgd": QSGD, "int8": Int8}


def named_codec(options: dict) -> Codec:
    """``ps_compressed``'s codec: the compressor its ``compressor`` option names, with its
    options."""
    return CODECS[options["compressor"]].of(options)
