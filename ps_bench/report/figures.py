"""``bench.py report --plot``: a figure of the points, batch times against the option that
varies, or the loss against seconds of training (imported only when a figure is asked for)."""

from __future__ import annotations

import math

import numpy as np

from ps_bench.config import ConfigError
from ps_bench.plots import pyplot
from ps_bench.report.rows import Row, is_number, varying_options

LEGEND_LINE_IN = 0.2  # inches a legend entry takes, in small type
MARKERS = ("o", "s", "^", "D", "v", "P")
MAX_WIDTH_IN = 30.0  # a figure of many bars is no wider (its labels are rotated)
SLANTED = {"rotation": 30, "ha": "right"}


def plot(path: str, rows: list[Row], metric: str, title: str) -> None:
    """Lines over a numeric option that varies within a line (e.g. ntrainer, ``line_axis``),
    else bars, grouped where the groups share bars (``bar_groups``); p50 with p10-p90 whiskers
    from the raw samples (of every run, where a sweep ran the point several times)."""
    plt = pyplot()
    rows, stats = per_point(rows, metric)
    if not rows:
        raise ConfigError(f"report --plot: no successful point has {metric!r} samples")
    columns = varying_options(rows)
    x_name = line_axis(rows, columns)
    if x_name is not None:
        series = lines(rows, columns, x_name, metric)
        figure, axes = plt.subplots(figsize=(7.5, max(4.5, LEGEND_LINE_IN * len(series))))
        for index, (name, members) in enumerate(series.items()):
            members.sort(key=lambda r: r.option(x_name))
            xs = [r.option(x_name) for r in members]
            low, mid, high = zip(*(stats[id(r)] for r in members))
            # ten colours, then the next marker: sixty lines apart before any repeats
            axes.plot(xs, mid, marker=MARKERS[index // 10 % len(MARKERS)], label=name)
            axes.fill_between(xs, low, high, alpha=0.2)
        axes.set_xlabel(x_name)
        legend_beside(axes)
        axes.set_xticks(sorted({r.option(x_name) for r in rows}))
    else:
        group_by = bar_groups(rows, columns)
        inner = [c for c in columns if c != group_by]
        named = len(inner) > 1  # several options: each value beside its name

        def group_of(row: Row) -> str:
            return str(row.option(group_by)) if group_by else ""

        def series_of(row: Row) -> str:
            return label(row, inner) or row.label

        bars = len(rows) if group_by is None else len({series_of(r) for r in rows})
        figure, axes = plt.subplots(figsize=(min(MAX_WIDTH_IN, max(6.0, 0.4 * len(rows) + 3)),
                                             max(4.5, LEGEND_LINE_IN * bars)))
        if group_by is None:  # one bar per point, labelled on the axis
            low, mid, high = (np.array(v) for v in zip(*(stats[id(r)] for r in rows)))
            axes.bar(range(len(rows)), mid, yerr=[mid - low, high - mid], capsize=3,
                     color="tab:blue")
            axes.set_xticks(range(len(rows)))
            axes.set_xticklabels([series_of(r) for r in rows], **SLANTED)
            axes.set_xlabel("point" if named or not inner else inner[0])
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
            axes.set_xticklabels(groups, **SLANTED if len(groups) > 6 else {})
            axes.set_xlabel(group_by)
            legend_beside(axes, title=None if named else inner[0])
    axes.set_ylabel(f"{metric} (ms): p50, p10-p90 band" if x_name is not None
                    else f"{metric} (ms): p50, p10-p90 whiskers")
    axes.set_title(title)
    axes.grid(axis="y", alpha=0.3)
    # the canvas grows to hold the legend and long tick labels (tight_layout would shrink the
    # axes to nothing, and warn, with a legend of many points)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def per_point(rows: list[Row], metric: str) -> tuple[list[Row], dict[int, np.ndarray]]:
    """The successful points with ``metric`` samples, a point's first run standing for all its
    runs, and each one's p10, p50 and p90 over the samples of every run (by ``id``)."""
    runs: dict[tuple, list[Row]] = {}
    for row in rows:
        if row.ok and row.raw(metric):
            runs.setdefault(row.point, []).append(row)
    return ([every[0] for every in runs.values()],
            {id(every[0]): np.percentile([v for r in every for v in r.raw(metric)], [10, 50, 90])
             for every in runs.values()})


def line_axis(rows: list[Row], columns: list[str]) -> str | None:
    """The numeric option to draw lines over: the first that takes two values or more within
    one line (the points alike in every other option); None where no option does, and bars are
    drawn (an option that varies only with another, as nserver with the hook, makes no line)."""
    for name in columns:
        if all(is_number(r.option(name)) for r in rows) and any(
                len({r.option(name) for r in members}) > 1
                for members in lines(rows, columns, name, "").values()):
            return name
    return None


def bar_groups(rows: list[Row], columns: list[str]) -> str | None:
    """The option to group bars by: the first whose groups hold several bars and share one
    (the points alike in every other option); None, one bar per point, where none does."""
    for name in columns[:-1] if len(columns) > 1 else []:
        bars = lines(rows, columns, name, "")
        shared = any(len({str(r.option(name)) for r in members}) > 1 for members in bars.values())
        if shared and len({str(r.option(name)) for r in rows}) < len(rows):
            return name
    return None


def lines(rows: list[Row], columns: list[str], x_name: str, fallback: str) -> dict[str, list[Row]]:
    """The points of each line over ``x_name``, by the label of their other options."""
    series: dict[str, list[Row]] = {}
    for row in rows:
        series.setdefault(label(row, [c for c in columns if c != x_name], named=True) or fallback,
                          []).append(row)
    return series


def label(row: Row, names: list[str], named: bool = False) -> str:
    """The point's values of ``names`` that are set; each beside its name where there are
    several (or ``named``)."""
    shown = [c for c in names if is_set(row.option(c))]
    if named or len(names) > 1:
        return " ".join(f"{c}={row.option(c)}" for c in shown)
    return " ".join(str(row.option(c)) for c in shown)


def is_set(value) -> bool:
    """An option left unset (None, an empty mapping or list) says nothing in a label."""
    return value not in (None, "{}", "[]")


def legend_beside(axes, **options) -> None:
    """The legend to the right of the plot, where no number of points covers the data."""
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0,
                **options)


def plot_convergence(path: str, rows: list[Row], title: str) -> None:
    """The averaged model's training loss (smoothed as the target is) against seconds of
    training, one line per point, the target as a dashed line; held-out losses as markers."""
    plt = pyplot()
    rows = [r for r in rows if r.has_loss_curve]
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
        name = (label(row, columns) or row.label) + (f" run {row.run}" if row.run else "")
        if not convergence["reached"]:
            name += f" (not reached: {convergence['stopped_by']})"
        line, = axes.plot(xs, ys, label=name, color=colour)
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
    figure.savefig(path, dpi=120)
    plt.close(figure)
