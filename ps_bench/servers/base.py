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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed.rpc as rpc
from torch.futures import Future

from ps_bench.runtime.failures import fatal_on_error
from ps_bench.runtime.faults import faults_of, maybe_inject
from ps_bench.runtime.futures import device_future
from ps_bench.metrics.memory import held_bytes, peak_memory
from ps_bench.metrics.timers import now_ms, tensor_bytes
from ps_bench.registry import Registry
from ps_bench.runtime.resident import Resident
from ps_bench.runtime.topology import piece_root

SERVERS: Registry = Registry("server")


@dataclass
class BucketState:
    """What one bucket has received so far in the current iteration, and the buffers it keeps
    across iterations."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    count: int = 0
    # algorithm-specific: a received tensor, a running sum or a list of tensors
    accumulator: object = None
    # future, on device, wire dtype
    # (the trainer's answer, on its device, its dtype or what makes its answer)
    waiting: list[tuple[Future, bool, torch.dtype | Callable]] = field(default_factory=list)
    first_ms: float = 0.0
    aggregate_ms: float = 0.0
    shape: torch.Size | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    turn: int = 0
    iteration: int = 0  # the trainers' last iteration that sent to it
    # on a CUDA server: recorded after the last contribution was added, on its request's stream
    added: torch.cuda.Event | None = None

    def clear(self) -> None:
        """Forgets this iteration's contributions; the buffers stay."""
        self.count, self.accumulator, self.waiting = 0, None, []
        self.aggregate_ms, self.shape = 0.0, None

    def buffer_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """This iteration's sum buffer, allocated once and reused.

        Two buffers take turns, one per iteration: an answer may still be on its way to a trainer
        (TensorPipe sends from the tensor's memory) when the others' next contributions arrive,
        and none of them can arrive before every trainer has its answer, so the buffer two
        iterations back is always free."""
        self.turn ^= 1
        if len(self.buffers) < 2:
            self.buffers = [torch.empty_like(tensor), torch.empty_like(tensor)]
        buffer = self.buffers[self.turn]
        if (buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or
                buffer.device != tensor.device):
            buffer = self.buffers[self.turn] = torch.empty_like(tensor)
        return buffer


class ServerBooks:
    """What a server measures between two ``take`` calls: samples (ms) by name and payload bytes
    received and sent; thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.bytes = {"recv": 0, "sent": 0}

    def count(self, direction: str, nbytes: int) -> None:
        with self.lock:
            self.bytes[direction] += nbytes

    def record(self, **samples_ms: float) -> None:
        with self.lock:
            for name, value in samples_ms.items():
                self.samples[name].append(value)

    def take(self) -> dict:
        """The samples and byte counts since the last call, then clears them."""
        with self.lock:
            out = {"samples": dict(self.samples), "bytes": dict(self.bytes)}
            self.samples, self.bytes = defaultdict(list), {"recv": 0, "sent": 0}
        return out


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
    ) -> None:
        self.server_index = server_index
        self.num_servers = num_servers
        self.contributors = contributors
        self.num_trainers = num_trainers
        self.mapping = mapping
        self.device = torch.device(device)
        self.fault = faults_of(fault)
        self.peers: list[rpc.RRef] = []
        self._buckets: dict[int, BucketState] = {}
        self._partials: dict[int, BucketState] = {}
        self._table_lock = threading.Lock()  # guards only the creation of bucket states
        self.books = ServerBooks()

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
                         iteration: int = 0) -> Future:
        """Called by a trainer; the future completes with the global average of the bucket."""
        server = server_rref.local_value()
        maybe_inject(server.fault, "server", server.server_index, iteration)
        return server.contribute(bucket_index, tensor, iteration=iteration)

    @staticmethod
    @rpc.functions.async_execution
    @fatal_on_error
    def average_compressed(server_rref: rpc.RRef, bucket_index: int, message: torch.Tensor,
                           codec, layout: tuple[int, int, list[int]], compressed_answer: bool,
                           iteration: int = 0) -> Future:
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
                                 received=message.numel(), answer=answer, iteration=iteration)

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
        return {**self.books.take(), "memory": {**peak_memory(self.device), "model_states": held}}

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

    def _divide(self, state: BucketState, summed: torch.Tensor) -> torch.Tensor:
        """The average, in the bucket's sum buffer: one division, no new tensor. A sum that is
        not in a buffer of ours (a lone contribution) is divided into one, so the caller's
        tensor is left as it was."""
        if summed.is_sparse:
            return summed / self.num_trainers
        if not any(summed is buffer for buffer in state.buffers):
            return torch.div(summed, self.num_trainers, out=state.buffer_like(summed))
        return summed.div_(self.num_trainers)

    def contribute(self, bucket_index: int, tensor: torch.Tensor, received: int | None = None,
                   answer: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   iteration: int = 0) -> Future:
        """Adds a trainer's bucket (``received``: the bytes it came as, where not the tensor's;
        ``iteration``: the trainer's); the future completes with the global average (``answer``:
        made into what it returns)."""
        future = device_future(self.device)
        self.books.count("recv", tensor_bytes(tensor) if received is None else received)
        state = self._state(self._buckets, bucket_index)
        try:
            with state.lock:
                state.iteration = max(state.iteration, iteration)
                state.waiting.append((future, tensor.device.type == "cuda",
                                      answer or tensor.dtype))
                complete, arrived = self._add(state, tensor, self.contributors)
                if not complete:
                    return future
                start = now_ms()
                summed = self.total(state)
                aggregate_ms = state.aggregate_ms + now_ms() - start
                waiting, first_ms = state.waiting, state.first_ms
                state.clear()  # before answering, so the next iteration starts afresh
        except Exception as error:  # answer every waiting trainer, or they wait for a timeout
            self._fail(state, error)
            return future
        straggler_ms = arrived - first_ms
        if self.mapping == "group":
            result = self._global_average(bucket_index, summed)
        else:
            result = Future()
            result.set_result(self._divide(state, summed))
        result.add_done_callback(
            lambda fut: self._answer(waiting, fut, first_ms, straggler_ms, aggregate_ms))
        return future

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
                first_ms: float, straggler_ms: float, aggregate_ms: float) -> None:
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
        self.books.record(straggler=straggler_ms, aggregate=aggregate_ms, round=now_ms() - first_ms)

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
