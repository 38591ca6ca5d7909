"""What one iteration costs at n trainers and k servers: one small function per transport, and
the bucket pipeline that decides how much of it hides behind backward.

Everything here is arithmetic on milliseconds and bytes. A link is a latency ``α`` (ms) and a
bandwidth ``B`` (bytes per ms), the same each way and full duplex; every trainer and every
server has one. Buckets are ``(ready_ms, bytes)``: when backward hands the bucket to the
strategy (ms after backward began) and what the strategy puts on the wire for it.

Overlap is computed, not assumed (``pipeline``): a bucket's transfer starts when it is ready
and after the previous transfer on the same link has finished, as DDP launches buckets in
order and gloo and NCCL run one process group's collectives in order; backward ends when both
its own compute and the last transfer have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ps_bench.topology import balance_buckets


@dataclass(frozen=True)
class Link:
    latency_ms: float  # α: one message's fixed cost, per step
    bytes_per_ms: float  # B

    @classmethod
    def of(cls, latency_us: float, gbit_s: float) -> "Link":
        return cls(latency_us / 1000.0, gbit_s * 1e9 / 8 / 1000.0)

    def time(self, nbytes: float) -> float:
        """Serialisation time of ``nbytes`` on this link, ms (no latency)."""
        return nbytes / self.bytes_per_ms


def ring_allreduce_ms(n: int, nbytes: float, link: Link, steps_per_message: int = 1) -> float:
    """Ring all-reduce of ``nbytes`` among ``n`` ranks: ``2(n-1)α + 2(n-1)/n · M/B``.

    Reduce-scatter then all-gather, each ``n - 1`` steps moving ``M/n`` per rank (Patarasuk and
    Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009;
    Thakur, Rabenseifner and Gropp, IJHPCA 2005). ``steps_per_message`` counts collectives
    launched one after another per bucket (PowerSGD: 3), each paying the latency term."""
    if n <= 1:
        return 0.0
    return steps_per_message * 2 * (n - 1) * link.latency_ms + 2 * (n - 1) / n * link.time(nbytes)


def allgather_ms(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather of ``nbytes`` from each of ``n`` ranks (a sparse all-reduce: every rank
    receives every other rank's indices and values): ``(n-1)α + (n-1) · M/B`` (Thakur et al. 2005)."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency_ms + (n - 1) * link.time(nbytes)


def byteps_bound_ms(n: int, k: int, nbytes: float, link: Link) -> float:
    """BytePS's optimal communication time for n workers and k CPU servers, every machine one
    link of bandwidth B: ``2n(n-1)M / ((n² + kn - 2k) · B)`` (Jiang et al., "A Unified
    Architecture for Accelerating Distributed DNN Training in Heterogeneous GPU/CPU Clusters",
    OSDI 2020, section 3.1); k = 0 gives all-reduce's ``2(n-1)M/(nB)``, k = n gives ``M/B``."""
    denominator = n * n + k * n - 2 * k
    if n <= 1 or denominator <= 0:
        return 0.0
    return 2 * n * (n - 1) * link.time(nbytes) / denominator


@dataclass(frozen=True)
class Nodes:
    """``count`` nodes of ``per_node`` trainers each: a node's trainers reach each other over its
    ``local`` link (NVLink, PCIe; a host's loopback in an emulated network), nodes reach each
    other only through each node's one ``network`` link."""

    count: int  # N
    per_node: int  # G
    network: Link
    local: Link | None = None  # needed where G > 1

    @property
    def trainers(self) -> int:
        return self.count * self.per_node

    def within(self) -> Link:
        if self.local is None:
            raise ValueError("a node of several trainers needs its local link")
        return self.local


def flat_ring_ms(nodes: Nodes, nbytes: float, steps_per_message: int = 1) -> float:
    """A ring all-reduce over all n = N·G trainers, ordered node by node (NCCL's ring): each node's
    network link carries one ring edge each way, ``2(n-1)/n · M``, and the ring moves at its
    slowest edge, so ``2(n-1)α + 2(n-1)/n · M / min(B_network, B_local)`` with α the network's
    (Patarasuk and Yuan 2009; NCCL's ring, Jeaugey, "NCCL 2.0", GTC 2017). G = 1 is
    ``ring_allreduce_ms`` over N; N = 1 is a ring over the local link alone."""
    if nodes.count == 1:
        return ring_allreduce_ms(nodes.per_node, nbytes, nodes.within(), steps_per_message) if nodes.per_node > 1 else 0.0
    if nodes.per_node == 1:
        return ring_allreduce_ms(nodes.count, nbytes, nodes.network, steps_per_message)
    n, slowest = nodes.trainers, min(nodes.network.bytes_per_ms, nodes.within().bytes_per_ms)
    return steps_per_message * 2 * (n - 1) * nodes.network.latency_ms + 2 * (n - 1) / n * nbytes / slowest


def within_node_ms(nodes: Nodes, nbytes: float, collectives: int) -> float:
    """``collectives`` ring reduce-scatters or all-gathers of ``nbytes`` among a node's G trainers:
    each ``(G-1)α + (G-1)/G · M/B`` on the local link (Thakur et al. 2005)."""
    g = nodes.per_node
    if g <= 1:
        return 0.0
    local = nodes.within()
    return collectives * ((g - 1) * local.latency_ms + (g - 1) / g * local.time(nbytes))


def hierarchical_ms(nodes: Nodes, nbytes: float, gloo: bool = False) -> float:
    """Hierarchical all-reduce: reduce-scatter within the node, each of the G chunks all-reduced
    across the N nodes by its trainer (the G rings share the node's link, which carries
    ``2(N-1)/N · M`` each way in all), all-gather within the node:
    ``2[(G-1)α_l + (G-1)/G · M/B_l] + 2(N-1)α + 2(N-1)/N · M/B`` (Horovod's hierarchical
    all-reduce, Sergeev and Del Balso 2018; NCCL's rings across nodes). G = 1 is a ring over the
    N nodes, N = 1 a ring over the local link. ``gloo`` all-reduces where NCCL reduce-scatters:
    its first step moves twice the bytes, inside the node (three steps' worth in all)."""
    return within_node_ms(nodes, nbytes, 3 if gloo else 2) + ring_allreduce_ms(nodes.count, nbytes, nodes.network)


def hsdp_reduce_ms(nodes: Nodes, nbytes: float, gloo: bool = False) -> float:
    """HSDP's gradient step for ``nbytes`` of gradients: reduce-scatter within the node, then
    each shard all-reduced across nodes (the node's link carries ``2(N-1)/N · M`` in all):
    ``(G-1)α_l + (G-1)/G · M/B_l + 2(N-1)α + 2(N-1)/N · M/B`` (Zhao et al., "PyTorch FSDP",
    VLDB 2023, hybrid sharding). Its parameters' all-gathers within the node, before forward and
    again before backward, are ``hsdp_gather_ms``. On ``gloo`` the reduce-scatter is an all-reduce
    (twice the bytes inside the node)."""
    return within_node_ms(nodes, nbytes, 2 if gloo else 1) + ring_allreduce_ms(nodes.count, nbytes, nodes.network)


def hsdp_gather_ms(nodes: Nodes, nbytes: float) -> float:
    """HSDP's two all-gathers of the parameters within the node per iteration (before forward,
    and again before backward, having freed them), taken as not hidden behind compute (FSDP's
    prefetch hides part of them: an upper bound)."""
    return within_node_ms(nodes, nbytes, 2)


def colocated_ps_pipeline(buckets: list[tuple[float, float]], nodes: Nodes,
                          aggregate_bytes_per_ms: float | None = None) -> float:
    """Parameter servers co-located one on each of the N nodes (BytePS's layout without extra
    CPU machines), bucket by bucket, each bucket owned whole by one server (balanced by bytes, as
    ``balance_buckets`` does; BytePS splits tensors finer, as a smaller bucket cap would). For a
    bucket of S bytes owned by node j: every other node's link sends its G trainers' copies,
    ``G·S/B`` (after its previous pushes), node j's link receives the ``(N-1)·G·S`` of them while
    its own G copies cross its local link (``G·S/B_l``); the server adds the last copy
    (``S/A``) and sends the average back over its node's link, ``(N-1)·G·S/B`` out (after that
    link's previous pushes and answers), and over the local link. One bucket, N = 2:
    ``2·G·S/B + 2α``, each node's gradient (its G trainers' copies) once each way; many buckets
    spread over N servers approach ``2G(N-1)/N · M/B``, a ring's bytes per trainer (Jiang et
    al., OSDI 2020: BytePS's gain over all-reduce comes from servers it adds,
    ``byteps_bound_ms``). N = 1: the local link alone, ``2·G·S/B_l + 2α_l``."""
    n, g, network = nodes.count, nodes.per_node, nodes.network
    local = nodes.local
    owners = balance_buckets({index: nbytes for index, (_, nbytes) in enumerate(buckets)}, n)
    uplink, inbound = [0.0] * n, [0.0] * n  # each node's network link, out and in
    done = 0.0
    for index, (ready, nbytes) in enumerate(buckets):
        owner = owners[index]
        arrived = ready
        if local is not None:  # the owner's own trainers, over the local link
            arrived = ready + g * local.time(nbytes) + local.latency_ms
        if n > 1:
            pushed = []
            for node in range(n):
                if node != owner:
                    start = max(ready, uplink[node])
                    uplink[node] = start + g * network.time(nbytes)
                    pushed.append((start, uplink[node]))
            first = min(start for start, _ in pushed)
            inbound[owner] = max(first, inbound[owner]) + (n - 1) * g * network.time(nbytes)
            arrived = max(arrived, max(end for _, end in pushed), inbound[owner]) + network.latency_ms
        added = arrived + (nbytes / aggregate_bytes_per_ms if aggregate_bytes_per_ms else 0.0)
        answered = added
        if local is not None:
            answered = added + g * local.time(nbytes) + local.latency_ms
        if n > 1:
            uplink[owner] = max(added, uplink[owner]) + (n - 1) * g * network.time(nbytes)
            answered = max(answered, uplink[owner] + network.latency_ms)
        done = max(done, answered)
    return done


def pipeline(buckets: list[tuple[float, Any]], transfer: Callable[[Any], float]) -> float:
    """When the last of ``buckets`` (``(ready_ms, bucket)``, in launch order) has been combined,
    each transfer (``transfer(bucket)`` ms) starting once its bucket is ready and the previous
    transfer on the link is done."""
    free = 0.0
    for ready, bucket in buckets:
        free = max(ready, free) + transfer(bucket)
    return free


def ps_pipeline(buckets: list[tuple[float, float]], n: int, k: int, link: Link, mapping: str = "shard",
                aggregate_bytes_per_ms: float | None = None, per_node: int = 1) -> float:
    """A synchronous parameter server's iteration, bucket by bucket, every machine behind one link.

    Each trainer sends every bucket to the bucket's server (``shard``: buckets balanced over the
    k servers as ``balance_buckets`` does, each server hearing from all n trainers; ``group``:
    every bucket to the trainer's group server, which hears from n/k trainers). The server's
    link receives the n_j copies (``n_j · S / B``) after the first can start arriving; the
    server adds the last copy (``S / A`` at aggregation throughput A) and sends the average back
    to each of its n_j trainers (``n_j · S / B`` on its link, after its previous answers). The
    bound it approaches, with every bucket ready at once and large buckets, is
    ``max(M, n·M/k) / B`` each way (Li et al., "Scaling Distributed Machine Learning with the
    Parameter Server", OSDI 2014; the sharded layout is BytePS's, OSDI 2020). With ``per_node``
    G trainers sharing a node's link (servers on hosts of their own), the node sends and
    receives G copies: ``max(G·M, n·M/k) / B`` each way."""
    if not buckets:
        return 0.0
    if mapping == "group":
        owners = {index: 0 for index in range(len(buckets))}
        fan_in = -(-n // k)  # the largest group
        servers = 1  # groups are alike: one stands for all
    else:
        owners = balance_buckets({index: nbytes for index, (_, nbytes) in enumerate(buckets)}, k)
        fan_in, servers = n, k
    uplink = downlink = 0.0  # the trainer's (node's) link, outbound and inbound
    inbound, outbound = [0.0] * servers, [0.0] * servers  # each server's link, both ways
    done = 0.0
    for index, (ready, nbytes) in enumerate(buckets):
        server = owners[index]
        sent_from = max(ready, uplink)
        uplink = sent_from + per_node * link.time(nbytes)
        arrived = max(uplink, max(sent_from, inbound[server]) + fan_in * link.time(nbytes)) + link.latency_ms
        inbound[server] = arrived
        added = arrived + (nbytes / aggregate_bytes_per_ms if aggregate_bytes_per_ms else 0.0)
        outbound[server] = max(added, outbound[server]) + fan_in * link.time(nbytes)
        done = max(done, outbound[server] + link.latency_ms)
        if per_node > 1:  # the node's link, inbound: its G trainers' answers, one after another
            downlink = max(added, downlink) + per_node * link.time(nbytes)
            done = max(done, downlink + link.latency_ms)
    return done


@dataclass(frozen=True)
class Phases:
    """One iteration's compute, ms: forward, backward's own compute, optimizer step."""

    forward: float
    backward: float
    optimizer: float


def iteration_ms(phases: Phases, communication_end: float, own_ms: float = 0.0) -> float:
    """Forward, then backward until both its compute and the last bucket's transfer are done
    (measured from the start of backward), then the optimizer step, plus the strategy's own
    compute not already inside the transfers (casts, matrix products)."""
    return phases.forward + max(phases.backward, communication_end) + phases.optimizer + own_ms
