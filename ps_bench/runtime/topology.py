"""Ranks, roles, RPC names, trainer/bucket -> server mapping and CUDA device maps (pure).

Rank order: CPU-RPC trainers, CUDA-RPC trainers, CPU servers, CUDA servers, master (last).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

TRAINER, SERVER, MASTER = "trainer", "server", "master"
RPC_THREADS_MIN, RPC_THREADS_MAX = 4, 32


@dataclass(frozen=True)
class RankInfo:
    rank: int
    role: str  # trainer | server | master
    index: int  # position among the ranks of the same role
    cuda_rpc: bool  # tensors cross RPC on the GPU (through device maps)
    name: str

    def describe(self) -> str:
        return f"{self.role} {self.index} (rank {self.rank}, {self.name})"


def split_evenly(count: int, parts: int) -> list[range]:
    """``count`` items in ``parts`` contiguous groups whose sizes differ by at most one."""
    base, extra = divmod(count, parts)
    groups, start = [], 0
    for part in range(parts):
        size = base + (1 if part < extra else 0)
        groups.append(range(start, start + size))
        start += size
    return groups


def balance_buckets(bucket_bytes: dict[int, int], num_servers: int) -> dict[int, int]:
    """Bucket index -> server index, largest bucket first onto the least loaded server.

    Deterministic (ties broken by bucket index, then server index) so every trainer that
    sees the same buckets computes the same owners without talking to the others.
    """
    load = [0] * num_servers
    owner: dict[int, int] = {}
    for bucket, size in sorted(bucket_bytes.items(), key=lambda item: (-item[1], item[0])):
        server = min(range(num_servers), key=lambda s: (load[s], s))
        owner[bucket] = server
        load[server] += size
    return owner


# A piece's key (what a server knows it by): its slice's key ``index * parts + part`` times
# PIECES, plus its place in the slice.
PIECES = 1 << 16


def piece_ranges(size: int, piece: int | None) -> list[tuple[int, int]]:
    """``(first, length)`` of each piece of a slice of ``size`` elements (or bytes) cut into as
    few pieces of at most ``piece`` as it takes, of equal length (the first ones one longer
    where it does not divide), so that no small remainder is left to unbalance the servers
    (None: the slice whole)."""
    if piece is None or size <= piece:
        return [(0, size)]
    count = -(-size // piece)
    base, longer = divmod(size, count)
    lengths = [base + 1] * longer + [base] * (count - longer)
    return [(sum(lengths[:place]), length) for place, length in enumerate(lengths)]


def slice_size(size: int, parts: int) -> int:
    """The size of each of ``parts`` equal slices of a bucket of ``size`` (the last padded)."""
    return -(-size // parts)


def piece_owners(bucket_sizes: dict[int, int], parts: int, num_servers: int,
                 piece: int | None = None, sparse: Iterable[int] = ()) -> dict[int, int]:
    """Piece key -> server index. Each bucket (index -> size in elements or bytes) is cut into
    ``parts`` equal slices (node-aggregated servers: one for each trainer of a host) and each
    slice into pieces of at most ``piece`` (None: the slice whole); the pieces are dealt as
    ``balance_buckets`` deals buckets, the largest first onto the server with the least so far
    (ties in key order, so a slice's pieces of one size go round the servers), so the servers'
    loads differ by one piece at most and usually by much less, as BytePS spreads its
    partitions over all its servers.

    The ``sparse`` buckets go whole, one key each (``index * parts * PIECES``), and are dealt
    after the others, in index order, round the servers from the least loaded: what one sends
    is known only once it is sent (the rows its trainer touched, a share of its dense size that
    differs between trainers: 3.2 of 64 MiB for DummyModelSparse), so it weighs nothing in the
    deal of the dense pieces, and the servers take turns with them.

    Deterministic, so every trainer that sees the same buckets computes the same owners without
    talking to the others."""
    sparse = set(sparse)
    dense = {(index * parts + part) * PIECES + place: length
             for index, size in bucket_sizes.items() if index not in sparse
             for part in range(parts)
             for place, (_, length) in enumerate(piece_ranges(slice_size(size, parts), piece))}
    owners = balance_buckets(dense, num_servers)
    load = [0] * num_servers
    for key, server in owners.items():
        load[server] += dense[key]
    turns = sorted(range(num_servers), key=lambda server: (load[server], server))
    for turn, index in enumerate(sorted(sparse & set(bucket_sizes))):
        owners[index * parts * PIECES] = turns[turn % num_servers]
    return owners


def piece_root(key: int, num_servers: int) -> int:
    """The server that combines the ``group`` mapping's partial sums of piece ``key``: its slice
    and its place in the slice, taken round the servers."""
    return (key // PIECES + key % PIECES) % num_servers


class Topology:
    def __init__(
        self,
        ntrainer: int,
        ncudatrainer: int,
        nserver: int,
        ncudaserver: int,
        mapping: str = "shard",
        cuda_collectives: bool = False,
        pushing_hosts: int | None = None,
    ) -> None:
        self.ntrainer, self.ncudatrainer = ntrainer, ncudatrainer
        self.nserver, self.ncudaserver = nserver, ncudaserver
        self.mapping = mapping
        self.cuda_collectives = cuda_collectives  # nccl/multi: every trainer computes on a GPU
        self.num_trainers = ntrainer + ncudatrainer
        self.num_servers = nserver + ncudaserver
        self.world_size = self.num_trainers + self.num_servers + 1
        ranks: list[RankInfo] = []
        for i in range(self.num_trainers):
            ranks.append(RankInfo(i, TRAINER, i, i >= ntrainer, f"trainer{i}"))
        for i in range(self.num_servers):
            rank = self.num_trainers + i
            ranks.append(RankInfo(rank, SERVER, i, i >= nserver, f"server{rank}"))
        ranks.append(RankInfo(self.world_size - 1, MASTER, 0, False, "master"))
        self.ranks = ranks
        # node-aggregated servers (``pushing_hosts`` G): a host's G trainers sum their gradients and
        # push one copy, each trainer a 1/G slice, so a server hears from every host once per
        # slice; ``group`` groups hosts, a host's trainers all in its group
        self.per_host = pushing_hosts
        if not self.num_servers:
            self.groups = []
        elif pushing_hosts:
            self.groups = [range(hosts.start * pushing_hosts, hosts.stop * pushing_hosts)
                           for hosts in split_evenly(self.num_trainers // pushing_hosts,
                                                     self.num_servers)]
        else:
            self.groups = split_evenly(self.num_trainers, self.num_servers)

    @property
    def trainers(self) -> list[RankInfo]:
        return self.ranks[: self.num_trainers]

    @property
    def servers(self) -> list[RankInfo]:
        return self.ranks[self.num_trainers : self.num_trainers + self.num_servers]

    @property
    def master(self) -> RankInfo:
        return self.ranks[-1]

    @property
    def rpc_on_gpu(self) -> bool:
        """Every trainer and server sends its tensors over RPC on the GPU (through device maps)."""
        return all(info.cuda_rpc for info in self.trainers + self.servers)

    def info(self, rank: int) -> RankInfo:
        return self.ranks[rank]

    def group_of(self, trainer_index: int) -> int:
        """The server index whose group holds this trainer (``group`` mapping)."""
        for server, members in enumerate(self.groups):
            if trainer_index in members:
                return server
        raise ValueError(f"trainer {trainer_index} is in no group")

    def contributors(self, server_index: int) -> int:
        """How many trainers send each bucket (or, node-aggregated, each slice) to this server."""
        pushing = len(self.groups[server_index]) if self.mapping == "group" else self.num_trainers
        return pushing // self.per_host if self.per_host else pushing

    def uses_cuda(self, rank: int) -> bool:
        info = self.info(rank)
        if info.role == TRAINER:
            return info.cuda_rpc or self.cuda_collectives
        return info.cuda_rpc

    def device_index(self, rank: int, local_world_size: int, gpus_per_node: int) -> int | None:
        """Node-local CUDA device of a rank (ranks fill nodes in order), or None on the CPU."""
        if not self.uses_cuda(rank) or gpus_per_node == 0:
            return None
        return (rank % local_world_size) % gpus_per_node

    def device_maps(self, rank: int, local_world_size: int,
                    gpus_per_node: int) -> dict[str, dict[int, int]]:
        """TensorPipe device maps for this rank: CUDA-RPC trainers <-> CUDA servers, 1-to-1."""
        me = self.info(rank)
        if not me.cuda_rpc or me.role == MASTER:
            return {}
        peers = self.servers if me.role == TRAINER else self.trainers
        mine = self.device_index(rank, local_world_size, gpus_per_node)
        maps = {}
        for peer in peers:
            if peer.cuda_rpc:
                theirs = self.device_index(peer.rank, local_world_size, gpus_per_node)
                maps[peer.name] = {mine: theirs}
        return maps

    def rpc_worker_threads(self, rank: int) -> int:
        """TensorPipe worker threads this rank needs, no more: on a few cores every extra thread
        competes with the ones doing work. Servers never park a thread (async execution), so one
        per peer that can call at once (trainers, other servers, the master) suffices; a trainer
        parks one thread for the round the master asked for and handles each server's answers;
        the master only waits on its own calls."""
        role = self.info(rank).role
        if role == SERVER:
            wanted = self.num_trainers + self.num_servers + 1
        elif role == TRAINER:
            wanted = self.num_servers + 2
        else:
            wanted = 2
        return min(RPC_THREADS_MAX, max(RPC_THREADS_MIN, wanted))

    def describe_mapping(self, info: RankInfo) -> str:
        if info.role == TRAINER:
            if not self.num_servers:
                return "-"
            if self.mapping == "group":
                return f"sends to {self.servers[self.group_of(info.index)].name}"
            return "each bucket to its owner (bytes balanced)"
        if info.role == SERVER:
            if self.mapping == "group":
                members = ", ".join(self.trainers[t].name for t in self.groups[info.index])
                return f"group: {members or '-'}"
            return f"owns ~1/{self.num_servers} of the bytes, all trainers"
        return "creates servers, drives rounds"
