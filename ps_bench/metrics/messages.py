"""What a strategy puts on the wire for each of DDP's buckets, as ``(elements, dtype)``
messages (``floor_messages``): its buckets whole in float32 or 16 bits, PowerSGD's factors, a
parameter-server strategy's slices and pieces, a compressor's messages byte for byte; the floors
(``limits``), the byte counts and ``predict`` read them. A message a parameter server answers
with other bytes than it was sent (a compressor's dense answer) is ``(elements, dtype, answered
float32 elements)``."""

from __future__ import annotations

import math

import torch

from ps_bench.runtime.topology import piece_ranges, slice_size


# uint8: a compressor's message, as it is sent
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "uint8": torch.uint8}


ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1}
# --precision and --reduce-dtype, as DTYPES names them
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def low_rank_factors(shapes: list[list[int]], rank: int,
                     min_compression_rate: float) -> tuple[int, int, int]:
    """Elements torch's per-tensor PowerSGD all-reduces for one bucket: the tensors not worth
    compressing (1-D ones, and matrices where ``(n + m) · r · rate >= n · m``, as its
    ``_should_compress`` decides), every P (``n × r``) and every Q (``m × r``), with each gradient
    viewed as ``shape[0] × rest`` and ``r = min(rank, n, m)``."""
    uncompressed = p_elements = q_elements = 0
    for shape in shapes:
        elements = 1
        for size in shape:
            elements *= size
        if len(shape) <= 1:
            uncompressed += elements
            continue
        rows, cols = shape[0], elements // shape[0] if shape[0] else 0
        r = min(rank, rows, cols)
        if (rows + cols) * r * min_compression_rate < rows * cols:
            p_elements, q_elements = p_elements + rows * r, q_elements + cols * r
        else:
            uncompressed += elements
    return uncompressed, p_elements, q_elements


def square_side(elements: int) -> int:
    """The side of the square matrix batched PowerSGD views a bucket of ``elements`` as (padded
    with zeros): ``ceil(sqrt(elements))``."""
    return math.isqrt(elements - 1) + 1 if elements > 0 else 0


def batched_low_rank_factors(elements: int, rank: int) -> tuple[int, int, int]:
    """Elements torch's batched PowerSGD all-reduces for one bucket of ``elements``: the bucket as
    one square matrix (``square_side``), P and Q of ``side × rank`` each, whatever that saves (it
    has no ``min_compression_rate``: a bucket of 10 sends 16)."""
    side = square_side(elements)
    return 0, side * rank, side * rank


def bucket_factors(factors: str, shapes: list[list[int]], elements: int,
                   options: dict) -> tuple[int, int, int]:
    """``(uncompressed, P, Q)`` elements a PowerSGD hook all-reduces for one bucket at the hook's
    ``options``: per tensor (``factors`` "tensor", from the gradients' ``shapes``) or the bucket's
    ``elements`` as one matrix ("bucket")."""
    rank = options["matrix_approximation_rank"]
    if factors == "tensor":
        return low_rank_factors(shapes, rank, options["min_compression_rate"])
    return batched_low_rank_factors(elements, rank)


def floor_messages(strategy, buckets: list[dict], options: dict, slices: int = 1,
                   on_device: bool = False,
                   servers: int = 1) -> dict[int, list[tuple[int, str]]]:
    """What ``strategy`` (a ``Strategy`` record) puts on the wire for each of ``buckets`` (rows of
    ``DdpTrainer.bucket_layout``: index, bytes, sparse, shapes), as ``(elements, dtype)``
    messages in the order it sends them; ``options`` are the hook's options, defaults included;
    ``slices``: each trainer sends its ``1/slices`` of each bucket (node-aggregated servers: a
    host's G trainers push a slice each of the host's sum); a partitioned parameter-server
    strategy (``partition_mb`` among its options) sends each slice in pieces, a message each
    (dealt over ``servers``; ``on_device``: over device maps, see ``piece_elements``). Sparse
    buckets go as they are (float32 at their size); a strategy made for them (``for_sparse``)
    sends its dense buckets as the strategy it is on a dense model, not through its transport:
    none here."""
    messages: dict[int, list[tuple[int, str]]] = {}
    piece = (piece_elements(options, servers, on_device) if strategy.transport == "rpc"
             else None)
    for bucket in buckets:
        elements = slice_size(bucket["bytes"] // 4, slices)
        dtype = strategy.payload if strategy.payload in ELEMENT_BYTES else "float32"
        if strategy.transport is None:
            messages[bucket["index"]] = []
        elif bucket["sparse"]:
            messages[bucket["index"]] = [(elements, "float32")]
        elif strategy.for_sparse and strategy.transport == "rpc":
            # made for sparse buckets: its dense ones go as for_sparse's, its floor_steps
            messages[bucket["index"]] = []
        elif strategy.payload == "compressed" and strategy.transport == "rpc":
            # through the servers: its message, answered alike or with the float32 average;
            # all-gathered, its floor is its hook's floor_steps
            codec, tensors = strategy.compressor(options), len(bucket["shapes"])
            sent = codec.message_bytes(elements, tensors)
            answered = codec.answer_bytes(elements, tensors)
            messages[bucket["index"]] = [(sent, "uint8") if answered == sent
                                         else (sent, "uint8", answered // 4)]
        elif strategy.payload in ELEMENT_BYTES or strategy.payload == "compressed":
            messages[bucket["index"]] = [(length, dtype)
                                         for _, length in piece_ranges(elements, piece)]
        else:  # low-rank factors
            parts = bucket_factors(strategy.factors, bucket["shapes"], elements, options)
            messages[bucket["index"]] = [(count, "float32") for count in parts if count]
    return messages


MIB = 1024 * 1024
# MiB of gradient in a piece when ``partition_mb`` is not given, tensors crossing RPC on the CPU
# (as DDP's bucket_cap_mb; BytePS's default is 4,096,000 bytes)
PARTITION_MB = 4.0


def piece_elements(options: dict, servers: int, on_device: bool = False) -> int | None:
    """Float32 elements in a piece of a partitioned parameter-server strategy, from its hook
    options (``partition_mb``, MiB); None: buckets go whole (a strategy without the option).

    Pieces are cut where they buy something: spread over several ``servers``, a bucket's load is
    shared out and its pieces cross while the others are summed. ``partition_mb`` not given
    (None) is ``PARTITION_MB`` where the pieces are dealt over several servers with the tensors
    crossing RPC on the CPU, and whole buckets otherwise, where every message only adds its
    fixed cost: to one server on the CPU, ``ps`` on the DummyModel took 53.9 ms of ``comm`` a
    batch in 4 MiB pieces against 45.2 ms whole (docs/floors.md); over device maps (CUDA
    trainers and servers, ``on_device``), on one H100, ResNet-18 over 2 CUDA servers took 92 ms
    a batch in 4 MiB pieces, 33 ms in 16 MiB pieces and 26 ms whole (docs/gpus.md)."""
    if "partition_mb" not in options:
        return None
    partition_mb = options["partition_mb"]
    if partition_mb is None:
        if on_device or servers < 2:
            return None
        partition_mb = PARTITION_MB
    return max(1, int(partition_mb * MIB) // 4)


def wire_dtype(payload: str) -> str:
    """The dtype a payload's collectives move: its own where it is one, else float32."""
    return payload if payload in ELEMENT_BYTES else "float32"


def message_bytes(messages: dict[int, list[tuple]]) -> int:
    """The bytes ``messages`` send."""
    return sum(count * ELEMENT_BYTES[dtype]
               for parts in messages.values() for count, dtype, *_ in parts)


def answered_bytes(messages: dict[int, list[tuple]]) -> int:
    """The bytes a parameter server answers ``messages`` with: each its own, or the float32
    elements it says."""
    return sum(answer[0] * ELEMENT_BYTES["float32"] if answer else count * ELEMENT_BYTES[dtype]
               for parts in messages.values() for count, dtype, *answer in parts)
