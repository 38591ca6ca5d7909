"""``bench.py compare BASE NEW``: did it get faster? Each metric of each point both sides ran, with
the relative change, its 95 % confidence interval and a verdict; ``--fail-over PCT`` makes it a CI
gate.

Where the noise is decides the interval: with at least ``MIN_RUNS`` runs a side it comes from the
spread between runs (Welch's t on the log of each run's value); with fewer, from the iterations of
the runs (a bootstrap), and the output says that it is optimistic.

``intervals``: the t quantile, the ``Interval`` from the runs or from within them, the verdict;
``sides``: reading each side's runs and matching the points of base and new; ``comparison``: the
compared metrics, one ``Row`` per point and metric, the ``Comparison`` and its gate; ``command``:
the table, CSV, JSON and plot, and the subcommand (DESCRIPTION, EPILOG, add_arguments, check,
main). Every name of these is here too, as it was when compare was one module.
"""

from __future__ import annotations

from ps_bench.compare.command import (DESCRIPTION, EPILOG, add_arguments, check, main, notes, plot,
                                      pyplot, render, write_csv)
from ps_bench.compare.comparison import (COMPARISON_SCHEMA, DEFAULT_THRESHOLD_PCT, HEADERS, METRICS,
                                         Comparison, Metric, Row, compare, compare_point,
                                         compare_sides, geometric_mean, mean_of, per_second,
                                         percentile_of, reached, trainer_samples, trainer_stat)
from ps_bench.compare.intervals import (CONFIDENCE, MIN_RUNS, OPTIMISTIC, RESAMPLES, TRAPEZOID,
                                        Interval, few, runs_interval, t_quantile, verdict,
                                        within_run_interval)
from ps_bench.compare.sides import (ENTRIES, NOT_COMPARED, Pairing, Run, Side, compared_config,
                                    differing_fields, group_points, ignored_fields, label_points,
                                    load_side, pair_points, point_key, point_label, shown, varying)

__all__ = [
    # the interval and the verdict
    "CONFIDENCE", "MIN_RUNS", "OPTIMISTIC", "RESAMPLES", "TRAPEZOID", "Interval", "few",
    "runs_interval", "t_quantile", "verdict", "within_run_interval",
    # the sides and matching
    "ENTRIES", "NOT_COMPARED", "Pairing", "Run", "Side", "compared_config", "differing_fields",
    "group_points", "ignored_fields", "label_points", "load_side", "pair_points", "point_key",
    "point_label", "shown", "varying",
    # one comparison
    "COMPARISON_SCHEMA", "DEFAULT_THRESHOLD_PCT", "HEADERS", "METRICS", "Comparison", "Metric",
    "Row", "compare", "compare_point", "compare_sides", "geometric_mean", "mean_of", "per_second",
    "percentile_of", "reached", "trainer_samples", "trainer_stat",
    # the outputs and the subcommand
    "DESCRIPTION", "EPILOG", "add_arguments", "check", "main", "notes", "plot", "pyplot", "render",
    "write_csv",
]
