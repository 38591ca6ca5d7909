"""The interval and the verdict of ``bench.py compare``: Student's t quantile, the relative change
with its confidence interval (``Interval``), from the runs or from the iterations within them, and
the verdict it gives.

Where the noise is decides the interval. Iterations of one run share one machine state (the same
placement of processes, the same neighbours, the same page cache), so run-to-run variation is
larger than a resampling of one run's iterations shows. With at least ``MIN_RUNS`` runs a side,
``runs_interval`` is Welch's t-interval of the difference of the mean logarithms of each run's
value, that is of the ratio of the runs' geometric means. With fewer, ``within_run_interval`` is
a bootstrap of the pooled per-iteration samples, and says that it is optimistic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

CONFIDENCE = 0.95
MIN_RUNS = 3  # runs a side for an interval from the runs; fewer: from the iterations, optimistic
RESAMPLES = 2000
TRAPEZOID = getattr(np, "trapezoid", None) or np.trapz  # numpy 2 renamed it; numpy 1 has trapz only
OPTIMISTIC = "from iterations within runs: optimistic (they share one machine state)"


# ---------------------------------------------------------------------------- the interval


def t_quantile(probability: float, df: float) -> float:
    """Student's t quantile for ``probability`` above 0.5 and ``df`` degrees of freedom (fractional
    too, as Welch's are): bisection on the distribution function, integrated from the density."""
    if df > 1e6:
        return NormalDist().inv_cdf(probability)
    log_scale = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def mass(x: float) -> float:  # P(0 < T < x)
        grid = np.linspace(0.0, x, 4001)
        return float(TRAPEZOID(np.exp(log_scale - (df + 1) / 2 * np.log1p(grid * grid / df)), grid))

    target = probability - 0.5
    low, high = 0.0, 1.0
    while mass(high) < target:
        low, high = high, high * 2.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if mass(middle) < target else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class Interval:
    """The relative change new/base - 1 and its confidence interval, as fractions (0.1 is +10 %)."""

    change: float | None
    low: float | None
    high: float | None
    method: str  # "runs", "within-run", or "" where there is none
    base_count: int
    new_count: int
    note: str = ""

    @property
    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    @property
    def width(self) -> float:
        return math.inf if self.low is None or self.high is None else self.high - self.low


def few(count_base: int, count_new: int, what: str) -> str:
    return f"only {count_base} and {count_new} {what}: the interval is wide"


def runs_interval(base: Sequence[float], new: Sequence[float],
                  confidence: float = CONFIDENCE) -> Interval:
    """Welch's t-interval of mean(log new) - mean(log base): the change of the geometric mean of
    one value per run, and its interval, from the spread between runs."""
    base_values, new_values = np.asarray(base, dtype=float), np.asarray(new, dtype=float)
    nb, nn = len(base_values), len(new_values)
    note = few(nb, nn, "runs") if min(nb, nn) < MIN_RUNS else ""
    if nb == 0 or nn == 0:
        return Interval(None, None, None, "", nb, nn, "a side has no value")
    if min(base_values.min(), new_values.min()) <= 0:
        if not base_values.any() and not new_values.any():
            return Interval(0.0, 0.0, 0.0, "runs", nb, nn, note)
        return Interval(None, None, None, "", nb, nn, "values at or below 0: no relative change")
    log_base, log_new = np.log(base_values), np.log(new_values)
    difference = log_new.mean() - log_base.mean()
    if min(nb, nn) < 2:
        return Interval(math.expm1(difference), -math.inf, math.inf, "runs", nb, nn,
                        f"one run on a side: no spread between runs to measure; {note}")
    share_base, share_new = log_base.var(ddof=1) / nb, log_new.var(ddof=1) / nn
    spread = math.sqrt(share_base + share_new)
    if spread == 0.0:  # every run measured the same (bytes, usually): the change is exact
        change = math.expm1(difference)
        return Interval(change, change, change, "runs", nb, nn, note)
    df = spread ** 4 / (share_base ** 2 / (nb - 1) + share_new ** 2 / (nn - 1))
    half = t_quantile(0.5 + confidence / 2, df) * spread
    return Interval(math.expm1(difference), math.expm1(difference - half),
                    math.expm1(difference + half), "runs", nb, nn, note)


def within_run_interval(base_samples: np.ndarray, new_samples: np.ndarray,
                        statistic: Callable[[np.ndarray], np.ndarray], change: float,
                        confidence: float = CONFIDENCE, seed: int = 0) -> Interval:
    """A percentile bootstrap of statistic(new)/statistic(base) over the pooled per-iteration
    samples of each side, placed around ``change`` (the change of the runs' own values). It sees
    only the noise between iterations of the runs it has, so it is optimistic."""
    nb, nn = len(base_samples), len(new_samples)
    note = OPTIMISTIC
    if nb < 2 or nn < 2:
        return Interval(change, -math.inf, math.inf, "within-run", nb, nn,
                        f"fewer than 2 samples a side; {note}")
    if nb < 20 or nn < 20:
        note = f"{few(nb, nn, 'samples')}; {note}"
    observed_base, observed_new = (statistic(base_samples[None, :])[0],
                                   statistic(new_samples[None, :])[0])
    if observed_base <= 0 or observed_new <= 0:
        exact = observed_base == observed_new == 0
        return Interval(0.0 if exact else change, 0.0 if exact else None,
                        0.0 if exact else None, "within-run" if exact else "", nb, nn,
                        "" if exact else "statistic at or below 0")
    rng = np.random.default_rng(seed)
    resampled_base = statistic(base_samples[rng.integers(0, nb, size=(RESAMPLES, nb))])
    resampled_new = statistic(new_samples[rng.integers(0, nn, size=(RESAMPLES, nn))])
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = (resampled_new / resampled_base) / (observed_new / observed_base)
    spread = spread[np.isfinite(spread)]
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(spread, [tail, 100 - tail])
    ratio = 1.0 + change
    return Interval(change, float(ratio * low - 1), float(ratio * high - 1), "within-run", nb, nn,
                    note)


# ---------------------------------------------------------------------------- the verdict


def verdict(interval: Interval, threshold: float, higher_is_better: bool,
            words: tuple[str, str] = ("faster", "slower")) -> tuple[str, bool]:
    """``words[0]`` (better) or ``words[1]`` (worse) when the interval excludes 0 and the change is
    at least ``threshold`` (a fraction); else no significant change. Returns the verdict and
    whether it is significant."""
    if interval.change is None:
        return "-", False
    if not interval.excludes_zero or abs(interval.change) < threshold:
        return "no significant change", False
    better = (interval.change > 0) == higher_is_better
    return words[0] if better else words[1], True
