"""``bench.py report --plot``: a figure of the points, batch times against the option that
varies, or the loss against seconds of training (imported only when a figure is asked for)."""

from __future__ import annotations

import math

import numpy as np

from ps_bench.config import ConfigError, in_its_folder
from ps_bench.plots import pyplot
from ps_bench.report.rows import Row, is_number, varying_options


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
