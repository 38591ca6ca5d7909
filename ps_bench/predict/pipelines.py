"""What one iteration costs at n trainers and k servers: the bucket pipelines that decide how much
of each transfer hides behind backward, on the formulas of ``ps_bench.metrics.costs``.

Everything here is arithmetic on milliseconds and bytes. A link (``costs.Link``) is a latency
``α`` (ms) and a bandwidth ``B`` (bytes per ms), the same each way and full duplex; every
trainer and every server has one. Buckets are ``(ready_ms, bytes)``: when backward hands the bucket
to the strategy (ms after backward began) and what the strategy puts on the wire for it.

Overlap is computed, not assumed (``pipeline``): a bucket's transfer starts when it is ready
and after the previous transfer on the same link has finished, as DDP launches buckets in
order and gloo and NCCL run one process group's collectives in order; backward ends when both
its own compute and the last transfer have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ps_bench.metrics.costs import Link, Nodes, within_node_ms
from ps_bench.runtime.topology import balance_buckets, slice_owners


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
    spread over N servers approach ``2G(N-1)/N · M/B``, a ring's bytes per trainer (BytePS's
    gain over all-reduce comes from the servers it adds, ``costs.byteps_bound_ms``). N = 1: the
    local link alone, ``2·G·S/B_l + 2α_l``."""
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
            arrived = (max(arrived, max(end for _, end in pushed), inbound[owner]) +
                       network.latency_ms)
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


def ps_pipeline(buckets: list[tuple[float, float]], n: int, k: int, link: Link,
                mapping: str = "shard", aggregate_bytes_per_ms: float | None = None,
                per_node: int = 1) -> float:
    """A synchronous parameter server's iteration, bucket by bucket, every machine behind one link.

    Each trainer sends every bucket to the bucket's server (``shard``: buckets balanced over the
    k servers as ``balance_buckets`` does, each server hearing from all n trainers; ``group``:
    every bucket to the trainer's group server, which hears from n/k trainers). The server's
    link receives the n_j copies (``n_j · S / B``) after the first can start arriving; the
    server adds the last copy (``S / A`` at aggregation throughput A) and sends the average back
    to each of its n_j trainers (``n_j · S / B`` on its link, after its previous answers). The
    bound it approaches, with every bucket ready at once and large buckets, is
    ``costs.ps_bound_ms``, ``max(M, n·M/k) / B`` each way. With ``per_node``
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
        arrived = (max(uplink, max(sent_from, inbound[server]) + fan_in * link.time(nbytes)) +
                   link.latency_ms)
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


def node_ps_pipeline(buckets: list[tuple[float, float]], nodes: Nodes, k: int,
                     aggregate_bytes_per_ms: float | None = None,
                     colocated: bool = False, gloo: bool = False) -> float:
    """Parameter servers fed once per node (``ps_node``; BytePS's layout), bucket after bucket
    as ps_bench runs it (each bucket once the previous one is done). A bucket of S bytes: summed
    within the node (a ring all-reduce of S on the local link, or NCCL's reduce-scatter, half of
    it), each of the G trainers pushing its S/G slice to the slice's server (slices balanced over
    the k servers as ``topology.slice_owners`` deals them in the run), so the node's link sends S
    and server j receives N·c_j·S/G for its c_j slices; the server adds the last copy (``S/A`` at
    aggregation throughput A) and answers the same bytes back; then the slices all-gathered within
    the node. ``colocated``: server j is on node j (k = N): a node's link sends the slices its
    servers do not own, ``(N-1)/N · S``, while it receives the other nodes' slices for its own
    server, ``(N-1)·c_j·S/G``, and the answers go the other way. Each phase takes its busiest link.
    A node's link carries its gradient once each way where ``ps`` carries G copies: the bound is
    ``costs.byteps_bound_ms`` over the N nodes. N = 1: the local steps and the servers' link."""
    g, n, network = nodes.per_node, nodes.count, nodes.network
    owners = slice_owners({index: nbytes for index, (_, nbytes) in enumerate(buckets)}, g, k)
    done = 0.0
    for index, (ready, nbytes) in enumerate(buckets):
        # the sum within the node
        local = (within_node_ms(nodes, nbytes, 2 if gloo else 1) if g > 1 else 0.0)
        slices = [owners[index * g + part] for part in range(g)]
        served = (max(slices.count(server) for server in range(k)) * nbytes / g *
                  (n - 1 if colocated else n))
        # what a node's link sends, and receives back
        pushed = nbytes * (n - 1) / n if colocated else nbytes
        link = max(pushed, served)
        transfer = 2 * (network.time(link) + network.latency_ms) if n > 1 or not colocated else 0.0
        added = nbytes / g / aggregate_bytes_per_ms if aggregate_bytes_per_ms else 0.0
        gathered = within_node_ms(nodes, nbytes, 1) if g > 1 else 0.0
        done = max(ready, done) + local + transfer + added + gathered
    return done
