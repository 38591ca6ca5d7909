"""When a strategy's last combined bucket is back: its buckets through the pipeline its record's
``cost`` names (collectives among the trainers, parameter servers, servers fed once per host,
low-rank factors), on a calibration's buckets and links."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ps_bench.metrics import costs
from ps_bench.metrics.messages import ELEMENT_BYTES, piece_elements
from ps_bench.predict import pipelines
from ps_bench.predict.calibration import Bucket, Calibration
from ps_bench.strategies import (COLLECTIVE_BUCKETS, HOOKS, HOST_SERVER_BUCKETS, LOW_RANK_BUCKETS,
                                 SERVER_BUCKETS, SPARSE_SERVER_BUCKETS, SPARSE_SERVERS, Strategy)


def communication_end(calibration: Calibration, strategy: Strategy, hook: str, n: int, k: int,
                      mapping: str, per_node: int = 1,
                      servers_on: str = "dedicated") -> float | None:
    """When the last bucket's combined gradient is back, ms after backward began (None: this
    strategy cannot be predicted from this calibration): its buckets through the pipeline its
    record's ``cost`` names, then what it pays each micro-batch besides (``cost.micro_batch_ms``,
    HSDP's gathers: every micro-batch's counted here, in the wire dtype).
    ``per_node`` trainers share a node (its local link, ``calibration.intra_link``, between
    them); at 1, every model is the flat one."""
    cost = strategy.cost
    if cost.pipeline is None or not calibration.reduces_with_backward(hook, cost):
        return 0.0
    nodes = costs.Nodes(n // per_node, per_node, calibration.link, calibration.intra_link)
    end = BUCKET_PIPELINES[cost.pipeline](calibration, strategy, hook, nodes, k, mapping,
                                          servers_on)
    if end is not None and cost.micro_batch_ms is not None:
        end += calibration.micro_batches * cost.micro_batch_ms(
            nodes, calibration.gradient_bytes * wire_factor(strategy))
    return end


def wire_factor(strategy: Strategy) -> float:
    """Bytes on the wire per float32 byte of gradient (1 for a compressor: ``wire_bytes``)."""
    return float32_share(strategy.payload)


def wire_bytes(calibration: Calibration, strategy: Strategy,
               hook: str) -> Callable[[Bucket], float]:
    """What a trainer puts on the wire for a dense bucket: a compressor's message at the options
    it is predicted at (``Codec.message_bytes`` of the bucket's elements and tensors), else the
    bucket in the strategy's wire dtype."""
    if strategy.compressor is None:
        factor = wire_factor(strategy)
        return lambda bucket: bucket.nbytes * factor
    codec = strategy.compressor(calibration.options_of(hook))
    return lambda bucket: codec.message_bytes(int(bucket.nbytes // 4), bucket.tensors)


def answer_bytes(calibration: Calibration, strategy: Strategy,
                 hook: str) -> Callable[[Bucket], float] | None:
    """What a parameter server answers a dense bucket with, where that is not what it was sent
    (``Codec.answer_bytes``: a compressor's dense answer); None: what it was sent."""
    if strategy.compressor is None:
        return None
    codec = strategy.compressor(calibration.options_of(hook))
    if not codec.dense_answer:
        return None
    return lambda bucket: codec.answer_bytes(int(bucket.nbytes // 4), bucket.tensors)


def float32_share(dtype: str) -> float:
    """A tensor's bytes in ``dtype`` over its float32 bytes (1 for a payload that is no dtype)."""
    return ELEMENT_BYTES[dtype] / ELEMENT_BYTES["float32"] if dtype in ELEMENT_BYTES else 1.0


def collectives_end(calibration: Calibration, strategy: Strategy, hook: str, nodes: costs.Nodes,
                    k: int, mapping: str, servers_on: str) -> float:
    """Each bucket combined by collectives among the trainers: a dense one as its record's
    ``cost.bucket_ms`` says at the options it is predicted at (default: a ring over every
    trainer), a sparse one all-gathered."""
    bucket_ms = (strategy.cost.bucket_ms
                 or (lambda nodes, nbytes, gloo: costs.flat_ring_ms(nodes, nbytes)))
    slowest = nodes.within() if nodes.count == 1 and nodes.per_node > 1 else calibration.link
    on_wire = wire_bytes(calibration, strategy, hook)

    def transfer(bucket: Bucket) -> float:
        if bucket.sparse:
            return costs.allgather_ms(nodes.trainers, bucket.nbytes, slowest)
        return bucket_ms(nodes, on_wire(bucket), calibration.gloo)
    buckets = calibration.buckets
    if hook in calibration.bucket_elements:  # the engine's own buckets, not DDP's
        buckets = engine_buckets(buckets, calibration.bucket_elements[hook])
    return pipelines.pipeline([(bucket.ready_ms, bucket) for bucket in buckets], transfer)


def engine_buckets(buckets: list[Bucket], elements: int) -> list[Bucket]:
    """``buckets`` (as backward makes them ready) gathered into an engine's buckets of at most
    ``elements`` as its backward fills them: one is reduced when the next gradient would take it
    past ``elements`` (DeepSpeed's ``reduce_bucket_size``), and the last when backward ends;
    ready when its last gradient is."""
    merged: list[Bucket] = []
    held = 0.0
    for bucket in (Bucket(*bucket) for bucket in buckets):
        if merged and held and (held + bucket.nbytes) / 4 > elements:
            held = 0.0
        if held:
            last = merged[-1]
            merged[-1] = Bucket(bucket.ready_ms, last.nbytes + bucket.nbytes,
                                last.sparse or bucket.sparse, last.tensors + bucket.tensors)
        else:
            merged.append(bucket)
        held += bucket.nbytes
    return merged


def low_rank_end(calibration: Calibration, strategy: Strategy, hook: str, nodes: costs.Nodes,
                 k: int, mapping: str, servers_on: str) -> float | None:
    """Low-rank factors all-reduced bucket by bucket (three collectives each): their size
    depends on the layers' shapes, so it is known from a run of the strategy, or from the model
    (``calibration.low_rank_ratios``)."""
    ratio = calibration.payload_ratio.get(hook)
    if ratio is None:
        return None
    return pipelines.pipeline([(bucket.ready_ms, bucket.nbytes * ratio)
                               for bucket in calibration.buckets],
                              lambda nbytes: costs.flat_ring_ms(nodes, nbytes, steps_per_message=3))


def server_bytes(calibration: Calibration, strategy: Strategy, hook: str) -> list[tuple]:
    """``(ready ms, bytes on the wire)`` of each bucket a trainer pushes to the servers
    (``wire_bytes``; a sparse one whole), and what the server answers with where that differs
    (``(ready ms, bytes, answered bytes)``: ``answer_bytes``)."""
    on_wire, answer = wire_bytes(calibration, strategy, hook), answer_bytes(calibration, strategy,
                                                                            hook)
    pushed = []
    for bucket in calibration.buckets:
        if bucket.sparse and strategy.sparse_buckets == SPARSE_SERVERS:
            pushed.append((bucket.ready_ms, bucket.nbytes))
        else:
            pushed.append((bucket.ready_ms, on_wire(bucket),
                           *([answer(bucket)] if answer is not None else [])))
    return pushed


def piece_bytes(strategy: Strategy, options: dict, servers: int) -> float | None:
    """The bytes on the wire of a piece the strategy cuts what it pushes into (``partition_mb``
    of its ``options``, of the float32 gradient) dealt over ``servers``; None: it sends buckets
    whole."""
    piece = piece_elements(options, servers)
    return None if piece is None else piece * ELEMENT_BYTES["float32"] * wire_factor(strategy)


def piece_window(options: dict) -> int:
    """Pieces a trainer keeps in flight (``window`` of its ``options``; 0: no bound)."""
    return int(options.get("window", 0))


def servers_end(calibration: Calibration, strategy: Strategy, hook: str, nodes: costs.Nodes,
                k: int, mapping: str, servers_on: str) -> float | None:
    """Every trainer pushes each bucket, in pieces, to the servers: ``k`` dedicated ones, or
    ``k`` spread over the nodes (colocated); a sparse bucket whole, as the run sends it."""
    if k < 1:
        return None
    options = calibration.options_of(hook)
    pieces = pipelines.server_pieces(server_bytes(calibration, strategy, hook), k,
                                     piece_bytes(strategy, options, k),
                                     sparse=[place for place, bucket
                                             in enumerate(calibration.buckets) if bucket.sparse])
    if servers_on == "colocated":
        return pipelines.colocated_ps_pipeline(pieces, nodes, calibration.aggregate_bytes_per_ms,
                                               piece_window(options))
    return pipelines.ps_pipeline(pieces, nodes.trainers, k, calibration.link, mapping,
                                 calibration.aggregate_bytes_per_ms, nodes.per_node)


def host_servers_end(calibration: Calibration, strategy: Strategy, hook: str, nodes: costs.Nodes,
                     k: int, mapping: str, servers_on: str) -> float | None:
    """Each bucket summed within the node, one push per node: each trainer a slice, in pieces."""
    if k < 1:
        return None
    options = calibration.options_of(hook)
    return pipelines.node_ps_pipeline(server_bytes(calibration, strategy, hook), nodes, k,
                                      calibration.aggregate_bytes_per_ms, servers_on == "colocated",
                                      calibration.gloo, piece_bytes(strategy, options, k),
                                      piece_window(options))


def sparse_servers_end(calibration: Calibration, strategy: Strategy, hook: str,
                       nodes: costs.Nodes, k: int, mapping: str, servers_on: str) -> float | None:
    """A strategy made for sparse buckets: those pushed to the servers, the dense ones combined
    as the strategy it is on a dense model (``for_sparse``); the two go at once, over the
    servers and among the trainers, and the later end is the strategy's (their sharing the
    trainer's link is not modelled). None where there are sparse buckets and no servers."""
    sparse = [bucket for bucket in calibration.buckets if bucket.sparse]
    dense = [bucket for bucket in calibration.buckets if not bucket.sparse]
    other = HOOKS.record(strategy.for_sparse)
    ends = [collectives_end(replace(calibration, buckets=dense), other, strategy.for_sparse,
                            nodes, k, mapping, servers_on) if dense else 0.0,
            servers_end(replace(calibration, buckets=sparse), strategy, hook, nodes, k, mapping,
                        servers_on) if sparse else 0.0]
    return None if None in ends else max(ends)


# the pipeline each Strategy.cost.pipeline names
BUCKET_PIPELINES = {COLLECTIVE_BUCKETS: collectives_end, LOW_RANK_BUCKETS: low_rank_end,
                    SERVER_BUCKETS: servers_end, HOST_SERVER_BUCKETS: host_servers_end,
                    SPARSE_SERVER_BUCKETS: sparse_servers_end}
