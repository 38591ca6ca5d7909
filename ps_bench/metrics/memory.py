"""Memory of this process: its peak resident set size, and CUDA memory where a GPU is used; the
model states a trainer holds, counted from its tensors (``held_bytes``), the activations a
forward saves for backward (``SavedActivations``) and the communication buffers its strategy
keeps from one iteration to the next (``buffers_bytes``: a parameter server's pieces' copies).

On a GPU the peak is ``torch.cuda.max_memory_allocated`` over the timed rounds. On the CPU torch
counts no allocation, so the peak given is the model states plus the activations one
micro-batch's forward saved plus the kept buffers (``peak_from`` says which): the transient
buffers (DDP's buckets, gathered layers, the optimizer's temporaries) are not in it, and torch's
own few hundred MB of resident memory are not either."""

from __future__ import annotations

import contextlib
import resource

import torch

KIB = 1024
NO_COUNT = contextlib.nullcontext()  # an iteration that counts nothing (reused: no allocation)


def peak_memory(device: torch.device | None = None) -> dict[str, int | None]:
    """``peak_rss_bytes`` since the process started (Linux reports ru_maxrss in KiB) and
    ``peak_cuda_bytes`` (torch.cuda.max_memory_allocated on ``device``; None without one)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    cuda = None
    if device is not None and device.type == "cuda":
        cuda = int(torch.cuda.max_memory_allocated(device))
    return {"peak_rss_bytes": int(rss), "peak_cuda_bytes": cuda}


def trainer_memory(device: torch.device, held: dict[str, int] | None, activations: int,
                   buffers: int) -> dict:
    """A trainer's peaks, with the model states it holds, the activations it saved and the
    buffers its strategy kept, where it has counted them (see the module)."""
    peaks = peak_memory(device)
    if held is None:
        return peaks
    on_gpu = peaks["peak_cuda_bytes"] is not None
    return {**peaks, "model_states": held, "activations_bytes": activations,
            "buffers_bytes": buffers,
            "peak_bytes": (peaks["peak_cuda_bytes"] if on_gpu
                           else held["total_bytes"] + activations + buffers),
            "peak_from": ("torch.cuda.max_memory_allocated over the round" if on_gpu else
                          "model states + activations saved for backward + kept buffers")}


def combine_peaks(peaks: list[dict]) -> dict:
    """The largest over the processes of one role of each peak and of the activations, and the
    model states of the process that holds the most (None where none of them had one)."""
    out: dict = {}
    for key in ("peak_rss_bytes", "peak_cuda_bytes", "activations_bytes", "buffers_bytes",
                "peak_bytes"):
        values = [p[key] for p in peaks if p.get(key) is not None]
        if values or key in ("peak_rss_bytes", "peak_cuda_bytes"):
            out[key] = max(values) if values else None
    states = [p["model_states"] for p in peaks if p.get("model_states")]
    if states:  # the process that holds the most, whole
        out["model_states"] = max(states, key=lambda state: state["total_bytes"])
    froms = sorted({p["peak_from"] for p in peaks if p.get("peak_from")})
    if froms:
        out["peak_from"] = ", ".join(froms)
    return out


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this process holds: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storages(tensor: torch.Tensor) -> list:
    """The storages behind a tensor: a sparse one's indices and values; a DTensor's shard's."""
    tensor = local(tensor)
    if tensor.is_sparse:
        return [tensor._indices().untyped_storage(), tensor._values().untyped_storage()]
    return [tensor.untyped_storage()] if tensor.layout == torch.strided else []


def held_bytes(groups: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes of each group's tensors (``parameters``, ``gradients``, ``optimizer``), each storage
    counted once, in the first group that holds it (views of one buffer, and an optimizer state
    that is a parameter, counted once); ``total_bytes`` their sum."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensors in groups.items():
        total = 0
        for storage in [storage for tensor in tensors for storage in storages(tensor)]:
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        out[f"{name}_bytes"] = total
    out["total_bytes"] = sum(out.values())
    return out


def state_tensors(state) -> list[torch.Tensor]:
    """Every tensor in an optimizer's ``state`` (parameter -> name -> value)."""
    return [value for values in state.values() for value in values.values()
            if isinstance(value, torch.Tensor)]


class SavedActivations:
    """Around one forward: the bytes of the tensors it saves for backward, each storage once,
    the parameters and their views (a weight's transpose; sharded, gathered or whole) left
    out; of a view of what autograd does not track (the batch, sliced from the data a trainer
    holds anyway), its own bytes, as the batch a data loader hands over holds them. Works on
    the meta device too (storages told apart by their identity, not address)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}
        self.views: dict[tuple, int] = {}  # (storage, offset, shape) -> bytes
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, torch.nn.Parameter):
            return tensor
        if tensor is not base and not base.requires_grad and tensor.layout == torch.strided:
            key = (tensor.untyped_storage()._cdata, tensor.storage_offset(), tuple(tensor.shape))
            self.views[key] = tensor.numel() * tensor.element_size()
        else:
            for storage in storages(tensor):
                self.storages[storage._cdata] = storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values()) + sum(self.views.values())

    def __enter__(self) -> "SavedActivations":
        self.hooks.__enter__()
        _counting.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _counting.remove(self)
        self.hooks.__exit__(*exc)


_counting: list[SavedActivations] = []  # the counts open in this process


def keep_saved(tensor: torch.Tensor) -> None:
    """``tensor`` is kept for backward by other means than autograd's saved tensors (a
    recomputed unit's input, ``strategies.recompute``): the open counts take it as saved."""
    for count in _counting:
        count.pack(tensor)
