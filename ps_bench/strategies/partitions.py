"""Parameter servers fed as BytePS feeds them: what a trainer pushes is cut into pieces of at most
``partition_mb`` (of the gradient's own bytes), the pieces are dealt evenly over every server
(``topology.piece_owners``), and a window of them is in flight at a time, sent in the order they
were queued or, as ByteScheduler orders them, the pieces the next forward needs first.

BytePS cuts every tensor into partitions of ``BYTEPS_PARTITION_BYTES`` (4,096,000 by default) and
spreads them over all its servers; ``BYTEPS_SCHEDULING_CREDIT`` bounds the partitions in flight
(0 by default: no bound); ByteScheduler gives the layers nearer the input the higher priority
(Jiang et al., "A Unified Architecture for Accelerating Distributed DNN Training in
Heterogeneous GPU/CPU Clusters", OSDI 2020; Peng et al., "A Generic Communication Scheduler for
Distributed DNN Training Acceleration", SOSP 2019). DDP's buckets hold the gradients in reverse
order of the parameters, so the last bucket, and its last pieces, hold the first layers'."""

from __future__ import annotations

import functools
import math
import threading
from typing import Callable

import torch
from torch.futures import Future

from ps_bench.metrics.messages import piece_elements
from ps_bench.runtime.futures import device_future, issuing_stream
from ps_bench.strategies.base import HookContext
from ps_bench.strategies.scratch import Scratch


class PieceWindow:
    """A trainer's pieces on their way to the servers, sent in the order their places were
    reserved (``reserve``, as DDP hands the buckets over), at most ``window`` in flight (0: no
    bound), the next sent as one comes back.

    Every trainer reserves its pieces in the same order, so with a bound the pieces in flight are
    the same keys on every host and every server can answer them: a trainer never waits on a
    piece its peers have not sent. A piece whose place comes up before it is submitted (its
    host's sum not yet done) holds the ones after it."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.lock = threading.Lock()
        # place -> (what sends the piece, its answer, the stream to send it under)
        self.waiting: dict[int, tuple[Callable[[], Future], Future, Callable]] = {}
        self.reserved = 0  # places handed out so far
        self.next = 0  # the next place to send
        self.in_flight = 0

    def reserve(self, count: int) -> int:
        """The first of ``count`` consecutive places."""
        with self.lock:
            first, self.reserved = self.reserved, self.reserved + count
        return first

    def submit(self, place: int, send: Callable[[], Future], device: torch.device) -> Future:
        """The piece of a reserved ``place`` (``send`` starts its round trip); the future of its
        answer."""
        answer = device_future(device)
        with self.lock:  # sent now, or later from a callback: on the stream that made the piece
            self.waiting[place] = (send, answer, issuing_stream(device))
        self.pump()
        return answer

    def pump(self) -> None:
        """Sends the pieces whose turn it is while the window has room."""
        while True:
            with self.lock:
                if self.next not in self.waiting or (self.window and self.in_flight >= self.window):
                    return
                send, answer, issuing = self.waiting.pop(self.next)
                self.next += 1
                self.in_flight += 1
            try:
                with issuing():
                    sent = send()
                sent.then(functools.partial(self.returned, answer))
            except Exception as error:  # noqa: BLE001 - the trainer waits on the bucket's future
                self.returned(answer, None, error)

    def returned(self, answer: Future, done: Future | None, error: Exception | None = None) -> None:
        """A piece is back (its ``done`` future, or the ``error`` that kept it from leaving)."""
        with self.lock:
            self.in_flight -= 1
        try:
            if error is not None:
                raise error
            answer.set_result(done.value())
        except Exception as failure:  # noqa: BLE001 - the piece's own failure, passed on
            answer.set_exception(failure)
        self.pump()


def assembled(answers: list[Future], into: torch.Tensor) -> Future:
    """The pieces' answers, once all are back, written in order into ``into`` (as many elements as
    they hold together), and ``into`` as the result."""
    done = device_future(into.device)
    remaining, lock = [len(answers)], threading.Lock()

    def arrived(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:  # wait(): on a GPU, this stream waits for every piece's
            flat, first = into.reshape(-1), 0
            for answer in answers:
                part = answer.wait().reshape(-1)
                flat[first:first + part.numel()].copy_(part)
                first += part.numel()
            done.set_result(into)
        except Exception as error:  # noqa: BLE001 - the trainer waits on ``done``
            done.set_exception(error)

    for answer in answers:
        answer.add_done_callback(arrived)
    return done


class Partitioned:
    """A parameter-server hook that pushes pieces (see the module): its options are
    ``partition_mb`` (MiB of the gradient a piece holds at most; not given: 4 over several
    servers on the CPU, whole buckets to one server or over device maps,
    ``metrics.messages.piece_elements``), ``window`` (pieces in flight
    at once, 0: all) and ``priority`` (each bucket's pieces from its end, where DDP keeps the
    gradients of the earlier layers, which the next forward needs first)."""

    wire_dtype: torch.dtype | None = None  # what the pieces travel as (None: the gradient's)

    def __init__(self, ctx: HookContext, partition_mb: float | None = None, window: int = 0,
                 priority: bool = False) -> None:
        on_device = ctx.cuda_rpc and all(server.cuda_rpc for server in ctx.servers)
        self.piece = piece_elements({"partition_mb": partition_mb}, len(ctx.servers), on_device)
        self.sender = PieceWindow(window)
        self.priority = priority
        # the pieces' copies, kept from one iteration to the next
        self.scratch = Scratch(lambda: ctx.iteration)

    @staticmethod
    def check(partition_mb: float | None, window: int, priority: bool) -> None:
        if partition_mb is not None and not (
                isinstance(partition_mb, (int, float)) and math.isfinite(partition_mb)
                and partition_mb > 0):
            raise ValueError(f"hook option 'partition_mb' must be a number of MiB above 0; "
                             f"got {partition_mb!r}")
        if window < 0:
            raise ValueError(f"hook option 'window' must be 0 (no bound) or more; got {window}")

    def reserve(self, pieces: list[tuple[int, int, int, int]]) -> tuple[int, list]:
        """Places in the window for a bucket's ``pieces`` (``HookContext.pieces``), reserved as
        DDP hands the bucket over, and the pieces in the order they will be sent."""
        ordered = pieces[::-1] if self.priority else pieces
        return self.sender.reserve(len(ordered)), ordered

    def push(self, ctx: HookContext, tensor: torch.Tensor, reserved: tuple[int, list],
             send: Callable) -> Future:
        """Sends ``tensor``'s pieces in their ``reserved`` places with ``send(ctx, piece, key,
        server, wire_dtype)``; the future of the whole answer, written into ``tensor`` (as DDP's
        own all-reduce writes its bucket: every piece is a copy, or the whole tensor sent before
        any answer comes back)."""
        first_place, pieces = reserved
        flat = tensor.reshape(-1)
        # a piece is copied as it travels (``wire_dtype``), its answer cast back as it is written
        whole = len(pieces) == 1 and pieces[0][2] == flat.numel() and self.wire_dtype is None
        answers = {
            first: self.submit(ctx, flat if whole else self.scratch.copy(
                key, flat[first:first + length], self.wire_dtype), key, server,
                first_place + order, send)
            for order, (key, first, length, server) in enumerate(pieces)}
        return assembled([answers[first] for first in sorted(answers)], tensor)

    def submit(self, ctx: HookContext, piece: torch.Tensor, key: int, server: int, place: int,
               send: Callable) -> Future:
        """Sends one ``piece`` (a tensor of its own: RPC sends a view's whole storage) in its
        reserved ``place``; the future of its answer."""
        return self.sender.submit(place, functools.partial(send, ctx, piece, key, server,
                                                           self.wire_dtype), piece.device)
