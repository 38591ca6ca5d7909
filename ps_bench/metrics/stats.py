"""Summary statistics: one row type that renders both as a table row and as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

STATISTICS = ("count", "mean", "std", "min", "p50", "p90", "p99", "max")


@dataclass(frozen=True)
class SummaryRow:
    role: str
    metric: str
    unit: str
    count: int
    mean: float
    std: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float
    rank: int | None = None  # None: every rank of the role pooled

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.rank is None:
            del out["rank"]
        return out

    def table_row(self) -> list:
        who = self.role if self.rank is None else f"{self.role} {self.rank}"
        return [who, self.metric, self.unit, *(getattr(self, s) for s in STATISTICS)]


TABLE_HEADERS = ["role", "metric", "unit", *STATISTICS]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """count/mean/std/min/percentiles/max; one sample has std 0 (sample std otherwise)."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("no samples to summarize")
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return {
        "count": int(data.size),
        "mean": float(data.mean()),
        "std": float(data.std(ddof=1)) if data.size > 1 else 0.0,
        "min": float(data.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(data.max()),
    }


def summary_rows(role: str, per_rank: dict[int, dict[str, list[float]]], metrics: Iterable[str],
                 unit: str = "ms", split_ranks: bool = False) -> list[SummaryRow]:
    """Rows for each metric with every rank pooled, then (optionally) one per rank."""
    rows = []
    for metric in metrics:
        pooled = [v for samples in per_rank.values() for v in samples.get(metric, [])]
        if pooled:
            rows.append(SummaryRow(role, metric, unit, **summarize(pooled)))
    if split_ranks:
        for rank, samples in sorted(per_rank.items()):
            for metric in metrics:
                if samples.get(metric):
                    rows.append(SummaryRow(role, metric, unit, **summarize(samples[metric]),
                                           rank=rank))
    return rows


SMOOTHING = 10  # iterations a --target-loss run's training loss is averaged over


def smoothed_loss(curve: list[tuple]) -> float | None:
    """The mean of the last SMOOTHING losses of a curve of (iterations, loss), the value held
    against the target; None before there are that many."""
    if len(curve) < SMOOTHING:
        return None
    return sum(point[1] for point in curve[-SMOOTHING:]) / SMOOTHING
