"""What a parameter server keeps: each bucket's contributions of the running iteration with the
buffers it reuses (``BucketState``), and its samples and byte counts (``ServerBooks``)."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.futures import Future

from ps_bench.metrics.timers import TIMELINE_ITERATIONS, clock_id


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
    copies: list[Future] = field(default_factory=list)  # --server-replicas: kept by the replica
    senders: set[int] = field(default_factory=set)  # --trainer-timeout: who sent this iteration
    # on a CUDA server: recorded after the last contribution was added, on its request's stream
    added: torch.cuda.Event | None = None

    def clear(self) -> None:
        """Forgets this iteration's contributions; the buffers stay."""
        self.count, self.accumulator, self.waiting = 0, None, []
        self.senders, self.copies = set(), []
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
        # --trace: (bucket, first arrival, last arrival, answered) ms while a round is traced
        self.spans: list[tuple[int, float, float, float]] | None = None
        # the bucket timeline's servers' lane: each piece's last few of them, every round
        self.recent: dict[int, deque] = defaultdict(lambda: deque(maxlen=TIMELINE_ITERATIONS))

    def count(self, direction: str, nbytes: int) -> None:
        with self.lock:
            self.bytes[direction] += nbytes

    def record(self, span: tuple | None = None, **samples_ms: float) -> None:
        with self.lock:
            for name, value in samples_ms.items():
                self.samples[name].append(value)
            if span is not None:
                self.recent[span[0]].append(span[1:])
                if self.spans is not None:
                    self.spans.append(span)

    def take(self) -> dict:
        """The samples and byte counts since the last call, then clears them."""
        with self.lock:
            out = {"samples": dict(self.samples), "bytes": dict(self.bytes),
                   "recent": {"clock": clock_id(), "spans": {key: list(spans) for key, spans
                                                             in self.recent.items()}}}
            self.samples, self.bytes = defaultdict(list), {"recv": 0, "sent": 0}
            self.recent.clear()
        return out
