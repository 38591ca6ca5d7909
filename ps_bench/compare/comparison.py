"""One comparison of ``bench.py compare``: the compared metrics (``METRICS``), a ``Row`` per metric
of each matched point (its values, interval and verdict, as a table row and as a JSON/CSV record),
and the ``Comparison`` of two sides with its --fail-over gate (``compare``, ``compare_sides``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ps_bench.compare.intervals import (CONFIDENCE, MIN_RUNS, Interval, runs_interval, verdict,
                                        within_run_interval)
from ps_bench.compare.sides import (Pairing, Run, Side, ignored_fields, load_side, pair_points,
                                    point_label, varying)
from ps_bench.options import plural
from ps_bench.results.files import iso_now

COMPARISON_SCHEMA = "ps_bench.comparison/1"
DEFAULT_THRESHOLD_PCT = 5.0


# ---------------------------------------------------------------------------- the metrics


def trainer_stat(results: dict, metric: str, statistic: str) -> float | None:
    for row in results.get("summary", []):
        if row.get("role") == "trainer" and row.get("metric") == metric:
            return row.get(statistic)
    return None


def trainer_samples(results: dict, metric: str) -> list[float]:
    return [value for entry in results.get("samples", []) if entry.get("role") == "trainer"
            for value in entry.get("metrics", {}).get(metric, [])]


def trainer_peak(results: dict) -> float | None:
    """The most memory a trainer held, MiB, as its run's Memory table gives it."""
    peak = ((results.get("memory") or {}).get("trainer") or {}).get("peak_bytes")
    return None if peak is None else peak / 2 ** 20


def reached(results: dict, key: str) -> float | None:
    convergence = results.get("convergence") or {}
    return convergence.get(key) if convergence.get("reached") else None


def percentile_of(q: float) -> Callable[[np.ndarray], np.ndarray]:
    return lambda rows: np.percentile(rows, q, axis=1)


def per_second(rows: np.ndarray) -> np.ndarray:
    return 1.0 / rows.mean(axis=1)


def mean_of(rows: np.ndarray) -> np.ndarray:
    return rows.mean(axis=1)


@dataclass(frozen=True)
class Metric:
    """One compared metric: its value in a run, and where the iterations of a run are, the
    per-iteration samples and the statistic of them whose change tracks the value's."""

    name: str
    unit: str
    decimals: int
    higher_is_better: bool
    value: Callable[[dict], float | None]
    samples: str | None = None  # the trainers' per-iteration metric in the results' samples
    statistic: Callable[[np.ndarray], np.ndarray] | None = None
    words: tuple[str, str] = ("faster", "slower")


METRICS = (
    Metric("batch p50", "ms", 3, False, lambda r: trainer_stat(r, "batch", "p50"), "batch",
           percentile_of(50)),
    Metric("batch p90", "ms", 3, False, lambda r: trainer_stat(r, "batch", "p90"), "batch",
           percentile_of(90)),
    Metric("comm p50", "ms", 3, False, lambda r: trainer_stat(r, "comm", "p50"), "comm",
           percentile_of(50)),
    # samples/s has no per-iteration samples: the inverse of the mean batch time changes as it does
    Metric("samples/s", "1/s", 0, True, lambda r: (r.get("throughput") or {}).get("samples_per_s"),
           "batch", per_second),
    Metric("bytes/iter", "B", 0, False,
           lambda r: (r.get("bytes") or {}).get("trainer_sent_per_iter"), "bytes_sent", mean_of,
           ("fewer bytes", "more bytes")),
    # the most memory a trainer held (the run's Memory table): its runs' spread gives the interval
    Metric("trainer MiB", "", 1, False, trainer_peak, None, None,
           ("less memory", "more memory")),
    Metric("seconds to target", "s", 3, False, lambda r: reached(r, "seconds")),
    Metric("iterations to target", "", 0, False, lambda r: reached(r, "iterations")),
    # under failures (the results' recovery block): the samples a second of the whole wall time
    Metric("goodput samples/s", "1/s", 0, True,
           lambda r: ((r.get("recovery") or {}).get("goodput") or {}).get("samples_per_s"),
           words=("more goodput", "less goodput")),
)


# ------------------------------------------------------------------------ one comparison, two views


@dataclass
class Row:
    """One metric of one matched point; renders as a table row and as a JSON/CSV record."""

    point: str
    metric: Metric
    base: float | None
    new: float | None
    interval: Interval
    verdict: str
    significant: bool

    def record(self) -> dict:
        def pct(value: float | None) -> float | None:
            return None if value is None or not math.isfinite(value) else round(100 * value, 4)

        return {"point": self.point, "metric": self.metric.name, "unit": self.metric.unit,
                "higher_is_better": self.metric.higher_is_better, "base": self.base,
                "new": self.new, "change_pct": pct(self.interval.change),
                "ci_low_pct": pct(self.interval.low), "ci_high_pct": pct(self.interval.high),
                "verdict": self.verdict, "significant": self.significant,
                "interval_from": self.interval.method or None,
                "base_count": self.interval.base_count, "new_count": self.interval.new_count,
                "note": self.interval.note or None}

    def table_row(self) -> list:
        def value(number: float | None) -> str | None:
            return None if number is None else f"{number:.{self.metric.decimals}f}"

        def pct(number: float | None) -> str:
            return "inf" if number is not None and math.isinf(number) else f"{100 * number:+.1f}%"

        interval = self.interval
        spread = None if interval.low is None else f"[{pct(interval.low)}, {pct(interval.high)}]"
        counts = (f"{interval.base_count} vs {interval.new_count} runs"
                  if interval.method == "runs" else
                  f"{interval.base_count} vs {interval.new_count} iterations (within-run)"
                  if interval.method == "within-run" else None)
        return [self.point,
                self.metric.name + (f" {self.metric.unit}"
                                    if self.metric.unit in ("ms", "B") else ""),
                value(self.base), value(self.new),
                None if interval.change is None else pct(interval.change), spread, self.verdict,
                counts]


HEADERS = ["point", "metric", "base", "new", "change", "95% CI", "verdict", "interval from"]


def geometric_mean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if min(values) > 0 else float(np.mean(values))


def compare_point(pairing: Pairing, threshold: float) -> list[Row]:
    rows = []
    from_runs = min(len(pairing.base), len(pairing.new)) >= MIN_RUNS
    for metric in METRICS:
        base_values = [v for v in (metric.value(run.results) for run in pairing.base)
                       if v is not None]
        new_values = [v for v in (metric.value(run.results) for run in pairing.new)
                      if v is not None]
        if not base_values or not new_values:
            continue  # a metric compares only where both sides have it
        base, new = geometric_mean(base_values), geometric_mean(new_values)
        if from_runs and min(len(base_values), len(new_values)) >= MIN_RUNS:
            interval = runs_interval(base_values, new_values)
        elif metric.samples is None:
            change = new / base - 1 if base > 0 else None
            interval = Interval(change, None, None, "", len(base_values), len(new_values),
                                f"one value a run: an interval needs {MIN_RUNS} runs a side")
        else:
            change = new / base - 1 if base > 0 else (0.0 if new == base else None)
            base_samples = np.array([v for run in pairing.base
                                     for v in trainer_samples(run.results, metric.samples)])
            new_samples = np.array([v for run in pairing.new
                                    for v in trainer_samples(run.results, metric.samples)])
            interval = (within_run_interval(base_samples, new_samples, metric.statistic, change)
                        if change is not None else Interval(None, None, None, "", len(base_samples),
                                                            len(new_samples)))
        said, significant = verdict(interval, threshold, metric.higher_is_better, metric.words)
        rows.append(Row(pairing.label, metric, base, new, interval, said, significant))
    return rows


@dataclass
class Comparison:
    base: Side
    new: Side
    ignored: list[str]
    threshold: float
    pairings: list[Pairing]
    rows: list[Row]
    unmatched_base: list[list[Run]]
    unmatched_new: list[list[Run]]
    fail_over: float | None

    @property
    def forced(self) -> bool:
        """One point a side, paired though options other than --match's differ."""
        return len(self.pairings) == 1 and any(name not in self.ignored
                                               for name in self.pairings[0].differs)

    @property
    def over_limit(self) -> list[Row]:
        """Rows significantly slower by more than --fail-over."""
        if self.fail_over is None:
            return []
        return [row for row in self.rows if row.significant and row.verdict == "slower"
                and abs(row.interval.change) * 100 > self.fail_over]

    @property
    def exit_status(self) -> int:
        return 1 if self.over_limit else 0

    def unmatched_labels(self, groups: list[list[Run]]) -> list[str]:
        columns = varying([runs for runs in groups] + [p.base + p.new for p in self.pairings])
        return [f"{point_label(runs, columns)} ({plural(len(runs), 'run')})" for runs in groups]

    def record(self, argv: list[str]) -> dict:
        def side(which: Side) -> dict:
            return {"path": which.path, "kind": which.kind, "runs": len(which.runs),
                    "failed_runs": len(which.failed), "skipped_files": which.skipped,
                    "torch": sorted({str((run.results.get("env") or {}).get("torch"))
                                     for run in which.runs})}

        return {
            "schema": COMPARISON_SCHEMA, "created": iso_now(), "argv": argv,
            "confidence": CONFIDENCE, "threshold_pct": round(100 * self.threshold, 6),
            "min_runs": MIN_RUNS,
            "match_ignores": self.ignored, "base": side(self.base), "new": side(self.new),
            "points": [{"label": p.label, "hash": p.key, "base_runs": len(p.base),
                        "new_runs": len(p.new),
                        "differs": {name: {"base": b, "new": n}
                                    for name, (b, n) in p.differs.items()},
                        "interval_from": ("runs" if min(len(p.base), len(p.new)) >= MIN_RUNS
                                          else "within-run")}
                       for p in self.pairings],
            "metrics": [row.record() for row in self.rows],
            "unmatched": {"base": self.unmatched_labels(self.unmatched_base),
                          "new": self.unmatched_labels(self.unmatched_new)},
            "fail_over_pct": self.fail_over,
            "over_limit": [row.record() for row in self.over_limit],
            "exit_status": self.exit_status,
        }


def compare(base_source: str, new_source: str, match: str | None = None,
            threshold_pct: float = DEFAULT_THRESHOLD_PCT,
            fail_over: float | None = None) -> Comparison:
    """Reads both sides, matches their points and compares every metric both have."""
    ignored = ignored_fields(match)
    return compare_sides(load_side(base_source, "base"), load_side(new_source, "new"), ignored,
                         threshold_pct, fail_over)


def compare_sides(base: Side, new: Side, ignored: Sequence[str] = (),
                  threshold_pct: float = DEFAULT_THRESHOLD_PCT,
                  fail_over: float | None = None) -> Comparison:
    pairings, unmatched_base, unmatched_new = pair_points(base, new, ignored)
    threshold = threshold_pct / 100
    rows = [row for pairing in pairings for row in compare_point(pairing, threshold)]
    return Comparison(base, new, list(ignored), threshold, pairings, rows, unmatched_base,
                      unmatched_new, fail_over)
