"""Servers that own the parameters: stale-synchronous and asynchronous training (``--staleness``;
the strategy's record, its option S and its checks are ``ps_bench.strategies.stale``).

Each server holds a shard of the model's parameters (whole tensors, balanced by bytes) and
applies SGD to it. A trainer pushes its gradient of clock ``c`` (its ``c``-th iteration, from
0) for the shard; the server applies ``-lr / n`` times it at once (n trainers: one clock of
every trainer is one synchronous step at ``lr``) and answers with the shard's parameters for
the trainer's next clock once the bound allows: a trainer about to compute clock ``c`` reads
only when the slowest trainer has pushed clock ``c - S - 1`` (Ho et al., NIPS 2013). ``S = 0``
is bulk-synchronous: every update of clock ``c`` is in before anyone reads for ``c + 1``, so it
trains as the synchronous ``ps`` strategy does; ``S = inf`` never waits. A trainer that failed
(dropped by the master, ``runtime.membership``) holds nobody back: the bound counts the living.

The observed staleness of an update is ``c`` minus the slowest trainer's clock when the
parameters it was computed from were read: how many clocks of some trainer's updates it may be
missing. The bound guarantees it is at most S.

A round is a budget of updates (n times the iterations of a synchronous round), pooled over
the trainers, so that a fast trainer may do more than its share; once it is spent every
waiting trainer is answered with no parameters and the round's end, and the next round begins
with a ``pull``. ``stop_training`` ends training for good (a met target).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from ps_bench.runtime.failures import fatal_on_error
from ps_bench.runtime.faults import faults_of, maybe_inject
from ps_bench.runtime.membership import MEMBERSHIP
from ps_bench.metrics.memory import held_bytes, peak_memory
from ps_bench.metrics.timers import now_ms, tensor_bytes
from ps_bench.models.base import build_model
from ps_bench.models.entries import Entry
from ps_bench.servers.base import SERVERS, ServerBooks
from ps_bench.runtime.topology import balance_buckets
from ps_bench.runtime.resident import Resident

GO, ROUND_OVER, STOPPED = "go", "round", "stop"  # what an answer tells the trainer


def shard_owners(network: torch.nn.Module, num_servers: int) -> dict[int, int]:
    """Parameter index (in ``parameters()`` order) -> the server that owns it, balanced by bytes;
    the same on every trainer and server."""
    sizes = {i: p.numel() * p.element_size() for i, p in enumerate(network.parameters())}
    return balance_buckets(sizes, num_servers)


@SERVERS.register("ssp", aliases=("stale_synchronous",))
class StaleSynchronousServer(Resident):
    """Owns a shard of the parameters and applies SGD to it; answers within the staleness bound."""

    def __init__(self, server_index: int, num_servers: int, contributors: int, num_trainers: int,
                 mapping: str, device: str = "cpu", fault: str | None = None) -> None:
        self.server_index, self.num_servers, self.num_trainers = (
            server_index, num_servers, num_trainers)
        self.fault = faults_of(fault)
        self.lock = threading.Lock()
        self.parameters: list[torch.Tensor] = []
        self.lr, self.bound, self.budget = 0.0, math.inf, 0
        self.clocks = [0] * num_trainers  # clocks each trainer has pushed
        self.read_at = [0] * num_trainers  # the slowest trainer's clock when each last read
        # trainer, clock it computes next, answer, since ms
        self.waiting: list[tuple[int, int, Future, float]] = []
        self.updates = self.round_updates = 0
        self.round_over = self.stopped = False
        self.books = ServerBooks()
        # each applied update's observed staleness, since the last take_metrics
        self._staleness: list[int] = []
        MEMBERSHIP.listeners.append(self._recheck)  # a trainer dropped: nobody waits on its clock

    def _recheck(self) -> None:
        with self.lock:
            ready = self.release()
        self.answer(ready)

    def set_peers(self, peers: list[rpc.RRef]) -> None:
        """Servers of this kind never talk to each other."""

    def own(self, model: Entry, seed: int, lr: float, staleness: float, round_updates: int) -> int:
        """Builds the model as every trainer does (same seed) and keeps this server's shard;
        returns how many parameter tensors it owns."""
        network = build_model(model.class_name, model.kwargs, seed)
        owners = shard_owners(network, self.num_servers)
        self.parameters = [p.detach().clone() for i, p in enumerate(network.parameters())
                           if owners[i] == self.server_index]
        self.lr, self.bound, self.budget = lr, staleness, round_updates
        return len(self.parameters)

    # -- the RPC surface ----------------------------------------------------------------------
    @staticmethod
    @rpc.functions.async_execution
    @fatal_on_error
    def push(server_rref: rpc.RRef, trainer: int, clock: int,
             gradients: list[torch.Tensor]) -> Future:
        """Applies ``trainer``'s gradients of ``clock``; the answer is ``(parameters for clock + 1
        or None, updates applied in all, GO | ROUND_OVER | STOPPED)``."""
        server = server_rref.local_value()
        maybe_inject(server.fault, "server", server.server_index, clock + 1)
        return server.apply(trainer, clock, gradients)

    @staticmethod
    @rpc.functions.async_execution
    @fatal_on_error
    def pull(server_rref: rpc.RRef, trainer: int, clock: int) -> Future:
        """The parameters for computing ``clock``, once the bound allows (the start of a round)."""
        return server_rref.local_value().read(trainer, clock)

    def read(self, trainer: int, clock: int) -> Future:
        """The answer to a pull: waits with the others for the bound."""
        future = Future()
        with self.lock:
            self.waiting.append((trainer, clock, future, now_ms()))
            ready = self.release()
        self.answer(ready)
        return future

    def stop_training(self) -> None:
        """Training is over (the target is met): every waiting trainer hears so, nothing more is
        applied."""
        with self.lock:
            self.stopped = True
            ready = self.release()
        self.answer(ready)

    def reset_state(self) -> None:
        """Between rounds: a new budget. Every trainer has ended its round, so none may wait."""
        with self.lock:
            if self.waiting:
                raise RuntimeError(f"server {self.server_index}: trainers "
                                   f"{[w[0] for w in self.waiting]} still "
                                   f"waiting at the end of a round")
            self.round_updates, self.round_over = 0, False

    def take_metrics(self) -> dict:
        with self.lock:
            staleness, self._staleness = self._staleness, []
        held = held_bytes({"parameters": self.parameters, "gradients": [], "optimizer": []})
        return {**self.books.take(), "memory": {**peak_memory(), "model_states": held},
                "staleness": staleness, "updates": len(staleness)}

    def parameters_vector(self) -> torch.Tensor:
        with self.lock:
            return (torch.cat([p.reshape(-1) for p in self.parameters]) if self.parameters
                    else torch.zeros(0))

    def parameters_now(self) -> list[torch.Tensor]:
        with self.lock:
            return [p.clone() for p in self.parameters]

    # -- the work -----------------------------------------------------------------------------
    def apply(self, trainer: int, clock: int, gradients: list[torch.Tensor]) -> Future:
        arrived = now_ms()
        future = Future()
        with self.lock:
            self.books.count("recv", sum(tensor_bytes(g) for g in gradients))
            if not self.stopped:
                start = now_ms()
                for parameter, gradient in zip(self.parameters, gradients):
                    parameter.add_(gradient, alpha=-self.lr / self.num_trainers)
                self.books.record(aggregate=now_ms() - start)
                self._staleness.append(clock - self.read_at[trainer])
                self.clocks[trainer] = clock + 1
                self.updates += 1
                self.round_updates += 1
                self.round_over = self.round_updates >= self.budget
            self.waiting.append((trainer, clock + 1, future, arrived))
            ready = self.release()
        self.answer(ready)
        return future

    def release(self) -> list[tuple[Future, tuple, float]]:
        """Which waiting trainers may be answered now, and with what (the caller holds the lock)."""
        living = [clock for trainer, clock in enumerate(self.clocks)
                  if trainer not in MEMBERSHIP.dropped]
        slowest = min(living) if living else math.inf
        ready, still = [], []
        for trainer, clock, future, since in self.waiting:
            if self.stopped or self.round_over:
                ready.append((future, (None, self.updates, STOPPED if self.stopped else ROUND_OVER),
                              since))
            elif slowest >= clock - self.bound:
                self.read_at[trainer] = slowest
                ready.append((future, ([p.clone() for p in self.parameters], self.updates, GO),
                              since))
            else:
                still.append((trainer, clock, future, since))
        self.waiting = still
        return ready

    def answer(self, ready: list[tuple[Future, tuple, float]]) -> None:
        """Completes the answers outside the lock; ``round`` is the ms from the request to its
        answer."""
        for future, reply, since in ready:
            self.books.record(round=now_ms() - since)
            if reply[0] is not None:
                self.books.count("sent", sum(tensor_bytes(p) for p in reply[0]))
            future.set_result(reply)
