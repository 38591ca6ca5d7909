"""What collectives and parameter servers move and cost: every formula ps_bench counts bytes,
holds floors and predicts with, each with its reference, once.

Bytes are what one rank sends (and receives) in one collective; times are milliseconds on a
``Link`` (a latency ``α`` per message step and a bandwidth ``B``, the same each way, full
duplex). The byte counter (``metrics.wire``), the floors (``metrics.limits``), ``report`` and
``predict`` read these; nothing else writes them again.

The ring (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009; Thakur, Rabenseifner and Gropp, "Optimization of collective
communication operations in MPICH", IJHPCA 2005): an all-reduce among n ranks is a
reduce-scatter then an all-gather, each ``n - 1`` steps moving ``M/n`` per rank, so every rank
sends and receives ``2(n-1)/n · M`` in ``2(n-1)`` steps; a reduce-scatter or an all-gather alone
is half of that. nccl-tests calls ``2(n-1)/n`` the all-reduce's bus-bandwidth factor.
"""

from __future__ import annotations

from dataclasses import dataclass

GLOO = "gloo"


# -- the ring's factors -------------------------------------------------------------------------
def ring_share(n: int) -> float:
    """The part of the buffer each rank sends (and receives) in a ring all-reduce: ``2(n-1)/n``."""
    return 2 * (n - 1) / n if n > 1 else 0.0


def ring_steps(n: int) -> int:
    """Message steps of a ring all-reduce, each paying the link's latency: ``2(n-1)``."""
    return 2 * (n - 1) if n > 1 else 0


def busbw_gbps(algbw: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce among ``world`` ranks: ``algbw · 2(n-1)/n``,
    comparable across rank counts and with the hardware's link bandwidth."""
    return algbw * ring_share(world)


# -- bytes per rank -----------------------------------------------------------------------------
def allreduce_bytes(nbytes: int, world: int, sparse: bool = False) -> int:
    """Bytes one rank sends (and receives) in an all-reduce of ``nbytes``: dense, a ring,
    ``2(n-1)/n`` of the buffer; sparse (gloo), every rank's indices and values go to every other
    rank, ``(n-1)`` times the payload."""
    if world <= 1:
        return 0
    return (world - 1) * nbytes if sparse else 2 * (world - 1) * nbytes // world


def allgather_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in an all-gather of ``nbytes`` from each rank
    (the list form): its own to each of the ``n-1`` others."""
    return (world - 1) * nbytes if world > 1 else 0


def collective_bytes(collective: str, nbytes: int, world: int, backend: str = GLOO) -> int:
    """Bytes one rank sends (and receives, on average over the ranks) in one collective over a
    whole buffer of ``nbytes`` (a reduce-scatter's input, an all-gather's output).

    A ring all-reduce moves ``2(n-1)/n`` of it; a ring reduce-scatter or all-gather ``(n-1)/n``;
    a broadcast ``(n-1)/n`` on average (the source sends it to each of the others). gloo has no
    reduce-scatter of its own: it runs an all-reduce of the whole input and keeps a chunk, so
    on gloo a reduce-scatter moves what an all-reduce does."""
    if collective == "all_reduce" or (collective == "reduce_scatter" and backend == GLOO):
        return allreduce_bytes(nbytes, world)
    return (world - 1) * nbytes // world if world > 1 else 0


# -- time on a link -----------------------------------------------------------------------------
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
    """Ring all-reduce of ``nbytes`` among ``n`` ranks: ``2(n-1)α + 2(n-1)/n · M/B`` (the ring,
    above). ``steps_per_message`` counts collectives launched one after another per bucket
    (PowerSGD: 3), each paying the latency term."""
    return steps_per_message * ring_steps(n) * link.latency_ms + ring_share(n) * link.time(nbytes)


def reduce_scatter_ms(n: int, nbytes: float, link: Link) -> float:
    """Ring reduce-scatter of ``nbytes`` (or all-gather into ``nbytes``) among ``n`` ranks: half a
    ring all-reduce, ``(n-1)α + (n-1)/n · M/B``."""
    return ring_allreduce_ms(n, nbytes, link) / 2


def allgather_ms(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather of ``nbytes`` from each of ``n`` ranks (a sparse all-reduce: every rank
    receives every other rank's indices and values): ``(n-1)α + (n-1) · M/B``."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency_ms + (n - 1) * link.time(nbytes)


def ps_bound_ms(trainers: int, servers: int, nbytes: float, link: Link) -> float:
    """Lower bound of one synchronous parameter-server iteration, every machine behind one link:
    a trainer sends and receives M, each of k servers receives and sends n·M/k; the busiest side
    sets the pace, ``max(M, n·M/k) / B`` each way (Li et al., "Scaling Distributed Machine
    Learning with the Parameter Server", OSDI 2014)."""
    return max(nbytes, trainers * nbytes / servers) / link.bytes_per_ms


def byteps_bound_ms(n: int, k: int, nbytes: float, link: Link) -> float:
    """BytePS's optimal communication time for n workers and k CPU servers, every machine one
    link of bandwidth B: ``2n(n-1)M / ((n² + kn - 2k) · B)`` (Jiang et al., "A Unified
    Architecture for Accelerating Distributed DNN Training in Heterogeneous GPU/CPU Clusters",
    OSDI 2020, section 3.1); k = 0 gives all-reduce's ``2(n-1)M/(nB)``, k = n gives ``M/B``."""
    denominator = n * n + k * n - 2 * k
    if n <= 1 or denominator <= 0:
        return 0.0
    return 2 * n * (n - 1) * link.time(nbytes) / denominator


# -- nodes of several trainers ------------------------------------------------------------------
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
    network link carries one ring edge each way, ``2(n-1)/n · M``, at the ring's slowest edge;
    of its ``2(n-1)`` steps, ``2(N-1)`` cross a node's network link and pay its latency, the
    other ``2N(G-1)`` the local link's: ``2(N-1)α + 2N(G-1)α_l + 2(n-1)/n · M / min(B, B_l)``
    (NCCL's ring, Jeaugey, "NCCL 2.0", GTC 2017; its latency as NCCL's own tuning model counts
    a ring's, ``src/graph/tuning.cc``: intra-node steps at the intra-node latency, the
    ``2(nNodes-1)`` inter-node steps at the network's). G = 1 is ``ring_allreduce_ms`` over N;
    N = 1 is a ring over the local link alone."""
    if nodes.count == 1:
        return (ring_allreduce_ms(nodes.per_node, nbytes, nodes.within(), steps_per_message)
                if nodes.per_node > 1 else 0.0)
    if nodes.per_node == 1:
        return ring_allreduce_ms(nodes.count, nbytes, nodes.network, steps_per_message)
    local = nodes.within()
    crossing = ring_steps(nodes.count)
    latency = crossing * nodes.network.latency_ms + (
        ring_steps(nodes.trainers) - crossing) * local.latency_ms
    slowest = Link(0.0, min(nodes.network.bytes_per_ms, local.bytes_per_ms))
    return steps_per_message * latency + ring_allreduce_ms(nodes.trainers, nbytes, slowest)


def within_node_ms(nodes: Nodes, nbytes: float, collectives: int) -> float:
    """``collectives`` ring reduce-scatters or all-gathers of ``nbytes`` among a node's G trainers
    on the local link (``reduce_scatter_ms``)."""
    if nodes.per_node <= 1:
        return 0.0
    return collectives * reduce_scatter_ms(nodes.per_node, nbytes, nodes.within())


def hierarchical_ms(nodes: Nodes, nbytes: float, gloo: bool = False) -> float:
    """Hierarchical all-reduce: reduce-scatter within the node, each of the G chunks all-reduced
    across the N nodes by its trainer (the G rings share the node's link, which carries
    ``2(N-1)/N · M`` each way in all), all-gather within the node:
    ``2[(G-1)α_l + (G-1)/G · M/B_l] + 2(N-1)α + 2(N-1)/N · M/B`` (Horovod's hierarchical
    all-reduce, Sergeev and Del Balso 2018; NCCL's rings across nodes). G = 1 is a ring over the
    N nodes, N = 1 a ring over the local link. ``gloo`` all-reduces where NCCL reduce-scatters:
    its first step moves twice the bytes, inside the node (three steps' worth in all)."""
    return (within_node_ms(nodes, nbytes, 3 if gloo else 2) +
            ring_allreduce_ms(nodes.count, nbytes, nodes.network))


def hsdp_reduce_ms(nodes: Nodes, nbytes: float, gloo: bool = False) -> float:
    """HSDP's gradient step for ``nbytes`` of gradients: reduce-scatter within the node, then
    each shard all-reduced across nodes (the node's link carries ``2(N-1)/N · M`` in all):
    ``(G-1)α_l + (G-1)/G · M/B_l + 2(N-1)α + 2(N-1)/N · M/B`` (Zhao et al., "PyTorch FSDP",
    VLDB 2023, hybrid sharding). Its parameters' all-gathers within the node, before forward and
    again before backward, are ``hsdp_gather_ms``. On ``gloo`` the reduce-scatter is an all-reduce
    (twice the bytes inside the node)."""
    return (within_node_ms(nodes, nbytes, 2 if gloo else 1) +
            ring_allreduce_ms(nodes.count, nbytes, nodes.network))


def sharded_reduce_ms(nodes: Nodes, nbytes: float, gloo: bool = False) -> float:
    """A sharded strategy's gradient step for ``nbytes`` of gradients, as FSDP2 issues it when
    backward finishes each unit and DeepSpeed's ZeRO-3 when backward fills a bucket: a
    reduce-scatter over every trainer, ring-ordered node by node (``collective_ms``) (their
    parameters' all-gathers are their records' ``sends``)."""
    return collective_ms("reduce_scatter", nodes, nbytes, gloo)


def collective_ms(collective: str, nodes: Nodes, nbytes: float, gloo: bool = False) -> float:
    """One collective over all N·G trainers on a whole buffer of ``nbytes`` (a reduce-scatter's
    input, an all-gather's output), ring-ordered node by node (``flat_ring_ms``): an all-reduce
    the whole ring, a reduce-scatter, all-gather or (pipelined) broadcast half of it; on gloo a
    reduce-scatter is an all-reduce (``collective_bytes``)."""
    whole = flat_ring_ms(nodes, nbytes)
    return (whole if collective == "all_reduce" or (collective == "reduce_scatter" and gloo)
            else whole / 2)


def hsdp_gather_ms(nodes: Nodes, nbytes: float) -> float:
    """HSDP's two all-gathers of the parameters within the node per micro-batch (before forward,
    and again before backward, having freed them), taken as not hidden behind compute (FSDP's
    prefetch hides part of them: an upper bound)."""
    return within_node_ms(nodes, nbytes, 2)
