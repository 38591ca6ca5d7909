"""``bench.py report DIR|FILE...``: one row per point, speedups against a baseline, CSV, plot.

``rows``: each results file as a ``Row`` (its options, statistics and workload), read from files
and folders, and the options that vary; ``figures``: ``--plot`` (batch times against the option
that varies, or the loss against seconds of training); ``command``: the tables (speedups, and
``--scaling`` against the analytic bounds), CSV, and the subcommand (DESCRIPTION, EPILOG,
add_arguments, main). Every name of these is here too, as it was when report was one module.
"""

from __future__ import annotations

from ps_bench.report.command import (DESCRIPTION, EPILOG, add_arguments, convergence_columns,
                                     find_baseline, fixed, main, run_report, scaling_table,
                                     staleness_column, table, to_target, write_csv)
from ps_bench.report.figures import plot, plot_convergence
from ps_bench.report.rows import (HIDDEN, WORKLOAD, Row, is_number, load_rows,
                                  varying_options)

__all__ = [
    "HIDDEN", "WORKLOAD", "Row", "is_number", "load_rows", "varying_options",  # the points
    "plot", "plot_convergence",  # the figures
    "DESCRIPTION", "EPILOG", "add_arguments", "convergence_columns", "find_baseline", "fixed",
    "main", "run_report", "scaling_table", "staleness_column", "table", "to_target", "write_csv",
]
