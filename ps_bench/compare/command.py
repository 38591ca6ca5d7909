"""The ``bench.py compare`` subcommand: its DESCRIPTION, EPILOG and arguments, ``check`` and
``main``, and the outputs of a comparison: the table (plain or markdown) with its notes, CSV,
JSON and the plot of every run's batch times.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

from tabulate import tabulate

from ps_bench.compare.comparison import (COMPARISON_SCHEMA, DEFAULT_THRESHOLD_PCT, HEADERS,
                                         Comparison, Row, compare, trainer_samples)
from ps_bench.compare.intervals import CONFIDENCE, MIN_RUNS, OPTIMISTIC
from ps_bench.compare.sides import ENTRIES, ignored_fields
from ps_bench.config import ConfigError
from ps_bench.options import plural, typed
from ps_bench.places import check_apart, check_output_file, write_output
from ps_bench.plots import check_plot_file, pyplot
from ps_bench.results.load import files_read

DESCRIPTION = (
    "Did it get faster? Compare two sides, each a results file, a sweep folder or a folder of "
    "results files: points are matched by their configuration, and for each matched point and "
    "metric (batch p50 and p90, comm p50, samples/s, bytes per iteration, time and iterations to a "
    "target loss) it prints base, new, the relative change, its 95 % confidence interval and a "
    "verdict: faster, slower or no significant change (the interval holds 0, or the change is "
    "under --threshold). With 3 or more runs of a point a side (a sweep's \"repeat\": 3) the "
    "interval comes from the runs; with fewer, from the iterations of the runs, which is "
    "optimistic.")
EPILOG = """\
examples:
  python bench.py sweep configs/sweeps/compare.json --out results/before  # 3 runs, before
  python bench.py sweep configs/sweeps/compare.json --out results/after   # and after it
  python bench.py compare results/before results/after --fail-over 10     # 1: >10 % slower
  python bench.py compare ps.json allreduce.json --format markdown --json comparison.json

exit status: 0, 1 when --fail-over is given and a matched point is significantly slower by more
than it, 2 for bad input (a side that is not there or not results, two different models).
"""


# ---------------------------------------------------------------------------- output


def notes(comparison: Comparison) -> list[str]:
    lines = []
    if any(row.interval.method == "within-run" for row in comparison.rows):
        lines.append(f"within-run: fewer than {MIN_RUNS} runs a side, so the interval comes from "
                     f"the iterations of the runs, which share one machine state: it is optimistic "
                     f"(run {MIN_RUNS} or more a side, e.g. a sweep with \"repeat\": {MIN_RUNS})")
    if any(row.interval.method == "runs" for row in comparison.rows):
        lines.append(f"runs: {int(CONFIDENCE * 100)} % interval from the spread between runs "
                     f"(Welch's t on the log of each run's value); base, new: the runs' geometric "
                     f"means")
    lines.append(f"verdict: faster or slower where the interval excludes 0 and the change is at "
                 f"least {100 * comparison.threshold:g} % (--threshold)")
    for row in comparison.rows:
        # said once, above
        said = row.interval.note.replace(f"; {OPTIMISTIC}", "").replace(OPTIMISTIC, "")
        if said:
            lines.append(f"{row.point}, {row.metric.name}: {said}")
    for role, groups in (("base", comparison.unmatched_base), ("new", comparison.unmatched_new)):
        if groups:
            lines.append(f"unmatched, only in {role}: "
                         f"{'; '.join(comparison.unmatched_labels(groups))}")
    if comparison.fail_over is not None:
        over = comparison.over_limit
        lines.append(f"--fail-over {comparison.fail_over:g}: " + (
            "FAILED, significantly slower by more than that: " + "; ".join(
                f"{'' if len(comparison.pairings) == 1 else row.point + ' '}{row.metric.name} "
                f"{100 * row.interval.change:+.1f}%" for row in over)
            if over else "passed"))
    return lines


def render(comparison: Comparison, markdown: bool = False) -> str:
    body = [row.table_row() for row in comparison.rows]
    single = len({row.point for row in comparison.rows}) == 1
    headers = HEADERS[1:] if single else HEADERS
    body = [line[1:] for line in body] if single else body
    lines = [comparison.base.describe(), comparison.new.describe()]
    ignoring = [n for n in comparison.ignored if n not in ENTRIES.values()]
    first = comparison.pairings[0]
    if comparison.forced:
        matched = "one point a side, compared though their configurations differ: " + "; ".join(
            f"{name}: {before} -> {after}" for name, (before, after) in first.differs.items()
            if name not in ENTRIES.values())
    else:
        matched = f"{plural(len(comparison.pairings), 'point')} matched by configuration"
        matched += f", ignoring {', '.join(ignoring)} (--match)" if ignoring else ""
        matched += f": {first.label}" if single else ""
    lines.append(matched)
    table = tabulate(body, headers=headers, missingval="-", disable_numparse=True,
                     tablefmt="github" if markdown else "simple")
    extra = notes(comparison)
    if markdown:
        return "\n".join([*(f"- {line}" for line in lines), "", table, "",
                          *(f"- {line}" for line in extra)])
    return "\n".join([*lines, "", table, "", *extra])


def write_csv(path: str, rows: list[Row]) -> None:
    records = [row.record() for row in rows]
    columns = list(records[0]) if records else list(Row.__dataclass_fields__)
    with open(path, "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=columns)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in record.items()}
                         for record in records)


def plot(path: str, comparison: Comparison) -> None:
    """Per matched point, every run's per-iteration batch times as a box (p10-p90 whiskers), base's
    runs then new's side by side, with the point's batch p50 change and verdict as its title."""
    plt = pyplot("compare")
    pairings = comparison.pairings
    columns = min(3, len(pairings))
    lines = math.ceil(len(pairings) / columns)
    figure, grid = plt.subplots(lines, columns,
                                figsize=(max(6.5, 4.6 * columns), 3.6 * lines + 0.6), squeeze=False)
    for axes, pairing in zip(grid.flat, pairings):
        runs = pairing.base + pairing.new
        data = [trainer_samples(run.results, "batch") or [math.nan] for run in runs]
        boxes = axes.boxplot(data, whis=(10, 90), showfliers=False, patch_artist=True, widths=0.6,
                             medianprops={"color": "black"})
        for number, box in enumerate(boxes["boxes"]):
            box.set_facecolor("tab:blue" if number < len(pairing.base) else "tab:orange")
            box.set_alpha(0.6)
        axes.set_xticks(range(1, len(runs) + 1))
        axes.set_xticklabels([f"base {i + 1}" for i in range(len(pairing.base))]
                             + [f"new {i + 1}" for i in range(len(pairing.new))], rotation=45,
                             ha="right", fontsize="small")
        row = next((r for r in comparison.rows
                    if r.point == pairing.label and r.metric.name == "batch p50"), None)
        summary = "" if row is None or row.interval.change is None else \
            f"\nbatch p50 {100 * row.interval.change:+.1f}%: {row.verdict}"
        axes.set_title(f"{pairing.label[:60]}{summary}", fontsize="small")
        axes.set_ylabel("batch ms (p25-p75 box, p10-p90)", fontsize="small")
        axes.grid(axis="y", alpha=0.3)
    for axes in list(grid.flat)[len(pairings):]:
        axes.set_visible(False)
    figure.suptitle(f"base: {comparison.base.path} (blue)\nnew: {comparison.new.path} (orange)",
                    fontsize="medium")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("base", metavar="BASE", help="the runs before: a results file, a sweep "
                        "folder or a folder of results files")
    parser.add_argument("new", metavar="NEW", help="the runs after, in the same forms")
    parser.add_argument("--match", metavar="NAME,...", help="options to ignore when matching "
                        "points, e.g. hook or model (model also ignores its entry; default: every "
                        "option counts)")
    parser.add_argument("--threshold", type=typed(float, "threshold"),
                        default=DEFAULT_THRESHOLD_PCT, metavar="PCT",
                        help=f"smallest change, in %%, called faster or slower (default: "
                        f"{DEFAULT_THRESHOLD_PCT:g})")
    parser.add_argument("--fail-over", type=typed(float, "fail-over"), metavar="PCT",
                        help="exit 1 when a matched point is significantly slower by more than PCT "
                        "%% (a CI gate)")
    parser.add_argument("--format", choices=("table", "markdown"), default="table",
                        help="table (default), or markdown for a pull-request comment")
    parser.add_argument("--csv", metavar="FILE",
                        help="also write one row per point and metric as CSV")
    parser.add_argument("--json", metavar="FILE",
                        help=f"also write the comparison as JSON ({COMPARISON_SCHEMA})")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw, per point, base's and new's "
                        "runs side by side (needs matplotlib)")


def check(args: argparse.Namespace, bench_argv: list[str]) -> None:
    """The thresholds and --match, before any side is read."""
    for flag, value in (("--threshold", args.threshold), ("--fail-over", args.fail_over)):
        if value is not None and (not math.isfinite(value) or value < 0):
            raise ConfigError(f"{flag} is a percentage, 0 or more; got {value:g}")
    ignored_fields(args.match)
    check_apart({"--csv": args.csv, "--json": args.json, "--plot": args.plot},
                files_read([args.base, args.new]))
    for flag, path in (("--csv", args.csv), ("--json", args.json)):
        if path is not None:
            check_output_file(path, flag)
    if args.plot is not None:
        check_plot_file(args.plot, "compare")


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    check(args, bench_argv)
    comparison = compare(args.base, args.new, args.match, args.threshold, args.fail_over)
    print(render(comparison, markdown=args.format == "markdown"))
    if files_read([args.base]) == files_read([args.new]):
        print(f"note: base and new are the same runs ({args.base}, {args.new}): every change is 0 "
              f"by construction; compare the runs before a change with those after it")
    if args.csv:
        write_output(args.csv, "--csv", lambda path: write_csv(path, comparison.rows))
        print(f"csv: {args.csv}")
    if args.json:
        argv = ["bench.py", "compare", args.base, args.new]
        write_output(args.json, "--json", lambda path: Path(path).write_text(
            json.dumps(comparison.record(argv), indent=2) + "\n"))
        print(f"json: {args.json}")
    if args.plot:
        write_output(args.plot, "--plot", lambda path: plot(path, comparison))
        print(f"plot: {args.plot}")
    return comparison.exit_status
