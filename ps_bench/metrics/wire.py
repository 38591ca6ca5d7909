"""Bytes on the wire, counted from what is actually handed to RPC and to collectives.

RPC payloads are counted by the hooks and servers that send them (``tensor_bytes``).
Collectives are counted where every hook, ours or torch's, calls them: ``install`` wraps
``torch.distributed.all_reduce`` and ``all_gather`` in the trainer process and charges each
call what the algorithm moves per rank (a ring all-reduce sends and receives ``2(n-1)/n`` of
the buffer; an all-gather sends its input to and receives one from each of ``n-1`` peers).
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

from ps_bench.metrics.timers import tensor_bytes


def allreduce_bytes(nbytes: int, world: int, sparse: bool = False) -> int:
    """Bytes one rank sends (and receives) in an all-reduce of ``nbytes``.

    Dense: a ring, ``2(n-1)/n`` of the buffer. Sparse (gloo): every rank's indices and values
    go to every other rank, ``(n-1)`` times the payload.
    """
    if world <= 1:
        return 0
    return (world - 1) * nbytes if sparse else 2 * (world - 1) * nbytes // world


def allgather_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends (and receives) in an all-gather of ``nbytes`` per rank."""
    return (world - 1) * nbytes if world > 1 else 0


class ByteCounter:
    """Bytes one trainer has sent and received so far; thread-safe; ``paused`` stops counting.

    The trainer reads ``sent`` and ``recv`` at the end of each iteration, once every bucket's
    future has completed, and takes differences after the round."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = self.recv = 0
        self.paused = False

    def add(self, sent: int = 0, recv: int = 0) -> None:
        if self.paused:
            return
        with self._lock:
            self.sent += sent
            self.recv += recv


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
        if _counter is not None:
            moved = allreduce_bytes(tensor_bytes(tensor), _world(group), tensor.is_sparse)
            _counter.add(sent=moved, recv=moved)
        return all_reduce(tensor, *args, **kwargs)

    @functools.wraps(all_gather)
    def counted_all_gather(tensor_list, tensor: torch.Tensor, *args, **kwargs):
        group = kwargs.get("group", args[0] if args else None)
        if _counter is not None:
            moved = allgather_bytes(tensor_bytes(tensor), _world(group))
            _counter.add(sent=moved, recv=moved)
        return all_gather(tensor_list, tensor, *args, **kwargs)

    dist.all_reduce, dist.all_gather = counted_all_reduce, counted_all_gather
