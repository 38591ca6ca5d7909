"""The tensors a hook keeps from one iteration to the next, and what they hold between
iterations (a trainer's ``buffers_bytes``, ``metrics.memory``)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

import torch


def storages_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage once."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class Scratch:
    """CPU tensors a hook keeps from one iteration to the next, one a use (a piece's copy, a
    bucket's rows): a new one of megabytes is new pages, zeroed by the kernel before the copy
    writes them (docs/strategies.md). A key's next use comes after DDP has taken its last answer.
    On a GPU nothing is kept: the caching allocator reuses the blocks, and the memory is free
    through the next forward.

    ``clock`` is the trainer's iteration: what an iteration did not use is let go at the first
    use of the next: DDP rebuilds its buckets after the first iteration, and the first
    layout's pieces and rows would otherwise stay beside the new ones for the whole run."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.kept: dict[Any, torch.Tensor] = {}
        self.clock = clock
        self.turn: int | None = None  # the iteration ``used`` is of
        self.used: set = set()
        self.lock = threading.Lock()  # hooks use it from DDP's thread and from futures' callbacks

    def note_use(self, key: Any) -> None:
        """Marks ``key`` used in this iteration; the first use in a new iteration lets go of what
        the last one did not use."""
        with self.lock:
            turn = self.clock()
            if turn != self.turn:
                if self.turn is not None:
                    for stale in self.kept.keys() - self.used:
                        del self.kept[stale]
                self.turn, self.used = turn, set()
            self.used.add(key)

    def empty(self, key: Any, size: int, like: torch.Tensor, dtype: Any = None) -> torch.Tensor:
        """``size`` elements on ``like``'s device, of ``dtype`` (or ``like``'s), as ``key``'s last
        use left them (new after another size or dtype, as DDP's rebuilt buckets; on a GPU)."""
        dtype = dtype or like.dtype
        if like.device.type != "cpu":
            return torch.empty(size, dtype=dtype, device=like.device)
        self.note_use(key)
        kept = self.kept.get(key)
        if kept is None or kept.numel() != size or kept.dtype != dtype:
            kept = self.kept[key] = torch.empty(size, dtype=dtype)
        return kept

    def nbytes(self) -> int:
        """Bytes kept now (a trainer's ``buffers_bytes``): each kept tensor has a storage of its
        own."""
        return storages_nbytes(self.kept.values())

    def copy(self, key: Any, source: torch.Tensor, dtype: Any = None) -> torch.Tensor:
        """A copy of ``source`` (contiguous, its shape; cast to ``dtype`` where given, in the one
        pass) in the tensor kept for ``key``."""
        return self.empty(key, source.numel(), source, dtype).view(source.shape).copy_(source)
