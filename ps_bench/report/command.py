"""``bench.py report``: the table of the points with speedups against a baseline, the scaling table,
CSV, and the subcommand (DESCRIPTION, EPILOG, add_arguments, main)."""

from __future__ import annotations

import argparse
import csv
import statistics
from dataclasses import dataclass

from tabulate import tabulate

from ps_bench.config import ConfigError
from ps_bench.metrics.costs import Link, byteps_bound_ms, ps_bound_ms
from ps_bench.options import plural
from ps_bench.places import check_apart, check_output_file, write_output
from ps_bench.plots import check_plot_file
from ps_bench.report.figures import plot, plot_convergence
from ps_bench.report.timeline import report_timeline
from ps_bench.registry import did_you_mean
from ps_bench.results.load import diverged, files_read
from ps_bench.results.recovery import failures_in
from ps_bench.report.rows import HIDDEN, WORKLOAD, Row, load_rows, varying_options
from ps_bench.runtime.network import parse_rate
from ps_bench.strategies import SERVER_COUNTS, sends_to_servers

DESCRIPTION = (
    "Compare runs: one row per point (per run of a point a sweep repeats, each against the "
    "baseline's run of its turn, with the median over the runs under the table), with the "
    "options that vary across points, p50 and p90 of a metric, samples/s, bytes per iteration, "
    "the trainers' peak memory, gradient error (runs with --verify) and the speedup "
    "against a baseline point; for runs with --target-loss also iterations and seconds to the "
    "target and the speedup to target, and --plot draws loss against seconds of training.")
EPILOG = """\
example:
  python bench.py report results/hooks --baseline hook=allreduce --csv hooks.csv --plot hooks.png
"""

@dataclass(frozen=True)
class Baseline:
    """The points speedups are measured against, those ``--baseline`` names. Where they differ
    among themselves (a grid: a link, a trainer count), each point is measured against the one
    alike it in those options, and a point with none alike gets no speedup. The runs of a point a
    sweep repeats are each measured against the baseline's run of the same turn, where it has
    one that finished: the sweep runs them in turns, so each pair ran closest in time."""

    points: tuple[Row, ...]
    named: str = ""  # --baseline as given, else the options the first point differs in
    by: tuple[str, ...] = ()  # the options the points differ in (find_baseline finds them)

    def of(self, row: Row) -> Row | None:
        alike = [point for point in self.points
                 if all(str(point.option(n)) == str(row.option(n)) for n in self.by)]
        ok = [point for point in alike if point.ok] or alike  # a failed run only where all failed
        return next((point for point in ok if point.run == row.run), ok[0] if ok else None)

    def doing_the_work_of(self, row: Row) -> Row | None:
        """The row's baseline point (``of``) where its iterations do the row's work (its
        ``WORKLOAD``), else None: no speedup between different work."""
        ref = self.of(row)
        return ref if ref is not None and row.workload == ref.workload else None

    def against(self, what: str = "") -> str:
        """Whose ``what`` each point's is measured against, for the table's footnotes."""
        if not self.named:
            return f"{self.points[0].label}'s{' ' + what if what else ''}"
        alike = f" at the same {', '.join(self.by)}" if self.by else ""
        return f"{'the ' + what if what else 'that'} of the point with {self.named}{alike}"


def what_points_have(rows: list[Row], key: str) -> str:
    """For a --baseline that matched no point: the values ``key`` takes, or, where no point has
    such an option, the options the points differ in."""
    options = [name for name in rows[0].results.get("config", {}) if name not in HIDDEN]
    if key in options:
        values = sorted({str(row.option(key)) for row in rows})
        return f"{key} is {', '.join(values)} in these points"
    varying = ", ".join(varying_options(rows)) or "no option"
    return f"{key!r} is not an option; {did_you_mean(key, options)}the points differ in {varying}"


def find_baseline(rows: list[Row], baseline: str | None) -> Baseline:
    if baseline is None:  # the first point, each of its runs, named as the table shows it
        named = ", ".join(f"{name}={rows[0].option(name)}" for name in varying_options(rows)
                          if rows[0].option(name) is not None)
        return Baseline(tuple(row for row in rows if row.point == rows[0].point), named)
    key, sep, value = baseline.partition("=")
    if not sep:
        raise ConfigError(f"--baseline must be KEY=VALUE, e.g. hook=allreduce; got {baseline!r}")
    named = [row for row in rows if row.label == baseline]
    points = ([row for row in named if row.point == named[0].point]
              or [row for row in rows if str(row.option(key)) == value])
    if not points:
        raise ConfigError(f"--baseline {baseline}: no point has {key}={value}; "
                          f"{what_points_have(rows, key)}")
    return Baseline(tuple(points), baseline,
                    tuple(varying_options(points)) if len(points) > 1 else ())


def to_target(row: Row) -> tuple[int | None, float | None]:
    """Iterations and seconds to the target loss, where the point reached it."""
    convergence = row.results.get("convergence") or {}
    if not convergence.get("reached"):
        return None, None
    return convergence["iterations"], convergence["seconds"]


def staleness_column(row: Row) -> str | None:
    stale = row.results.get("staleness") or {}
    return None if stale.get("p50") is None else f"{stale['p50']:g}/{stale['max']}"


def convergence_columns(row: Row, reference_s: float | None) -> list:
    convergence = row.results.get("convergence") or {}
    iterations, seconds = to_target(row)
    if not convergence:
        return [None, None, None]
    if iterations is None:
        return [f"not reached ({convergence.get('stopped_by')})", None, None]
    speedup = reference_s / seconds if reference_s and seconds else None
    return [iterations, fixed(seconds, 3), f"{speedup:.2f}x" if speedup else None]


def recovery_columns(row: Row) -> list:
    """A run's failures (restarts, trainers dropped, servers lost), its goodput, the goodput's
    share of its failure-free rate, and its step efficiency (``results.recovery``)."""
    recovery = row.results.get("recovery") or {}
    if not recovery:
        return [None] * 4
    good = recovery.get("goodput") or {}
    failures = failures_in(recovery)
    rate, free = good.get("samples_per_s"), good.get("failure_free_samples_per_s")
    return [failures, fixed(rate, 0), f"{rate / free:.2f}" if rate and free else None,
            fixed(good.get("step_efficiency"), 3)]


def table(rows: list[Row], metric: str, baseline: Baseline) -> tuple[list[str], list[list]]:
    columns = varying_options(rows)
    runs = any(row.run is not None for row in rows)
    converging = any(row.results.get("convergence") for row in rows)
    stale = any(row.results.get("staleness") for row in rows)
    held = any(row.trainer_peak is not None for row in rows)
    recovering = any(row.results.get("recovery") for row in rows)
    headers = (columns + (["run"] if runs else [])
               + [f"{metric} p50 ms", f"{metric} p90 ms", "samples/s", "bytes/iter"]
               + (["trainer MiB"] if held else []) + ["grad error", "speedup"]
               + (["staleness p50/max"] if stale else [])
               + (["iterations to target", "seconds to target", "speedup to target"]
                  if converging else [])
               + (["failures", "goodput samples/s", "of failure-free", "step efficiency"]
                  if recovering else []) + ["status"])
    body = []
    for row in rows:
        p50 = row.stat(metric, "p50")
        check = row.results.get("verify") or {}
        ref = baseline.doing_the_work_of(row)
        reference_s = to_target(ref)[1] if ref else None
        speedup = speedup_of(row, ref, metric)
        body.append([
            *(row.option(c) for c in columns),
            *([row.run] if runs else []),
            fixed(p50, 3),
            fixed(row.stat(metric, "p90"), 3),
            fixed((row.results.get("throughput") or {}).get("samples_per_s"), 0),
            fixed((row.results.get("bytes") or {}).get("trainer_sent_per_iter"), 0),
            *([fixed(row.trainer_peak and row.trainer_peak / 2 ** 20, 1)] if held else []),
            (None if check.get("grad_rel_error_p50") is None
             else f"{check['grad_rel_error_p50']:.2e}"),
            f"{speedup:.2f}x" if speedup else None,
            *([staleness_column(row)] if stale else []),
            *(convergence_columns(row, reference_s) if converging else []),
            *(recovery_columns(row) if recovering else []),
            status_of(row),
        ])
    return headers, body


def status_of(row: Row) -> str:
    """The run's status, and ``ok, diverged`` for a run that finished with parameters that are
    not finite (its times hold; its training did not: a smaller --lr?)."""
    return "ok, diverged" if diverged(row.results) else row.results.get("status", "failed")


def speedup_of(row: Row, ref: Row | None, metric: str) -> float | None:
    """``ref``'s p50 of ``metric`` over the row's (``ref``: the baseline's point alike the row,
    None where it has none or it does other work); where either synchronises once a period,
    their means, which amortise it (the p50 is an iteration that synchronises nothing)."""
    statistic = "mean" if row.periodic or ref is not None and ref.periodic else "p50"
    mine, reference = row.stat(metric, statistic), ref.stat(metric, statistic) if ref else None
    return reference / mine if mine and reference else None


def over_runs(rows: list[Row], metric: str, baseline: Baseline) -> list[str]:
    """A line for each point a sweep ran several times: the median over its runs of the metric's
    p50 and of the speedup, with their ranges, so that the spread of the runs is in sight."""
    points: dict[tuple, list[Row]] = {}
    for row in rows:
        if row.run is not None:
            points.setdefault(row.point, []).append(row)
    out = []
    for (label, _), runs in points.items():
        said = []
        done = [run for run in runs if run.ok]
        for what, values, text in (
                (f"{metric} p50", [run.stat(metric, "p50") for run in done], "{:.3f} ms"),
                ("speedup", [speedup_of(run, baseline.doing_the_work_of(run), metric)
                             for run in done], "{:.2f}x")):
            values = sorted(value for value in values if value is not None)
            if values:
                said.append(f"{what} {text.format(statistics.median(values))} (runs "
                            f"{text.format(values[0])} to {text.format(values[-1])})")
        failed = len(runs) - len(done)
        out.append(f"{label}: over {plural(len(done), 'run')}"
                   + (f" ({failed} failed, left out)" if failed else "")
                   + f", median {', '.join(said) or 'none'}")
    return out


def fixed(value: float | None, decimals: int) -> str | None:
    return None if value is None else f"{value:.{decimals}f}"


def write_csv(path: str, headers: list[str], body: list[list]) -> None:
    with open(path, "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(headers)
        writer.writerows([["" if v is None else v for v in line] for line in body])


def scaling_table(rows: list[Row], link_gbps: float | None) -> tuple[list[str], list[list]]:
    """Per-iteration time for each trainers x servers point next to the analytic bounds.

    M is the point's bytes per trainer per iteration, B ``link_gbps`` (gigabytes a second: the
    ``--link`` rate over 8) or else the point's own memcpy floor (``--limits``): the
    parameter-server bound and BytePS's optimum (``costs.ps_bound_ms``,
    ``costs.byteps_bound_ms``)."""
    runs = any(row.run is not None for row in rows)  # a sweep's repeats: a row each
    headers = ["hook", "trainers", "servers", *(["run"] if runs else []), "batch p50 ms",
               "comm p50 ms", "MB/iter", "B GB/s", "PS bound ms", "BytePS optimum ms",
               "comm / PS bound"]
    body = []
    counts = {id(r): (r.count("ntrainer", "ncudatrainer"), servers_used(r)) for r in rows}
    for row in sorted((r for r in rows if r.ok), key=lambda r: (str(r.option("hook")),
                                                                 *counts[id(r)])):
        n, k = counts[id(row)]
        moved = (row.results.get("bytes") or {}).get("trainer_sent_per_iter") or 0.0
        memcpy = ((row.results.get("limits") or {}).get("memcpy") or {}).get("gbps")
        gbps = link_gbps or memcpy
        link = Link.of(0.0, gbps * 8) if gbps else None  # GB/s
        bound = ps_bound_ms(n, k, moved, link) if link and k and moved else None
        optimum = byteps_bound_ms(n, k, moved, link) if link and moved else None
        comm = row.stat("comm", "p50")
        body.append([row.option("hook"), n, k, *([row.run] if runs else []),
                     fixed(row.stat("batch", "p50"), 3), fixed(comm, 3),
                     fixed(moved / 1e6, 3), fixed(gbps, 2), fixed(bound, 3), fixed(optimum, 3),
                     f"{comm / bound:.2f}" if bound and comm else None])
    return headers, body


def servers_used(row: Row) -> int:
    """The parameter servers the point's strategy sends to (``sends_to_servers``)."""
    return row.count(*SERVER_COUNTS) if sends_to_servers(row.option("hook")) else 0


def run_report(sources: list[str], baseline: str | None, metric: str, csv_path: str | None,
               plot_path: str | None, scaling: bool = False, link_gbps: float | None = None,
               timeline_path: str | None = None) -> int:
    rows = load_rows(sources)
    if not any(row.stat(metric, "p50") is not None for row in rows):
        if not any(row.ok or row.results.get("summary") for row in rows):
            first = rows[0].results.get("error", "no error recorded")
            raise ConfigError(f"report: no run in {', '.join(sources)} finished a timed round "
                              f"({len(rows)} failed; the first: {first}): nothing to compare")
        known = sorted({r["metric"] for row in rows for r in row.results.get("summary", [])})
        raise ConfigError(f"--metric {metric!r} is in no results; known: "
                          f"{', '.join(known) or 'none'}")
    if scaling:
        headers, body = scaling_table(rows, link_gbps)
        print(tabulate(body, headers=headers, missingval="-", disable_numparse=True))
        print("\nPS bound: max(M, n*M/k) / B; BytePS optimum: 2n(n-1)M / ((n^2 + kn - 2k) * B); "
              "B = --link, else the point's memcpy floor (--limits)")
        if csv_path:
            write_output(csv_path, "--csv", lambda path: write_csv(path, headers, body))
            print(f"csv: {csv_path}")
        return 0
    reference = find_baseline(rows, baseline)
    headers, body = table(rows, metric, reference)
    print(tabulate(body, headers=headers, missingval="-", disable_numparse=True))
    print(f"\nspeedup: {reference.against(metric + ' p50')} divided by each point's "
          f"(above 1 is faster)" + ("; for a strategy that synchronises once a period (local "
                                    "SGD, DiLoCo), whose p50 iteration synchronises nothing, "
                                    "the two means, which amortise it" if any(
                                        row.periodic for row in rows) else ""))
    medians = over_runs(rows, metric, reference)
    if medians:  # a sweep's repeats: each run against the baseline's of the same turn
        print("each run's speedup is against the baseline's run of the same turn (the runs of a "
              "sweep take turns, so each pair ran closest in time):\n  " + "\n  ".join(medians))
    refs = [reference.of(row) for row in rows]
    unmatched = refs.count(None)
    if unmatched:
        print(f"no speedup for {plural(unmatched, 'point')} with no point of {reference.named} "
              f"at {'its' if unmatched == 1 else 'their'} {', '.join(reference.by)}")
    others = sum(ref is not None and row.workload != ref.workload for row, ref in zip(rows, refs))
    if others:
        print(f"no speedup for {plural(others, 'point')} of another workload than "
              f"{reference.against()} (its {', '.join(WORKLOAD)}): "
              f"{'its' if others == 1 else 'their'} iterations do other work")
    converging = any(row.results.get("convergence") for row in rows)
    if converging:
        print(f"speedup to target: {reference.against('seconds of training to the target loss')} "
              f"divided by each point's")
    if csv_path:
        write_output(csv_path, "--csv", lambda path: write_csv(path, headers, body))
        print(f"csv: {csv_path}")
    if plot_path:
        sweep = rows[0].results.get("point", {}).get("sweep", "")
        named = f"{sweep}: " if sweep else ""
        curves = sum(row.has_loss_curve for row in rows)
        without = sum(row.ok and not row.has_loss_curve for row in rows)
        if curves and not without:
            write_output(plot_path, "--plot", lambda path: plot_convergence(
                path, rows, f"{named}loss against training time"))
        else:  # of points with loss curves and points without, the one thing all have
            write_output(plot_path, "--plot", lambda path: plot(
                path, rows, metric, f"{named}trainer {metric} time per iteration"))
        print(f"plot: {plot_path}")
        if curves and without:
            print(f"plot: {metric} times, as {plural(without, 'point')} "
                  f"{'has' if without == 1 else 'have'} no loss curve; report the "
                  f"{curves} with one on their own for the loss against seconds of training")
    if timeline_path:
        write_output(timeline_path, "--timeline", lambda path: report_timeline(rows, path))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sources", nargs="+", metavar="DIR|FILE",
                        help="sweep folders (their results.jsonl), .jsonl files or results files")
    parser.add_argument("--baseline", metavar="KEY=VALUE", help="the point speedups are measured "
                        "against (default: the first point); where several match and differ (a "
                        "grid), each point's is the one alike it in those options")
    parser.add_argument("--metric", default="batch", metavar="NAME",
                        help="summary metric to compare, e.g. batch, comm, backward, round "
                        "(default: batch)")
    parser.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the comparison (needs the "
                        "'plot' extra); where every point ran to --target-loss, the loss against "
                        "seconds of training")
    parser.add_argument("--timeline", metavar="FILE.png",
                        help="also draw one typical iteration of each point side by side: its "
                             "phases, and each bucket from its hand-over to its answer; its "
                             "figures written beside it (FILE.json) and printed")
    parser.add_argument("--scaling", action="store_true",
                        help="per-iteration time for each trainers x servers point next to the "
                             "analytic parameter-server bound and BytePS's optimum (bandwidth: "
                             "--link, else each point's memcpy floor from --limits)")
    parser.add_argument("--link", metavar="RATE",
                        help="the link's rate B for --scaling, in bits as predict takes it "
                             "(e.g. 10gbit, 500mbit; default: each point's memcpy floor)")


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    if args.link is not None and not args.scaling:
        raise ConfigError("--link is the bandwidth of --scaling's bounds: give --scaling too")
    if args.scaling:
        ignored = [flag for flag, value in (("--baseline", args.baseline), ("--plot", args.plot),
                                            ("--timeline", args.timeline)) if value is not None]
        if ignored:
            verb = "does" if len(ignored) == 1 else "do"
            raise ConfigError(f"--scaling prints its own table, against the analytic bounds: "
                              f"{' and '.join(ignored)} {verb} not apply to it")
    link_gbps = None if args.link is None else parse_rate(args.link, "--link") / 8e9
    check_apart({"--csv": args.csv, "--plot": args.plot, "--timeline": args.timeline},
                files_read(args.sources))
    if args.csv is not None:
        check_output_file(args.csv, "--csv")
    for flag, path in (("--plot", args.plot), ("--timeline", args.timeline)):
        if path is not None:
            check_plot_file(path, "report", flag)
    return run_report(args.sources, args.baseline, args.metric, args.csv, args.plot, args.scaling,
                      link_gbps, args.timeline)
