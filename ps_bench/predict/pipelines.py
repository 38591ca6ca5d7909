"""What one iteration costs at n trainers and k servers: the bucket pipelines that decide how much
of each transfer hides behind backward, on the formulas of ``ps_bench.metrics.costs``.

Everything here is arithmetic on milliseconds and bytes. A link (``costs.Link``) is a latency
``α`` (ms) and a bandwidth ``B`` (bytes per ms), the same each way and full duplex; every
trainer and every server has one. Buckets are ``(ready_ms, bytes)``: when backward hands the bucket
to the strategy (ms after backward began) and what the strategy puts on the wire for it; one a
parameter server answers with other bytes than it was sent (a compressor's dense answer) is
``(ready_ms, bytes, answered bytes)``, and so are its pieces' (``server_pieces``).

Overlap is computed, not assumed (``pipeline``): a bucket's transfer starts when it is ready
and after the previous transfer on the same link has finished, as DDP launches buckets in
order and gloo and NCCL run one process group's collectives in order; backward ends when both
its own compute and the last transfer have.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from ps_bench.metrics.costs import Link, Nodes, within_node_ms
from ps_bench.runtime.topology import PIECES, piece_owners, piece_ranges, slice_size


def server_pieces(buckets: list[tuple], num_servers: int, piece: float | None = None,
                  parts: int = 1, sparse: Iterable[int] = ()) -> list[tuple]:
    """``(ready ms, bytes, server)`` of each piece a sender pushes, in the order it pushes them:
    each bucket (``(ready ms, bytes)``) cut into ``parts`` slices, each into pieces of at most
    ``piece`` bytes (None: whole), dealt over ``num_servers`` as the run deals them
    (``topology.piece_owners``); the ``sparse`` buckets (their places in ``buckets``) whole, once,
    dealt after the others. A bucket answered with other bytes (``(ready ms, bytes, answered)``)
    gives its pieces their share of them: ``(ready ms, bytes, server, answered)``."""
    sparse = set(sparse)
    cut = None if piece is None else max(1, int(piece))
    sizes = {index: int(round(bucket[1])) for index, bucket in enumerate(buckets)}
    owners = piece_owners(sizes, parts, num_servers, cut, sparse)
    pieces = []
    for index, (ready, nbytes, *answer) in enumerate(buckets):
        share = [answer[0] / nbytes if nbytes else 0.0] if answer else []
        if index in sparse:
            pieces.append((ready, sizes[index], owners[index * parts * PIECES],
                           *[sizes[index] * ratio for ratio in share]))
            continue
        for part in range(parts):
            ranges = piece_ranges(slice_size(sizes[index], parts), cut)
            pieces += [(ready, length, owners[(index * parts + part) * PIECES + place],
                        *[length * ratio for ratio in share])
                       for place, (_, length) in enumerate(ranges)]
    return pieces


def answered(piece: tuple) -> float:
    """The bytes a piece (``server_pieces``') is answered with: its own, unless it says others."""
    return piece[3] if len(piece) > 3 else piece[1]


def colocated_ps_pipeline(pieces: list[tuple[float, float, int]], nodes: Nodes,
                          aggregate_bytes_per_ms: float | None = None, window: int = 0) -> float:
    """Parameter servers co-located on the N nodes (BytePS's layout without extra CPU machines),
    server s on node ``s mod N``, every trainer pushing each piece (``server_pieces``) to its
    server. A bucket's pieces are in flight together (the strategies' ``window`` has no bound by
    default) and share each link, so they arrive together, in as many waves as
    ``pushed_in_waves`` counts, and are answered together (``exchange``): for a bucket whose
    pieces node m's servers hold ``h_m`` bytes of S, node m's link carries its G trainers'
    pushes of the rest out, ``G·(S - h_m)``, while the other nodes' copies of its own come in,
    ``(N-1)·G·h_m``; the answers then take the same bytes the other way (their own, where they
    are of other bytes); the next bucket's
    pushes follow on each link. The G copies of ``h_m`` cross the node's local link each way.
    One piece, N = 2: ``2·G·S/B + 2α``; pieces spread evenly over N nodes: ``2G(N-1)/N · M/B``
    per bucket, a ring's bytes per trainer (BytePS's gain over all-reduce comes from the servers
    it adds, ``costs.byteps_bound_ms``). N = 1: the local link alone, ``2·G·S/B_l + 2α_l``."""
    n, g, network, local = nodes.count, nodes.per_node, nodes.network, nodes.local
    free: dict[str, float] = {}  # each link and direction, when it is done with what it was given
    done = 0.0

    def crossing(held: list[float]) -> dict[str, float]:
        """ms on each link and direction for pieces of ``held`` bytes on each node's servers."""
        total, times = sum(held), {}
        if n > 1:
            for m in range(n):
                times[f"node {m} out"] = network.time(g * (total - held[m]))
                times[f"node {m} in"] = network.time((n - 1) * g * held[m])
        if local is not None:
            for m in range(n):
                if held[m]:
                    times[f"local {m} out"] = g * local.time(held[m])
                    times[f"local {m} in"] = g * local.time(held[m])
        return times

    for ready, bucket in _by_bucket(pieces):
        held, back = [0.0] * n, [0.0] * n
        for nbytes, server, answer in bucket:
            held[server % n] += nbytes
            back[server % n] += answer
        push = crossing(held)
        link = network if n > 1 else local
        latency = link.latency_ms if link is not None else 0.0
        largest = max(nbytes for nbytes, _, _ in bucket)
        added = largest / aggregate_bytes_per_ms if aggregate_bytes_per_ms else 0.0
        waves = pushed_in_waves([[server for _, server, _ in bucket]], window)
        done = max(done, exchange(free, ready, push, latency, added, waves,
                                  None if back == held else crossing(back)))
    return done


def exchange(free: dict[str, float], start: float, push: dict[str, float], latency: float,
             added: float, waves: int = 1, answers: dict[str, float] | None = None) -> float:
    """When a bucket's answers are back: its pushes (``push``: ms on each link and direction,
    ``"... out"`` or ``"... in"``) start at ``start`` or once the link has carried what it was
    given before (``free``, updated) and arrive in ``waves`` (``pushed_in_waves``: pieces in
    flight together share a link and arrive together); a wave is added (``added`` ms) and
    answered, the answers taking the same time on each link the other way (``answers``: their
    own ms, by the push they answer, where they are of other bytes), after what that direction
    was given, while the later waves are still pushed. One wave: the pushes, then the answers;
    many: the answers of the last wave alone after the pushes. Returns when the last answer is
    in, a latency later."""
    first = last = start
    for link, ms in push.items():
        began = max(start, free.get(link, 0.0))
        free[link] = began + ms
        first, last = max(first, began + ms / waves), max(last, free[link])
    answered = last + latency + added
    turned = {"out": "in", "in": "out"}
    for link, ms in (answers or push).items():
        name, direction = link.rsplit(" ", 1)
        back = f"{name} {turned[direction]}"
        free[back] = max(max(first + latency + added, free.get(back, 0.0)) + ms,
                         last + latency + added + ms / waves)
        answered = max(answered, free[back])
    return answered + latency


def pushed_in_waves(senders: list[list[int]], window: int) -> int:
    """How many waves a bucket's pieces reach the servers in, each sender's pieces (``senders``:
    the server of each, in the order sent) with at most ``window`` in flight (0: no bound).
    With a window, a sender's pieces go ``window`` at a time; without one, all at once, but
    those to one server travel one after another on its connection (RPC keeps a connection's
    messages in order), so the most pieces to one server."""
    if window:
        return max(1, max(-(-len(servers) // window) for servers in senders))
    return max(1, max((servers.count(server) for servers in senders for server in set(servers)),
                      default=1))


def _by_bucket(pieces: list[tuple]) -> list[tuple[float, list[tuple[float, int, float]]]]:
    """``server_pieces``' pieces grouped by the bucket they came from (consecutive, one ready
    time): ``(ready ms, [(bytes, server, answered bytes), ...])``."""
    groups: list[tuple[float, list[tuple[float, int, float]]]] = []
    for piece in pieces:
        ready, nbytes, server = piece[:3]
        if not groups or groups[-1][0] != ready:
            groups.append((ready, []))
        groups[-1][1].append((nbytes, server, answered(piece)))
    return groups


def pipeline(buckets: list[tuple[float, Any]], transfer: Callable[[Any], float]) -> float:
    """When the last of ``buckets`` (``(ready_ms, bucket)``, in launch order) has been combined,
    each transfer (``transfer(bucket)`` ms) starting once its bucket is ready and the previous
    transfer on the link is done."""
    free = 0.0
    for ready, bucket in buckets:
        free = max(ready, free) + transfer(bucket)
    return free


def ps_pipeline(pieces: list[tuple[float, float, int]], n: int, k: int, link: Link,
                mapping: str = "shard", aggregate_bytes_per_ms: float | None = None,
                per_node: int = 1) -> float:
    """A synchronous parameter server's iteration, piece by piece (``server_pieces``), every
    machine behind one link.

    Each trainer sends every piece to its server (``shard``: pieces dealt over the k servers,
    each server hearing from all n trainers; ``group``: every piece to the trainer's group
    server, which hears from n/k trainers). The server's link receives the n_j copies
    (``n_j · S / B``) after the first can start arriving; the server adds the last copy
    (``S / A`` at aggregation throughput A) and sends the average back to each of its n_j
    trainers (``n_j · S / B`` on its link, after its previous answers; of the answer's own bytes
    where a piece says them), which the trainers' (or
    their node's) link receives after its previous answers. The bound it approaches, with
    everything ready at once and small pieces, is ``costs.ps_bound_ms``, ``max(M, n·M/k) / B``
    each way. With ``per_node`` G trainers sharing a node's link (servers on hosts of their
    own), the node sends and receives G copies: ``max(G·M, n·M/k) / B`` each way."""
    if not pieces:
        return 0.0
    if mapping == "group":
        fan_in = -(-n // k)  # the largest group
        servers = 1  # groups are alike: one stands for all
    else:
        fan_in, servers = n, k
    uplink = downlink = 0.0  # the trainer's (node's) link, outbound and inbound
    inbound, outbound = [0.0] * servers, [0.0] * servers  # each server's link, both ways
    done = 0.0
    for piece in pieces:
        ready, nbytes, server, back = *piece[:3], answered(piece)
        server = 0 if mapping == "group" else server
        sent_from = max(ready, uplink)
        uplink = sent_from + per_node * link.time(nbytes)
        # the server's link is busy while the copies cross it; the last arrives α later
        inbound[server] = max(uplink, max(sent_from, inbound[server]) + fan_in * link.time(nbytes))
        added = (inbound[server] + link.latency_ms +
                 (nbytes / aggregate_bytes_per_ms if aggregate_bytes_per_ms else 0.0))
        outbound[server] = max(added, outbound[server]) + fan_in * link.time(back)
        downlink = max(added, downlink) + per_node * link.time(back)
        done = max(done, outbound[server] + link.latency_ms, downlink + link.latency_ms)
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
                     aggregate_bytes_per_ms: float | None = None, colocated: bool = False,
                     gloo: bool = False, piece: float | None = None, window: int = 0) -> float:
    """Parameter servers fed once per node (``ps_node``; BytePS's layout), as ps_bench runs it. A
    bucket of S bytes is summed within the node when it is ready and the previous sum is done (a
    ring all-reduce of S on the local link, or NCCL's reduce-scatter, half of it), a piece's
    columns at a time; each of the G trainers pushes its S/G slice in pieces of at most
    ``piece`` bytes dealt over the k servers as the run deals them (``server_pieces``), each
    once its sum is done (the first after the first piece's share of the sum), at most
    ``window`` a trainer in flight (0: all): the pushes cross each link (``piece_pushes``) after
    what it carried of the previous buckets, arrive in waves (``pushed_in_waves``) and are
    answered (``exchange``); then the slices are all-gathered within the node, after the
    previous bucket's and once the last bucket's sum has been issued (sums and gathers share the
    node's group: the iteration's sums, then its gathers). The node's link carries S each way
    where ``ps`` carries G copies, and server j receives and answers N copies of its pieces;
    ``colocated``: server j is on node ``j mod N``, which keeps its own copy. Many buckets
    approach ``costs.byteps_bound_ms`` over the N nodes (k servers of their own: ``M/B`` once k
    reaches N), the next bucket's pushes crossing while the previous one's answers come back.
    N = 1: the local steps and, with dedicated servers, their links."""
    g, network = nodes.per_node, nodes.network
    pieces = server_pieces(buckets, k, piece, parts=g)
    summed = gathered = 0.0  # when the local sums and the gathers are free
    free: dict[str, float] = {}  # each link and direction, when it is done with what it was given
    place, last_handed = 0, max((ready for ready, _ in buckets), default=0.0)
    for ready, nbytes in buckets:
        count = g * len(piece_ranges(slice_size(int(round(nbytes)), g),
                                     piece and max(1, int(piece))))
        own = [(size, server) for _, size, server in pieces[place:place + count]]
        place += count
        inside = within_node_ms(nodes, nbytes, 2 if gloo else 1) if g > 1 else 0.0
        began, summed = max(ready, summed), max(ready, summed) + inside
        back = summed
        push = piece_pushes(own, nodes, k, colocated)
        if push:
            largest = max(size for size, _ in own)
            added = largest / aggregate_bytes_per_ms if aggregate_bytes_per_ms else 0.0
            each = count // g
            waves = pushed_in_waves([[server for _, server in own[part * each:(part + 1) * each]]
                                     for part in range(g)], window)
            # each piece's columns are summed on their own: the pushes start once the first
            # piece's sum is done, and the last answer comes after the last sum
            first = inside * min(1.0, g * own[0][0] / nbytes) if nbytes else 0.0
            back = max(exchange(free, began + first, push, network.latency_ms, added, waves),
                       summed + network.latency_ms)
        gathered = (max(back, gathered, last_handed) +
                    (within_node_ms(nodes, nbytes, 1) if g > 1 else 0.0))
    return gathered


def piece_pushes(pieces: list[tuple[float, int]], nodes: Nodes, k: int,
                 colocated: bool) -> dict[str, float]:
    """One bucket's ``(bytes, server)`` pieces pushed once per node: ms on each link and
    direction (``exchange``). Each node's link sends its S; server j's link receives the N nodes'
    copies of its pieces, ``N·c_j``. ``colocated``: server s is on node ``s mod N``, whose own
    copy stays on it: node m sends the pieces its servers do not hold, ``S - h_m``, and receives
    the other nodes' copies of those they do, ``(N-1)·h_m`` (``2(N-1)/N·S`` over both phases when
    the pieces are spread evenly: all-reduce's bytes)."""
    n, network = nodes.count, nodes.network
    if not pieces or (colocated and n == 1):  # every server on the one node: nothing crosses
        return {}
    total = sum(nbytes for nbytes, _ in pieces)
    held = [0.0] * k
    for nbytes, server in pieces:
        held[server] += nbytes
    if colocated:
        push = {}
        for node in range(n):
            own = sum(held[server] for server in range(node, k, n))
            push[f"node {node} out"] = network.time(total - own)
            push[f"node {node} in"] = network.time((n - 1) * own)
        return push
    return {"node out": network.time(total),  # every node alike
            **{f"server {server} in": network.time(n * held[server]) for server in range(k)
               if held[server]}}
