"""The parameter-server protocol shared by every aggregation algorithm.

A trainer calls ``average_gradient`` once per bucket per iteration. The server keeps one
``BucketState`` per bucket (each with its own lock, so buckets never wait for each other),
adds contributions as the algorithm says, and, once every expected trainer has contributed,
answers all of them with the average. With the ``group`` mapping a server reduces only its
group and the servers combine their partial sums at the bucket's root server, so every
trainer still receives the global average.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future, collect_all

from ps_bench.runtime.failures import fatal_on_error
from ps_bench.runtime.faults import faults_of, maybe_inject
from ps_bench.runtime.futures import device_future
from ps_bench.runtime.membership import MEMBERSHIP, announce, drop_entry
from ps_bench.metrics import traces
from ps_bench.metrics.memory import held_bytes, peak_memory
from ps_bench.metrics.timers import now_ms, tensor_bytes
from ps_bench.registry import Registry
from ps_bench.runtime.resident import Resident
from ps_bench.runtime.topology import PIECES, piece_root
from ps_bench.servers.replicas import Copies, forward
from ps_bench.servers.state import BucketState, ServerBooks

SERVERS: Registry = Registry("server")


class ParameterServer(Resident):
    """Base class: subclasses define how contributions are accumulated and summed."""

    def __init__(
        self,
        server_index: int,
        num_servers: int,
        contributors: int,
        num_trainers: int,
        mapping: str,
        device: str = "cpu",
        fault: str | None = None,
        trainer_timeout: float | None = None,
        members: tuple[list[str], list[str]] = ([], []),
        replicas: int = 0,
    ) -> None:
        """``trainer_timeout``: drop a trainer that sends nothing for that long while a bucket
        waits on it (``runtime.membership``), ``members`` naming every rank to tell: the
        trainers, in index order, and the others; ``replicas`` 1: each contribution is also
        kept by the next server, which answers for this one once it is lost
        (``servers.replicas``)."""
        self.server_index = server_index
        self.num_servers = num_servers
        self.contributors = contributors
        self.num_trainers = num_trainers
        self.mapping = mapping
        self.device = torch.device(device)
        self.fault = faults_of(fault)
        self.peers: list[rpc.RRef] = []
        self.lost: set[int] = set()  # --server-replicas: the servers found gone
        self._buckets: dict[int, BucketState] = {}
        self._partials: dict[int, BucketState] = {}
        self._table_lock = threading.Lock()  # guards only the creation of bucket states
        self.books = ServerBooks()
        self.trainer_timeout, self.members = trainer_timeout, members
        self.copies = Copies(num_trainers, trainer_timeout is not None) if replicas else None
        if trainer_timeout is not None:
            MEMBERSHIP.listeners.append(self._recheck)
            threading.Thread(target=self._watch, name="trainer-watchdog", daemon=True).start()

    # -- what subclasses define ---------------------------------------------------------
    def accumulate(self, state: BucketState, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def total(self, state: BucketState) -> torch.Tensor:
        raise NotImplementedError

    # -- the RPC surface ------------------------------------------------------------------
    @staticmethod
    @rpc.functions.async_execution
    @fatal_on_error
    def average_gradient(server_rref: rpc.RRef, bucket_index: int, tensor: torch.Tensor,
                         iteration: int = 0, sender: int | None = None) -> Future:
        """Called by trainer ``sender``; the future completes with the global average of the
        bucket."""
        server = server_rref.local_value()
        maybe_inject(server.fault, "server", server.server_index, iteration)
        return server.contribute(bucket_index, tensor, iteration=iteration, sender=sender)

    @staticmethod
    @rpc.functions.async_execution
    @fatal_on_error
    def average_compressed(server_rref: rpc.RRef, bucket_index: int, message: torch.Tensor,
                           codec, layout: tuple[int, int, list[int]], compressed_answer: bool,
                           iteration: int = 0, sender: int | None = None) -> Future:
        """A trainer's bucket as ``codec`` compressed it (``strategies.codecs``; ``layout``:
        its values, the seed it was compressed with, its tensors' sizes), decoded and added as
        ``average_gradient`` adds it; the answer is the average, compressed by ``codec`` where
        ``compressed_answer`` (once for every trainer that asked)."""
        server = server_rref.local_value()
        maybe_inject(server.fault, "server", server.server_index, iteration)
        n, seed, sizes = layout
        answer = (functools.partial(encoded, codec, seed, sizes) if compressed_answer else None)
        return server.contribute(bucket_index, codec.decode(message.to(server.device), n, seed,
                                                            sizes),
                                 received=message.numel(), answer=answer, iteration=iteration,
                                 sender=sender)

    @staticmethod
    @rpc.functions.async_execution
    @fatal_on_error
    def combine_partial(server_rref: rpc.RRef, bucket_index: int, partial: torch.Tensor) -> Future:
        """Called by a group server on the bucket's root; completes with the global average."""
        server = server_rref.local_value()
        server.books.count("recv", tensor_bytes(partial))
        return server.combine(bucket_index, partial, remote=True)

    def set_peers(self, peers: list[rpc.RRef]) -> None:
        self.peers = peers

    def reset_state(self) -> None:
        """Forgets every bucket's contributions (not its buffers); called by the master between
        rounds. A bucket the round's last iteration sent nothing to is forgotten with its
        buffers: DDP rebuilds its buckets after the first iteration, and the first layout's
        pieces would otherwise stay beside the new ones for the whole run."""
        with self._table_lock:
            states = {**self._buckets, **self._partials}
        pending = [i for i, state in states.items() if state.count]
        for state in states.values():
            with state.lock:
                state.clear()
        if pending:
            raise RuntimeError(f"server {self.server_index}: buckets {pending} were incomplete "
                               f"at reset")
        with self._table_lock:
            newest = max((state.iteration for state in self._buckets.values()), default=0)
            for key in [key for key, state in self._buckets.items() if state.iteration < newest]:
                del self._buckets[key]
            for key in [key for key in self._partials if key not in self._buckets]:
                del self._partials[key]  # ``group``: a root's partials, of its own buckets' keys

    def take_metrics(self) -> dict:
        """Samples (ms) and byte counts since the last call, then clears them."""
        with self._table_lock:  # the sums' buffers it keeps, its share of the gradients
            buffers = [b for state in [*self._buckets.values(), *self._partials.values()]
                       for b in state.buffers]
        held = held_bytes({"parameters": [], "gradients": buffers, "optimizer": []})
        return {**self.books.take(), "memory": {**peak_memory(self.device), "model_states": held},
                **({"takeovers": self.copies.take()} if self.copies is not None else {})}

    def trace(self, path: str | None) -> None:
        """--trace: keep each bucket's spans from now (``path`` None), or write them to ``path``."""
        if path is None:
            self.books.spans = []
        elif self.books.spans is not None:
            traces.write_server_spans(path, self.books.spans, PIECES)
            self.books.spans = None

    # -- the work ---------------------------------------------------------------------------
    def _state(self, table: dict[int, BucketState], bucket_index: int) -> BucketState:
        state = table.get(bucket_index)
        if state is None:
            with self._table_lock:
                state = table.setdefault(bucket_index, BucketState())
        return state

    def _add(self, state: BucketState, tensor: torch.Tensor, expected: int) -> tuple[bool, float]:
        """Adds one contribution (caller holds the bucket's lock); returns (was it the last
        one, arrival time in ms)."""
        arrived = now_ms()
        local = tensor.to(self.device)
        if local.dtype in (torch.float16, torch.bfloat16):  # compressed on the wire, added in fp32
            local = local.float()
        if state.count == 0:
            state.first_ms, state.shape = arrived, local.shape
        elif local.shape != state.shape:
            raise ValueError(f"bucket shape {tuple(local.shape)} differs from {tuple(state.shape)}")
        start = now_ms()
        if local.is_cuda:
            self._after_the_last_contribution(state)
        self.accumulate(state, local)
        if local.is_cuda:
            state.added = torch.cuda.Event()
            state.added.record()
        state.aggregate_ms += now_ms() - start
        state.count += 1
        return state.count == expected, arrived

    @staticmethod
    def _after_the_last_contribution(state: BucketState) -> None:
        """Makes this request's stream wait until the bucket's previous contribution was added.

        CUDA RPC runs each request on a stream of its own, on which the tensors it brought are
        ready; another request's tensor, kept or summed on that request's stream, is not. Chained
        through ``state.added`` (under the bucket's lock), the stream that adds the last
        contribution, sums and divides has waited for every earlier one; the answer's future
        records that stream for the trainers to wait on."""
        if state.added is not None:
            torch.cuda.current_stream().wait_event(state.added)

    def _divide(self, state: BucketState, summed: torch.Tensor,
                divisor: int | None = None) -> torch.Tensor:
        """The average (over ``divisor`` trainers, else all), in the bucket's sum buffer: one
        division, no new tensor. A sum that is not in a buffer of ours (a lone contribution) is
        divided into one, so the caller's tensor is left as it was."""
        divisor = divisor or self.num_trainers
        if summed.is_sparse:
            return summed / divisor
        if not any(summed is buffer for buffer in state.buffers):
            return torch.div(summed, divisor, out=state.buffer_like(summed))
        return summed.div_(divisor)

    def contribute(self, bucket_index: int, tensor: torch.Tensor, received: int | None = None,
                   answer: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   iteration: int = 0, sender: int | None = None) -> Future:
        """Adds trainer ``sender``'s bucket (``received``: the bytes it came as, where not the
        tensor's; ``iteration``: the trainer's); the future completes with the global average
        (``answer``: made into what it returns)."""
        future = device_future(self.device)
        self.books.count("recv", tensor_bytes(tensor) if received is None else received)
        if sender is not None and sender in MEMBERSHIP.dropped:
            future.set_exception(RuntimeError(
                f"trainer {sender} was dropped: it sent nothing for --trainer-timeout "
                f"{self.trainer_timeout:g} s while the others waited"))
            return future
        state = self._state(self._buckets, bucket_index)
        copy = (forward(self, bucket_index, tensor, iteration, sender)
                if self.copies is not None else None)
        try:
            with state.lock:
                state.iteration = max(state.iteration, iteration)
                if copy is not None:
                    state.copies.append(copy)
                if sender is not None:
                    state.senders.add(sender)
                state.waiting.append((future, tensor.device.type == "cuda",
                                      answer or tensor.dtype))
                _, arrived = self._add(state, tensor, self.contributors)
                if not self._complete(state):
                    return future
                taken = self._take(state)
        except Exception as error:  # answer every waiting trainer, or they wait for a timeout
            self._fail(state, error)
            return future
        self._reply(bucket_index, state, taken, arrived)
        return future

    def _complete(self, state: BucketState) -> bool:
        """Every contribution is in (caller holds the bucket's lock): every trainer's, or, where
        trainers may be dropped, every living trainer's."""
        if self.trainer_timeout is None:
            return state.count == self.contributors
        return state.count > 0 and state.senders.issuperset(MEMBERSHIP.living(self.num_trainers))

    def _take(self, state: BucketState) -> tuple:
        """The complete bucket's sum and what answering needs, the bucket cleared for the next
        iteration (caller holds its lock)."""
        start = now_ms()
        summed = self.total(state)
        # --trainer-timeout: over the trainers that sent (ps_node's host sums: every trainer's)
        divisor = len(state.senders) if self.trainer_timeout is not None else None
        taken = (summed, divisor, state.waiting, state.first_ms,
                 state.aggregate_ms + now_ms() - start, state.copies)
        state.clear()  # before answering, so the next iteration starts afresh
        return taken

    def _reply(self, bucket_index: int, state: BucketState, taken: tuple, arrived: float) -> None:
        summed, divisor, waiting, first_ms, aggregate_ms, copies = taken
        if copies:  # answered once the replica holds every contribution (a lost one: none)
            collect_all(copies).add_done_callback(
                lambda _: self._reply(bucket_index, state, (*taken[:5], []), arrived))
            return
        straggler_ms = arrived - first_ms
        if self.mapping == "group":
            result = self._global_average(bucket_index, summed)
        else:
            result = Future()
            result.set_result(self._divide(state, summed, divisor))
        result.add_done_callback(lambda fut: self._answer(
            waiting, fut, first_ms, straggler_ms, aggregate_ms, bucket_index))

    # -- --trainer-timeout -------------------------------------------------------------------
    def _watch(self) -> None:
        """Every quarter of the timeout: a bucket that has waited longer on a living trainer
        drops it (every trainer missing from any such bucket), told to every rank."""
        limit_ms = self.trainer_timeout * 1000
        while True:
            time.sleep(self.trainer_timeout / 4)
            living = set(MEMBERSHIP.living(self.num_trainers))
            missing: set[int] = set()
            waited_ms, iteration = 0.0, None
            with self._table_lock:
                states = list(self._buckets.values())
            for state in states:
                with state.lock:
                    waited = now_ms() - state.first_ms
                    if state.count and waited > limit_ms:
                        missing |= living - state.senders
                        waited_ms, iteration = max(waited_ms, waited), state.iteration
            if missing:
                trainers, others = self.members
                me = rpc.get_worker_info().name
                announce({index: drop_entry(index, f"server {self.server_index}", iteration,
                                            waited_ms / 1000) for index in sorted(missing)},
                         [trainers[index] for index in sorted(living - missing)],
                         [name for name in others if name != me])

    def _recheck(self) -> None:
        """A trainer was dropped: every bucket that now has all the living's contributions is
        answered."""
        with self._table_lock:
            states = list(self._buckets.items())
        for bucket_index, state in states:
            with state.lock:
                if not (state.count and self._complete(state)):
                    continue
                taken = self._take(state)
            self._reply(bucket_index, state, taken, now_ms())

    def _global_average(self, bucket_index: int, partial_sum: torch.Tensor) -> Future:
        """``group`` mapping: hands this group's sum to the bucket's root server."""
        root = piece_root(bucket_index, self.num_servers)
        if root == self.server_index:
            return self.combine(bucket_index, partial_sum, remote=False)
        partial = partial_sum.cpu()
        self.books.count("sent", tensor_bytes(partial))
        peer = self.peers[root]
        reply = rpc.rpc_async(peer.owner(), type(self).combine_partial,
                              args=(peer, bucket_index, partial))
        return reply.then(self._received_global)

    def _received_global(self, fut: Future) -> torch.Tensor:
        value = fut.value()
        self.books.count("recv", tensor_bytes(value))
        return value

    def combine(self, bucket_index: int, partial: torch.Tensor, remote: bool) -> Future:
        """Root side of the ``group`` mapping: sums the servers' partials, divides once."""
        future: Future = Future()
        state = self._state(self._partials, bucket_index)
        try:
            with state.lock:
                state.waiting.append((future, remote, partial.dtype))
                complete, _ = self._add(state, partial, self.num_servers)
                if not complete:
                    return future
                average = self._divide(state, self.total(state)).cpu()
                waiting = state.waiting
                state.clear()
        except Exception as error:
            self._fail(state, error)
            return future
        for peer_future, peer_is_remote, _ in waiting:
            if peer_is_remote:
                self.books.count("sent", tensor_bytes(average))
            peer_future.set_result(average)
        return future

    def _answer(self, waiting: list[tuple[Future, bool, torch.dtype | Callable]], result: Future,
                first_ms: float, straggler_ms: float, aggregate_ms: float, bucket: int) -> None:
        try:
            average = result.wait()
        except Exception as error:
            for future, _, _ in waiting:
                future.set_exception(error)
            return
        if average.is_sparse:
            average = average.coalesce()
        answers: dict[tuple[bool, torch.dtype], torch.Tensor] = {}  # each form computed once
        for future, on_device, dtype in waiting:
            form = (on_device, dtype)
            if form not in answers:  # a dtype, or what makes the answer (a compressor's)
                answers[form] = (dtype(average) if callable(dtype) else
                                 average.to(device=self.device if on_device else "cpu",
                                            dtype=dtype))
            self.books.count("sent", tensor_bytes(answers[form]))
            future.set_result(answers[form])
        answered = now_ms()
        self.books.record((bucket, first_ms, first_ms + straggler_ms, answered),
                          straggler=straggler_ms, aggregate=aggregate_ms, round=answered - first_ms)

    def _fail(self, state: BucketState, error: Exception) -> None:
        with state.lock:
            waiting = state.waiting
            state.clear()
        for future, _, _ in waiting:
            if not future.done():
                future.set_exception(error)


def encoded(codec, seed: int, sizes: list[int], average: torch.Tensor) -> torch.Tensor:
    """An average as ``codec`` compresses it (``average_compressed``'s compressed answer)."""
    return codec.encode(average.reshape(-1), seed, 0, sizes)
