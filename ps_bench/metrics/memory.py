"""Peak memory of this process: resident set size, and CUDA memory where a GPU is used."""

from __future__ import annotations

import resource

import torch

KIB = 1024


def peak_memory(device: torch.device | None = None) -> dict[str, int | None]:
    """``peak_rss_bytes`` since the process started (Linux reports ru_maxrss in KiB) and
    ``peak_cuda_bytes`` (torch.cuda.max_memory_allocated on ``device``; None without one)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    cuda = None
    if device is not None and device.type == "cuda":
        cuda = int(torch.cuda.max_memory_allocated(device))
    return {"peak_rss_bytes": int(rss), "peak_cuda_bytes": cuda}


def combine_peaks(peaks: list[dict[str, int | None]]) -> dict[str, int | None]:
    """The largest peak over the processes of one role (None where none of them had a GPU)."""
    out: dict[str, int | None] = {}
    for key in ("peak_rss_bytes", "peak_cuda_bytes"):
        values = [p[key] for p in peaks if p.get(key) is not None]
        out[key] = max(values) if values else None
    return out
