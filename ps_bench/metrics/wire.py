"""Bytes on the wire, counted from what is actually handed to RPC and to collectives.

RPC payloads are counted by the hooks and servers that send them (``tensor_bytes``).
Collectives are counted where every strategy, ours or torch's (DDP hooks, FSDP2, ZeRO, model
averaging), calls them: ``install`` wraps ``torch.distributed``'s all-reduce, all-gather
(both forms), reduce-scatter and broadcast in the trainer process and charges each call what
the algorithm moves per rank (``ps_bench.metrics.costs``: a ring all-reduce sends and
receives ``2(n-1)/n`` of the buffer; a broadcast's source sends the buffer to each of the
others, and each of them receives it once). Only the names this
torch has are wrapped: torch 2.14 calls the single-tensor forms ``all_gather_single`` and
``reduce_scatter_single``, torch 2.11 ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
(in 2.14 those call the new ones inside torch, past the wrapper, so nothing counts twice).

Each counted call's interval, from the call to the completion of its work, is kept too
(``ByteCounter.timings``, tagged by collective and iteration): the time a strategy without DDP's
buckets (FSDP2, ZeRO's broadcasts, DeepSpeed) spends in its collectives.

Bytes between hosts are counted apart (``ByteCounter.crossing``, host to host), as a ring in
the group's rank order moves them: what a rank sends in a ring collective goes to its
successor, so it crosses a host link where the successor is on another host; a broadcast's
source sends to each of the others; an RPC payload goes to its server and the answer comes
back. A collective over one host's trainers crosses nothing.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from ps_bench.metrics.costs import allgather_bytes, allreduce_bytes, collective_bytes
from ps_bench.metrics.timers import sent_bytes, tensor_bytes


class ByteCounter:
    """Bytes one trainer has sent and received so far; thread-safe; ``paused`` stops counting.

    The trainer reads ``sent`` and ``recv`` at the end of each iteration, once every bucket's
    future has completed, and takes differences after the round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = self.recv = 0
        self.paused = False
        self.hosts: list[int] | None = None  # host index of every rank of the job, where known
        self.rank = 0  # this trainer's rank in the job (= in the trainers' group)
        # (from host, to host) -> bytes, hosts apart only
        self.crossing: dict[tuple[int, int], int] = {}
        # process group -> its ring successor's rank
        self._successors: dict[object, int | None] = {}
        # the trainer's current iteration, which its collectives' intervals belong to
        self.iteration = 0
        # (iteration, start, end, collective, blocking): every counted collective, from its
        # call to its completion; blocking: the caller waited in the call for all of it
        self.timings: deque[tuple[int, float, float, str, bool]] = deque()

    def time(self, collective: str, started: float, work) -> None:
        """Keeps a collective's interval: until ``work`` completes (an asynchronous call), else
        now (a blocking one)."""
        if self.paused:
            return
        iteration, keep = self.iteration, self.timings.append
        if work is None:
            keep((iteration, started, time.perf_counter(), collective, True))
        else:
            work.get_future().then(
                lambda _: keep((iteration, started, time.perf_counter(), collective, False)))

    def take_timings(self) -> list[tuple[int, float, float, str, bool]]:
        """The intervals kept since the last call, sorted."""
        pop = self.timings.popleft
        return sorted(pop() for _ in range(len(self.timings)))

    def add(self, sent: int = 0, recv: int = 0, peer: int | None = None) -> None:
        """``sent`` to and ``recv`` from ``peer`` (a rank of the job; None: no single peer)."""
        if self.paused:
            return
        with self._lock:
            self.sent += sent
            self.recv += recv
            if peer is not None:
                self._cross(self.rank, peer, sent)
                self._cross(peer, self.rank, recv)

    def _cross(self, source: int, destination: int, nbytes: int) -> None:
        if self.hosts is None or not nbytes:
            return
        here, there = self.hosts[source], self.hosts[destination]
        if here != there:
            self.crossing[here, there] = self.crossing.get((here, there), 0) + nbytes

    def successor(self, group) -> int | None:
        """The rank this rank sends to in a ring over ``group`` (its members in rank order)."""
        if group not in self._successors:
            members = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            mine = members.index(dist.get_rank())
            self._successors[group] = (members[(mine + 1) % len(members)] if len(members) > 1
                                       else None)
        return self._successors[group]

    def add_ring(self, moved: int, group) -> None:
        """A ring collective over ``group``: ``moved`` sent to the successor, as much received."""
        if self.paused:
            return
        successor = self.successor(group) if self.hosts is not None else None
        with self._lock:
            self.sent += moved
            self.recv += moved
            if successor is not None:
                self._cross(self.rank, successor, moved)

    def take_crossing(self) -> dict[tuple[int, int], int]:
        """The bytes between hosts since the last call."""
        with self._lock:
            crossing, self.crossing = self.crossing, {}
        return crossing


_counter: ByteCounter | None = None
_installed = False


def _world(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def install(counter: ByteCounter) -> None:
    """Charges this process's collectives on the default (trainer) group to ``counter``."""
    global _counter, _installed
    _counter = counter
    if _installed:
        return
    _installed = True
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    @functools.wraps(all_reduce)
    def counted_all_reduce(tensor: torch.Tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        started = time.perf_counter()
        if _counter is not None:
            _counter.add_ring(allreduce_bytes(sent_bytes(tensor), _world(group),
                                              tensor.is_sparse), group)
        return timed("all_reduce", started, all_reduce(tensor, *args, **kwargs))

    @functools.wraps(all_gather)
    def counted_all_gather(tensor_list, tensor: torch.Tensor, *args, **kwargs):
        group = kwargs.get("group", args[0] if args else None)
        started = time.perf_counter()
        if _counter is not None:
            _counter.add_ring(allgather_bytes(tensor_bytes(tensor), _world(group)), group)
        return timed("all_gather", started, all_gather(tensor_list, tensor, *args, **kwargs))

    dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather
    for name in ("all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counted_single(getattr(dist, name), "all_gather"))
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, counted_single(getattr(dist, name), "reduce_scatter"))
    dist.broadcast = counted_broadcast(dist.broadcast)


def counted_single(collective, kind: str):
    """An all-gather or reduce-scatter of one whole tensor, charged over the whole tensor: the
    all-gather's output, the reduce-scatter's input. Its arguments come by position or by name
    (``output_tensor``/``input_tensor`` for an all-gather, ``output``/``input`` for a
    reduce-scatter, as torch names them; DeepSpeed passes them by name)."""
    names = (("output_tensor", "input_tensor", "group") if kind == "all_gather"
             else ("output", "input", "op", "group"))

    @functools.wraps(collective)
    def counted(*args, **kwargs):
        started = time.perf_counter()
        if _counter is not None:
            given = dict(zip(names, args)) | kwargs
            group = given.get("group")
            whole = given[names[0]] if kind == "all_gather" else given[names[1]]
            backend = dist.get_backend(group) if group is not None else dist.get_backend()
            _counter.add_ring(collective_bytes(kind, tensor_bytes(whole), _world(group), backend),
                              group)
        return timed(kind, started, collective(*args, **kwargs))

    return counted


def counted_broadcast(broadcast):
    """A broadcast: its source sends the buffer to each of the others, the others receive it
    once."""

    @functools.wraps(broadcast)
    def counted(tensor: torch.Tensor, *args, **kwargs):
        started = time.perf_counter()
        if _counter is not None:
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            world = _world(group)
            source = kwargs.get("src", args[0] if args else None)
            group_source = kwargs.get("group_src")
            mine = (group_source == dist.get_rank(group) if group_source is not None
                    else source == dist.get_rank())
            nbytes = tensor_bytes(tensor)
            if world > 1 and mine:
                for peer in dist.get_process_group_ranks(group if group is not None
                                                         else dist.group.WORLD):
                    if peer != dist.get_rank():
                        _counter.add(sent=nbytes, peer=peer)
            elif world > 1:
                _counter.add(recv=nbytes)
        return timed("broadcast", started, broadcast(tensor, *args, **kwargs))

    return counted


def timed(collective: str, started: float, work):
    """Keeps the interval of a collective call (``ByteCounter.time``) and returns what it
    returned."""
    if _counter is not None:
        _counter.time(collective, started, work)
    return work


def host_links(traffic: dict[tuple[int, int], int], hosts: list[dict],
               iterations: float) -> dict:
    """With ranks on two hosts or more: the bytes per iteration that crossed between hosts, in all
    (``across_hosts_per_iter``) and on each host's link each way (``host_links``), from the
    trainers' ``crossing`` counts summed over a run (``traffic``)."""
    if len(hosts) < 2 or not iterations:
        return {}
    links = [{"host": host["hostname"],
              "out_per_iter": sum(n for (source, _), n in traffic.items()
                                  if source == index) / iterations,
              "in_per_iter": sum(n for (_, destination), n in traffic.items()
                                 if destination == index) / iterations}
             for index, host in enumerate(hosts)]
    return {"across_hosts_per_iter": sum(traffic.values()) / iterations, "host_links": links}
