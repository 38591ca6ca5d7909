"""``--server-replicas 1``: each server's buckets are also kept by the next server, and a trainer
whose server is gone asks that replica, which answers for it from then on (Li et al., "Scaling
Distributed Machine Learning with the Parameter Server", OSDI 2014, §4.4: chain replication of
each server's key range by its successor).

What a synchronous ps_bench server holds is the running iteration's contributions (the trainers
own the parameters). The server forwards each contribution to its replica before adding it, and
answers a bucket only once the replica has every contribution to it: whatever iteration a
trainer is at when the server dies, the replica holds what the server summed, and a trainer that
had its answer and one that did not get the same average. The replica keeps each bucket's last
two iterations, by sender, and sums them in the senders' order."""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from ps_bench.config import RunConfig, need
from ps_bench.metrics.timers import tensor_bytes
from ps_bench.runtime.failures import fatal_on_error
from ps_bench.runtime.membership import MEMBERSHIP


@dataclass
class Copy:
    """One bucket of one iteration of the server this one is the replica of."""

    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # sender -> contribution
    waiting: list[tuple[Future, torch.dtype]] = field(default_factory=list)
    answer: torch.Tensor | None = None


class Copies:
    """What a server keeps of its predecessor's buckets, and its answers for it once it is
    gone (``takeovers``: when it first answered for each, from which iteration)."""

    def __init__(self, num_trainers: int, elastic: bool) -> None:
        self.num_trainers, self.elastic = num_trainers, elastic
        self.lock = threading.Lock()
        self.table: dict[tuple[int, int], dict[int, Copy]] = {}
        self.takeovers: dict[int, dict] = {}

    def entry(self, owner: int, key: int, iteration: int) -> Copy:
        """The copy of ``owner``'s bucket ``key`` at ``iteration`` (caller holds the lock); the
        iterations before the one preceding it are forgotten."""
        iterations = self.table.setdefault((owner, key), {})
        if iteration not in iterations:
            iterations[iteration] = Copy()
            for old in [i for i in iterations if i < iteration - 1]:
                del iterations[old]
        return iterations[iteration]

    def keep(self, owner: int, key: int, iteration: int, sender: int,
             tensor: torch.Tensor) -> None:
        with self.lock:
            self.entry(owner, key, iteration).tensors.setdefault(sender, tensor)

    def ask(self, owner: int, key: int, iteration: int, sender: int, tensor: torch.Tensor,
            future: Future) -> None:
        """Trainer ``sender``'s bucket for ``owner``, gone: answered once every living trainer's
        contribution is here (forwarded by ``owner`` before it went, or sent again now)."""
        with self.lock:
            copy = self.entry(owner, key, iteration)
            copy.tensors.setdefault(sender, tensor)
            copy.waiting.append((future, tensor.dtype))
            if copy.answer is None and set(copy.tensors) >= set(
                    MEMBERSHIP.living(self.num_trainers)):
                summed = functools.reduce(torch.add, [copy.tensors[s].float()
                                                      for s in sorted(copy.tensors)])
                copy.answer = summed / (len(copy.tensors) if self.elastic else self.num_trainers)
            if copy.answer is None:
                return
            waiting, copy.waiting = copy.waiting, []
            self.takeovers.setdefault(owner, {"server": owner, "at": time.time(),
                                              "iteration": iteration})
        for waiter, dtype in waiting:
            waiter.set_result(copy.answer.to(dtype))

    def take(self) -> list[dict]:
        with self.lock:
            return list(self.takeovers.values())


@fatal_on_error
def keep_copy(server_rref: rpc.RRef, owner: int, key: int, tensor: torch.Tensor, iteration: int,
              sender: int) -> None:
    """RPC target: server ``owner`` forwards a contribution to its replica."""
    server = server_rref.local_value()
    server.books.count("recv", tensor_bytes(tensor))
    server.copies.keep(owner, key, iteration, sender, tensor)


@rpc.functions.async_execution
@fatal_on_error
def average_for(server_rref: rpc.RRef, owner: int, key: int, tensor: torch.Tensor,
                iteration: int, sender: int) -> Future:
    """RPC target: a trainer whose server ``owner`` is gone asks its replica for the average."""
    server = server_rref.local_value()
    future = Future()
    server.books.count("recv", tensor_bytes(tensor))
    server.copies.ask(owner, key, iteration, sender, tensor, future)
    return future


def forward(server, key: int, tensor: torch.Tensor, iteration: int,
            sender: int | None) -> Future | None:
    """A contribution to ``server`` (a ``ParameterServer``) forwarded to its replica, unless
    that one is lost; the future of its acknowledgement."""
    replica = replica_of(server.server_index, server.num_servers)
    if replica in server.lost or sender is None:
        return None
    peer = server.peers[replica]
    server.books.count("sent", tensor_bytes(tensor))
    future = rpc.rpc_async(peer.owner(), keep_copy, args=(
        peer, server.server_index, key, tensor.cpu(), iteration, sender))

    def acknowledged(fut: Future) -> None:
        try:
            fut.wait()
        except RuntimeError:  # the replica is lost: this server keeps no copies now
            server.lost.add(replica)

    future.add_done_callback(acknowledged)
    return future


def replica_of(server: int, servers: int) -> int:
    return (server + 1) % servers


def failover(ctx, reply: Future | None, payload: torch.Tensor, key: int, server: int) -> Future:
    """The answer of ``reply`` (``payload`` sent to ``server``), or, where that server is gone,
    its replica's: asked at once for a server known to be gone (``reply`` None), else once the
    reply fails."""
    replica = ctx.servers[replica_of(server, len(ctx.servers))]
    ask = functools.partial(rpc.rpc_async, replica.rref.owner(), average_for,
                            args=(replica.rref, server, key, payload, ctx.iteration, ctx.trainer),
                            timeout=ctx.rpc_timeout)
    if reply is None:
        return ask()
    result = Future()

    def answered(fut: Future) -> None:
        try:
            result.set_result(fut.value())
            return
        except RuntimeError as error:
            if answered_by_it(error):  # its own answer: an error, not a server gone
                result.set_exception(error)
                return
        ctx.lost_servers.add(server)
        ask().add_done_callback(lambda again: settle(result, again))

    reply.add_done_callback(answered)
    return result


def answered_by_it(error: RuntimeError) -> bool:
    """Whether ``error`` is the server's own answer (this trainer was dropped), rather than the
    server gone: the connection to it closed, or no answer within the RPC timeout."""
    return "was dropped" in str(error)


def settle(result: Future, fut: Future) -> None:
    try:
        result.set_result(fut.value())
    except RuntimeError as error:
        result.set_exception(error)


def check(cfg: RunConfig, replicated: bool, hook: str) -> None:
    """``--server-replicas``: 0, or 1 with another server to keep the copies, on a strategy
    whose servers' buckets can be kept, on CPU servers."""
    if cfg.server_replicas == 0:
        return
    need(cfg.server_replicas in (0, 1), f"--server-replicas must be 0 or 1 (each server's "
                                        f"buckets kept by the next server); got "
                                        f"{cfg.server_replicas}")
    need(cfg.num_servers >= 2, f"--server-replicas 1 keeps each server's buckets on another "
                               f"server: give --nserver 2 or more (this run has "
                               f"{cfg.num_servers})")
    need(replicated, f"--server-replicas keeps the buckets trainers send whole to a server; "
                     f"--hook {hook} does not (use ps, ps_fp16 or ps_bf16)")
    need(cfg.mapping != "group" and not cfg.ncudaserver,
         "--server-replicas: with --mapping shard and CPU servers only (a group's sums and "
         "CUDA RPC's streams are not kept)")
    for option, value in (("--checkpoint-every", cfg.checkpoint_every),
                          ("--target-loss", cfg.target_loss), ("--limits", cfg.limits or None)):
        need(value is None, f"--server-replicas with {option}: it waits on every server")
