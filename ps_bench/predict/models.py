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


def pipeline(buckets: list[tuple[float, Any]], transfer: Callable[[Any], float]) -> float:
    """When the last of ``buckets`` (``(ready_ms, bucket)``, in launch order) has been combined,
    each transfer (``transfer(bucket)`` ms) starting once its bucket is ready and the previous
    transfer on the link is done."""
    free = 0.0
    for ready, bucket in buckets:
        free = max(ready, free) + transfer(bucket)
    return free


def ps_pipeline(buckets: list[tuple[float, float]], n: int, k: int, link: Link, mapping: str = "shard",
                aggregate_bytes_per_ms: float | None = None) -> float:
    """A synchronous parameter server's iteration, bucket by bucket, every machine behind one link.

    Each trainer sends every bucket to the bucket's server (``shard``: buckets balanced over the
    k servers as ``balance_buckets`` does, each server hearing from all n trainers; ``group``:
    every bucket to the trainer's group server, which hears from n/k trainers). The server's
    link receives the n_j copies (``n_j · S / B``) after the first can start arriving; the
    server adds the last copy (``S / A`` at aggregation throughput A) and sends the average back
    to each of its n_j trainers (``n_j · S / B`` on its link, after its previous answers). The
    bound it approaches, with every bucket ready at once and large buckets, is
    ``max(M, n·M/k) / B`` each way (Li et al., "Scaling Distributed Machine Learning with the
    Parameter Server", OSDI 2014; the sharded layout is BytePS's, OSDI 2020)."""
    if not buckets:
        return 0.0
    if mapping == "group":
        owners = {index: 0 for index in range(len(buckets))}
        fan_in = -(-n // k)  # the largest group
        servers = 1  # groups are alike: one stands for all
    else:
        owners = balance_buckets({index: nbytes for index, (_, nbytes) in enumerate(buckets)}, k)
        fan_in, servers = n, k
    uplink = 0.0  # the trainer's link, outbound
    inbound, outbound = [0.0] * servers, [0.0] * servers  # each server's link, both ways
    done = 0.0
    for index, (ready, nbytes) in enumerate(buckets):
        server = owners[index]
        sent_from = max(ready, uplink)
        uplink = sent_from + link.time(nbytes)
        arrived = max(uplink, max(sent_from, inbound[server]) + fan_in * link.time(nbytes)) + link.latency_ms
        inbound[server] = arrived
        added = arrived + (nbytes / aggregate_bytes_per_ms if aggregate_bytes_per_ms else 0.0)
        outbound[server] = max(added, outbound[server]) + fan_in * link.time(nbytes)
        done = max(done, outbound[server] + link.latency_ms)
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
