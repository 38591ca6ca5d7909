"""The compressors' codecs: each turns a bucket's flat float32 gradient into one ``uint8``
message (values, indices, packed bits, scales, laid out by ``Codec.encode``) and back, with the
message's bytes as a formula (``Codec.message_bytes``); and error feedback, which keeps what
compression left out of a bucket for its next step. The hooks that send the messages are in
``compressors``."""

from __future__ import annotations

import inspect
import math

import torch

from ps_bench.strategies.scratch import storages_nbytes

BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)  # a byte's bits, first high
SCALE = 4  # bytes: a float32 scale or norm


def as_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def field(message: torch.Tensor, dtype: torch.dtype, start: int = 0,
          stop: int | None = None) -> torch.Tensor:
    """Bytes ``[start, stop)`` of a message as ``dtype``: a view where they lie at a multiple of
    its size in their storage, else a copy. A trainer's message in an all-gathered buffer starts
    at ``rank x message bytes``, which for ``signsgd`` (``ceil(n / 8) + 4``) or an odd bucket of
    ``qsgd`` and ``int8`` (``n + 4``) is no multiple of a float32 scale's 4 bytes, and torch views
    no bytes as a wider type there: the message is sent as it is, with no padding, and the
    few bytes of a misplaced field are copied out on the way in."""
    part = message[start:stop]
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype)


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
    # through parameter servers: the server answers with the float32 average, not a message
    dense_answer = False

    @classmethod
    def of(cls, options: dict) -> "Codec":
        """The codec a hook's options make (its own options; ``error_feedback`` is the hook's)."""
        return cls(**{name: options[name] for name in inspect.signature(cls).parameters})

    def message_bytes(self, n: int, tensors: int = 1) -> int:
        raise NotImplementedError

    def answer_bytes(self, n: int, tensors: int = 1) -> int:
        """What a parameter server answers a trainer with for a bucket of ``n`` values in
        ``tensors`` tensors: the average compressed alike, or, ``dense_answer``, in float32."""
        return 4 * n if self.dense_answer else self.message_bytes(n, tensors)

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
        values = field(message, torch.float32, 0, 4 * k)
        indices = field(message, torch.int32, 4 * k)
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
        values = field(message, torch.float32)
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
        scales = field(message, torch.float32, 0, SCALE * len(parts))
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
        norm = field(message, torch.float32, 0, SCALE)
        return field(message, self.dtype, SCALE).float() * (norm / self.levels)


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
        return message[SCALE:].view(torch.int8).float() * field(message, torch.float32, 0, SCALE)


class ErrorFeedback:
    """What compression left out of each bucket (its residual), added to the bucket's next
    gradient before that is compressed. Over any number of steps, what was sent (decoded) and
    the residual left add up to the gradients given: nothing is lost, only delayed."""

    def __init__(self) -> None:
        self.residuals: dict[int, torch.Tensor] = {}

    def encode(self, codec: Codec, index: int, flat: torch.Tensor, seed: int, rank: int,
               sizes: list[int]) -> torch.Tensor:
        """Bucket ``index``'s gradient ``flat`` with its residual added, compressed; the new
        residual kept (a bucket whose size changed starts afresh)."""
        residual = self.residuals.get(index)
        if residual is not None and residual.numel() == flat.numel():
            flat = flat + residual
        message = codec.encode(flat, seed, rank, sizes)
        self.residuals[index] = flat - codec.decode(message, flat.numel(), seed, sizes)
        return message

    def kept_bytes(self) -> int:
        """The residuals, a float32 copy of each dense bucket, kept on its device."""
        return storages_nbytes(self.residuals.values())


def averaged(codec: Codec, gathered: torch.Tensor, world: int, n: int, seed: int,
             sizes: list[int]) -> torch.Tensor:
    """The average of the ``world`` trainers' messages all-gathered into ``gathered`` (one row
    each, in rank order), each decoded where its row starts."""
    return sum(codec.decode(row, n, seed, sizes) for row in gathered.view(world, -1)) / world


CODECS = {"topk": TopK, "randomk": RandomK, "signsgd": Signs, "qsgd": QSGD, "int8": Int8}


def named_codec(options: dict) -> Codec:
    """``ps_compressed``'s codec: the compressor its ``compressor`` option names, with its
    options, answered as its ``answer`` option says."""
    codec = CODECS[options["compressor"]].of(options)
    codec.dense_answer = options.get("answer") == "dense"
    return codec
