"""``bench.py report DIR|FILE...``: one row per point, speedups against a baseline, CSV, plot."""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tabulate import tabulate

from ps_bench.config import ConfigError, check_output_file, in_its_folder
from ps_bench.metrics.costs import Link, byteps_bound_ms, ps_bound_ms
from ps_bench.plots import pyplot
from ps_bench.options import typed
from ps_bench.results.load import load_source

DESCRIPTION = (
    "Compare runs: one row per point, with the options that vary across points, p50 and p90 of a "
    "metric, samples/s, bytes per iteration, gradient error (runs with --verify) and the speedup "
    "against a baseline point; for runs with --target-loss also iterations and seconds to the "
    "target and the speedup to target, and --plot draws loss against seconds of training.")
EPILOG = """\
example:
  python bench.py report results/hooks --baseline hook=allreduce --csv hooks.csv --plot hooks.png
"""

# Resolved options never shown as columns: they describe the output, or repeat another column.
HIDDEN = {"out", "dry_run", "per_rank", "debug", "verbose", "emulate_keep", "model_config",
          "data_config", "model_size", "master_port", "engine_config"}


@dataclass
class Row:
    label: str
    results: dict

    @property
    def ok(self) -> bool:
        return self.results.get("status") == "ok"

    def option(self, name: str) -> Any:
        value = self.results.get("config", {}).get(name)
        return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value

    def stat(self, metric: str, statistic: str) -> float | None:
        for row in self.results.get("summary", []):
            if row["metric"] == metric:
                return row[statistic]
        return None

    def raw(self, metric: str) -> list[float]:
        return [v for entry in self.results.get("samples", [])
                for v in entry.get("metrics", {}).get(metric, [])]


def load_rows(sources: list[str]) -> list[Row]:
    """Points from sweep folders (their results.jsonl; a re-run point's latest line wins),
    .jsonl files, folders of results files and single results files, in the order given."""
    rows: list[Row] = []
    sources_read = [load_source(source) for source in sources]
    passed_over = [what for loaded in sources_read for what in loaded.passed_over()]
    for source, loaded in zip(sources, sources_read):
        if loaded.kind in ("sweep folder", "sweep results"):
            latest: dict[str, dict] = {}
            for _, line in loaded.runs:
                key = line.get("point", {}).get("hash") or str(len(latest))
                latest.pop(key, None)
                latest[key] = line
            for line in sorted(latest.values(), key=lambda r: r.get("point", {}).get("index", 0)):
                rows.append(Row(line.get("point", {}).get("name", Path(source).stem), line))
        else:
            rows += [Row(Path(where).stem, results) for where, results in loaded.runs]
    if not rows:
        raise ConfigError(f"report: no results in {', '.join(sources)}"
                          + (f" (passed over {'; '.join(passed_over)})" if passed_over else ""))
    for what in passed_over:
        print(f"ps_bench: report: passed over {what}", file=sys.stderr)
    return rows


def varying_options(rows: list[Row]) -> list[str]:
    names: list[str] = []
    for row in rows:
        for name in row.results.get("config", {}):
            if name not in names and name not in HIDDEN:
                names.append(name)
    return [n for n in names if len({str(row.option(n)) for row in rows}) > 1]


def find_baseline(rows: list[Row], baseline: str | None) -> Row:
    if baseline is None:
        return rows[0]
    key, sep, value = baseline.partition("=")
    if not sep:
        raise ConfigError(f"--baseline must be KEY=VALUE, e.g. hook=allreduce; got {baseline!r}")
    for row in rows:
        if str(row.option(key)) == value or row.label == baseline:
            return row
    raise ConfigError(f"--baseline {baseline}: no point has {key}={value}")


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


def table(rows: list[Row], metric: str, baseline: Row) -> tuple[list[str], list[list]]:
    columns = varying_options(rows)
    converging = any(row.results.get("convergence") for row in rows)
    stale = any(row.results.get("staleness") for row in rows)
    headers = columns + [f"{metric} p50 ms", f"{metric} p90 ms", "samples/s", "bytes/iter",
                         "grad error", "speedup"] + (["staleness p50/max"] if stale else []) + (
                             ["iterations to target", "seconds to target", "speedup to target"]
                             if converging else []) + ["status"]
    reference = baseline.stat(metric, "p50")
    reference_s = to_target(baseline)[1]
    body = []
    for row in rows:
        p50 = row.stat(metric, "p50")
        check = row.results.get("verify") or {}
        speedup = reference / p50 if p50 and reference else None
        body.append([
            *(row.option(c) for c in columns),
            fixed(p50, 3),
            fixed(row.stat(metric, "p90"), 3),
            fixed((row.results.get("throughput") or {}).get("samples_per_s"), 0),
            fixed((row.results.get("bytes") or {}).get("trainer_sent_per_iter"), 0),
            (None if check.get("grad_rel_error_p50") is None
             else f"{check['grad_rel_error_p50']:.2e}"),
            f"{speedup:.2f}x" if speedup else None,
            *([staleness_column(row)] if stale else []),
            *(convergence_columns(row, reference_s) if converging else []),
            row.results.get("status", "failed"),
        ])
    return headers, body


def fixed(value: float | None, decimals: int) -> str | None:
    return None if value is None else f"{value:.{decimals}f}"


def write_csv(path: str, headers: list[str], body: list[list]) -> None:
    with open(in_its_folder(path), "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(headers)
        writer.writerows([["" if v is None else v for v in line] for line in body])


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def plot(path: str, rows: list[Row], metric: str, title: str) -> None:
    """Lines over a numeric option that varies (e.g. ntrainer), else grouped bars per point;
    p50 with p10-p90 whiskers from the raw samples."""
    plt = pyplot()
    rows = [r for r in rows if r.ok and r.raw(metric)]
    if not rows:
        raise ConfigError(f"report --plot: no successful point has {metric!r} samples")
    columns = varying_options(rows)
    stats = {id(r): np.percentile(r.raw(metric), [10, 50, 90]) for r in rows}
    numeric = [c for c in columns if all(is_number(r.option(c)) for r in rows)]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.7 * len(rows) + 3), 4.5))
    if numeric:
        x_name = numeric[0]
        others = [c for c in columns if c != x_name]
        series: dict[str, list[Row]] = {}
        for row in rows:
            series.setdefault(" ".join(f"{c}={row.option(c)}" for c in others) or metric,
                              []).append(row)
        for label, members in series.items():
            members.sort(key=lambda r: r.option(x_name))
            xs = [r.option(x_name) for r in members]
            low, mid, high = zip(*(stats[id(r)] for r in members))
            axes.plot(xs, mid, marker="o", label=label)
            axes.fill_between(xs, low, high, alpha=0.2)
        axes.set_xlabel(x_name)
        axes.legend(fontsize="small")
        axes.set_xticks(sorted({r.option(x_name) for r in rows}))
    else:
        group_by = columns[0] if len(columns) > 1 else None
        inner = columns[1:] if group_by else columns

        def group_of(row: Row) -> str:
            return str(row.option(group_by)) if group_by else ""

        def series_of(row: Row) -> str:
            return " ".join(str(row.option(c)) for c in inner) or row.label

        if group_by is None:  # one bar per point, labelled on the axis
            low, mid, high = (np.array(v) for v in zip(*(stats[id(r)] for r in rows)))
            axes.bar(range(len(rows)), mid, yerr=[mid - low, high - mid], capsize=3,
                     color="tab:blue")
            axes.set_xticks(range(len(rows)))
            axes.set_xticklabels([series_of(r) for r in rows], rotation=30, ha="right")
            axes.set_xlabel(" / ".join(inner) or "point")
        else:  # groups along the axis, one coloured bar per value of the other options
            groups = list(dict.fromkeys(group_of(r) for r in rows))
            names = list(dict.fromkeys(series_of(r) for r in rows))
            width = 0.8 / len(names)
            for position, name in enumerate(names):
                members = [r for r in rows if series_of(r) == name]
                offset = (position - (len(names) - 1) / 2) * width
                xs = [groups.index(group_of(r)) + offset for r in members]
                low, mid, high = (np.array(v) for v in zip(*(stats[id(r)] for r in members)))
                axes.bar(xs, mid, width=width, yerr=[mid - low, high - mid], capsize=3, label=name)
            axes.set_xticks(range(len(groups)))
            axes.set_xticklabels(groups)
            axes.set_xlabel(group_by)
            axes.legend(title=" / ".join(inner), fontsize="small")
    axes.set_ylabel(f"{metric} (ms): p50, p10-p90 band" if numeric
                    else f"{metric} (ms): p50, p10-p90 whiskers")
    axes.set_title(title)
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(in_its_folder(path), dpi=120)
    plt.close(figure)


def plot_convergence(path: str, rows: list[Row], title: str) -> None:
    """The averaged model's training loss (smoothed as the target is) against seconds of
    training, one line per point, the target as a dashed line; held-out losses as markers."""
    plt = pyplot()
    rows = [r for r in rows if (r.results.get("convergence") or {}).get("loss_curve")]
    if not rows:
        raise ConfigError("report --plot: no point has a loss curve (runs with --target-loss)")
    columns = varying_options(rows)
    figure, axes = plt.subplots(figsize=(7.5, 4.8))
    colours = (plt.cm.tab20(np.linspace(0, 1, 20))[:len(rows)] if len(rows) > 10
               else [None] * len(rows))
    lowest = math.inf
    for row, colour in zip(rows, colours):
        convergence = row.results["convergence"]
        curve = [(s, loss) for _, s, loss in convergence["loss_curve"]]
        window = convergence["smoothing"]
        xs = [s for s, _ in curve[window - 1:]]
        ys = [np.mean([loss if loss is not None else np.nan
                       for _, loss in curve[i - window + 1:i + 1]])
              for i in range(window - 1, len(curve))]
        # an option left unset says nothing
        shown = [c for c in columns if row.option(c) not in (None, "{}")]
        label = (" ".join(f"{c}={row.option(c)}" for c in shown) if len(columns) > 1
                 else " ".join(str(row.option(c)) for c in shown)) or row.label
        if not convergence["reached"]:
            label += f" (not reached: {convergence['stopped_by']})"
        line, = axes.plot(xs, ys, label=label, color=colour)
        held = [(s, loss) for _, s, loss in convergence["held_out"] if loss is not None]
        if held:
            axes.plot(*zip(*held), linestyle="none", marker="o", markersize=3,
                      color=line.get_color())
        lowest = min([lowest, *(y for y in ys if 0 < y < math.inf),
                      *(loss for _, loss in held if loss > 0)])
    target = rows[0].results["convergence"]["target_loss"]
    start = max(loss for row in rows for _, _, loss in row.results["convergence"]["loss_curve"][:1]
                if loss is not None)
    axes.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target}")
    axes.set_yscale("log")
    # fixed limits: a diverging point leaves the plot upwards rather than squashing the rest
    axes.set_ylim(bottom=min(lowest, target) / 1.5, top=2 * start)
    axes.set_xlabel("seconds of training")
    axes.set_ylabel(f"the model's training loss (last "
                    f"{rows[0].results['convergence']['smoothing']}); "
                    "dots: held-out", fontsize="small")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(in_its_folder(path), dpi=120)
    plt.close(figure)


def scaling_table(rows: list[Row], link_gbps: float | None) -> tuple[list[str], list[list]]:
    """Per-iteration time for each trainers x servers point next to the analytic bounds.

    M is the point's bytes per trainer per iteration, B ``link_gbps`` or else the point's own
    memcpy floor (``--limits``): the parameter-server bound and BytePS's optimum
    (``costs.ps_bound_ms``, ``costs.byteps_bound_ms``)."""
    headers = ["hook", "trainers", "servers", "batch p50 ms", "comm p50 ms", "MB/iter", "B GB/s",
               "PS bound ms", "BytePS optimum ms", "comm / PS bound"]
    body = []
    for row in sorted((r for r in rows if r.ok),
                      key=lambda r: (str(r.option("hook")), trainers_of(r), servers_of(r))):
        n, k = trainers_of(row), servers_of(row)
        moved = (row.results.get("bytes") or {}).get("trainer_sent_per_iter") or 0.0
        memcpy = ((row.results.get("limits") or {}).get("memcpy") or {}).get("gbps")
        gbps = link_gbps or memcpy
        link = Link.of(0.0, gbps * 8) if gbps else None  # GB/s
        bound = ps_bound_ms(n, k, moved, link) if link and k and moved else None
        optimum = byteps_bound_ms(n, k, moved, link) if link and moved else None
        comm = row.stat("comm", "p50")
        body.append([row.option("hook"), n, k, fixed(row.stat("batch", "p50"), 3), fixed(comm, 3),
                     fixed(moved / 1e6, 3), fixed(gbps, 2), fixed(bound, 3), fixed(optimum, 3),
                     f"{comm / bound:.2f}" if bound and comm else None])
    return headers, body


def trainers_of(row: Row) -> int:
    config = row.results.get("config", {})
    return int(config.get("ntrainer", 0)) + int(config.get("ncudatrainer", 0))


def servers_of(row: Row) -> int:
    config = row.results.get("config", {})
    return int(config.get("nserver", 0)) + int(config.get("ncudaserver", 0))


def run_report(sources: list[str], baseline: str | None, metric: str, csv_path: str | None,
               plot_path: str | None, scaling: bool = False, link_gbps: float | None = None) -> int:
    rows = load_rows(sources)
    if not any(row.stat(metric, "p50") is not None for row in rows):
        known = sorted({r["metric"] for row in rows for r in row.results.get("summary", [])})
        raise ConfigError(f"--metric {metric!r} is in no results; known: "
                          f"{', '.join(known) or 'none'}")
    if scaling:
        headers, body = scaling_table(rows, link_gbps)
        print(tabulate(body, headers=headers, missingval="-", disable_numparse=True))
        print("\nPS bound: max(M, n*M/k) / B; BytePS optimum: 2n(n-1)M / ((n^2 + kn - 2k) * B); "
              "B = --link-gbps, else the point's memcpy floor (--limits)")
        if csv_path:
            write_csv(csv_path, headers, body)
            print(f"csv: {csv_path}")
        return 0
    reference = find_baseline(rows, baseline)
    headers, body = table(rows, metric, reference)
    print(tabulate(body, headers=headers, missingval="-", disable_numparse=True))
    print(f"\nspeedup: {reference.label}'s {metric} p50 divided by each point's "
          f"(above 1 is faster)")
    converging = any(row.results.get("convergence") for row in rows)
    if converging:
        print(f"speedup to target: {reference.label}'s seconds of training to the target loss "
              f"divided by each point's")
    if csv_path:
        write_csv(csv_path, headers, body)
        print(f"csv: {csv_path}")
    if plot_path:
        sweep = rows[0].results.get("point", {}).get("sweep", "")
        if converging:
            plot_convergence(plot_path, rows,
                             f"{sweep + ': ' if sweep else ''}loss against training time")
        else:
            plot(plot_path, rows, metric,
                 f"{sweep + ': ' if sweep else ''}trainer {metric} time per iteration")
        print(f"plot: {plot_path}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sources", nargs="+", metavar="DIR|FILE",
                        help="sweep folders (their results.jsonl), .jsonl files or results files")
    parser.add_argument("--baseline", metavar="KEY=VALUE", help="the point speedups are measured "
                        "against (default: the first point)")
    parser.add_argument("--metric", default="batch", metavar="NAME",
                        help="summary metric to compare, e.g. batch, comm, backward, round "
                        "(default: batch)")
    parser.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the comparison (needs the "
                        "'plot' extra); for --target-loss runs, the loss against seconds of "
                        "training")
    parser.add_argument("--scaling", action="store_true",
                        help="per-iteration time for each trainers x servers point next to the "
                             "analytic parameter-server bound and BytePS's optimum (bandwidth: "
                             "--link-gbps, else each point's memcpy floor from --limits)")
    parser.add_argument("--link-gbps", type=typed(float, "link-gbps"), metavar="X",
                        help="bandwidth B in GB/s for --scaling "
                        "(default: each point's memcpy floor)")


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    if args.link_gbps is not None and not 0 < args.link_gbps < math.inf:
        raise ConfigError(f"--link-gbps must be positive; got {args.link_gbps}")
    for flag, path in (("--csv", args.csv), ("--plot", args.plot)):
        if path is not None:
            check_output_file(path, flag)
    return run_report(args.sources, args.baseline, args.metric, args.csv, args.plot, args.scaling,
                      args.link_gbps)
