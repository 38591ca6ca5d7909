"""``bench.py report --timeline FILE.png``: one typical iteration of each point, side by side, as
a Gantt chart: the trainer's compute (forward, backward, the optimizer step; each phase's p50),
and on the lane beneath it each bucket's communication, from DDP handing it over to the hook's
answer (the results' ``timeline``: each bucket's median over the round's last iterations, after
backward began). Beside the figure, ``FILE.json`` holds the figures it draws, and the report
prints them as a table: with each point's ``comm`` and ``exposed`` p50 (what of it no compute
hid) and its servers' aggregation p50, which the chart does not place (a server's clock is its
own: ``--trace`` lines them up).

A point of a sweep run several times is drawn once, from its first successful run; a point
whose results have no bucket timeline (FSDP, DeepSpeed, a GPU without CUDA events, a run
before it was recorded) has its compute alone."""

from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

from ps_bench.config import ConfigError
from ps_bench.plots import pyplot
from ps_bench.report.figures import label
from ps_bench.report.rows import Row, varying_options

PHASES = ("forward", "backward", "optimizer")
COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green",
           "bucket": "tab:red"}


def iterations(rows: list[Row]) -> list[dict]:
    """Each point's typical iteration, in ms from its start: its phases back to back, and each
    bucket from its hand-over to its answer (after forward, as backward began there)."""
    chosen, seen = [], set()
    for row in rows:
        if row.ok and row.point not in seen and row.stat("backward", "p50", "trainer") is not None:
            seen.add(row.point)
            chosen.append(row)
    if not chosen:
        raise ConfigError("report --timeline: no successful run with trainer phase times")
    names = varying_options(chosen)
    out = []
    for row in chosen:
        phases, at = {}, 0.0
        for phase in PHASES:
            length = row.stat(phase, "p50", "trainer") or 0.0
            phases[phase] = [at, at + length]
            at += length
        began = phases["backward"][0]
        buckets = [{"index": bucket["index"], "bytes": bucket["bytes"],
                    "span": [began + bucket["ready_ms"], began + bucket["done_ms"]]}
                   for bucket in row.results.get("timeline") or []]
        out.append({"point": label(row, names) or row.label, "hook": row.option("hook"),
                    "phases": phases, "buckets": buckets,
                    "comm_ms": row.stat("comm", "p50", "trainer"),
                    "exposed_ms": row.stat("exposed", "p50", "trainer"),
                    "server_aggregate_ms": row.stat("aggregate", "p50", "server")})
    return out


def table(drawn: list[dict]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"
    body = [[entry["point"], *(ms(entry["phases"][phase][1] - entry["phases"][phase][0])
                               for phase in PHASES),
             len(entry["buckets"]),
             ms(max((bucket["span"][1] for bucket in entry["buckets"]), default=None)),
             ms(entry["comm_ms"]), ms(entry["exposed_ms"]), ms(entry["server_aggregate_ms"])]
            for entry in drawn]
    return tabulate(body, headers=["point", "forward", "backward", "optimizer", "buckets",
                                   "last bucket done", "comm", "exposed", "server aggregate"],
                    disable_numparse=True)


def draw(path: str, drawn: list[dict], title: str) -> None:
    """Two lanes a point, top to bottom in the points' order: compute, then buckets."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(9.0, 1.0 + 0.8 * len(drawn)))
    ticks, names = [], []
    for place, entry in enumerate(drawn):
        base = -place * 2.0
        for phase in PHASES:
            low, high = entry["phases"][phase]
            axes.broken_barh([(low, high - low)], (base, 0.8), color=COLOURS[phase],
                             label=phase if place == 0 else None)
        for bucket in entry["buckets"]:
            low, high = bucket["span"]
            axes.broken_barh([(low, high - low)], (base - 0.9, 0.8), color=COLOURS["bucket"],
                             alpha=0.6, edgecolor="black", linewidth=0.5,
                             label="bucket, handed over to answered" if place == 0 and
                             bucket is entry["buckets"][0] else None)
        ticks += [base + 0.4, base - 0.5]
        names += [f"{entry['point']}: compute", "buckets"]
    axes.set_yticks(ticks, names, fontsize="small")
    axes.set_xlabel("ms from the iteration's start (p50s; buckets: medians after backward began)")
    axes.set_title(title)
    axes.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def report_timeline(rows: list[Row], path: str) -> None:
    """Draws ``path``, writes its figures beside it (``.json``) and prints them."""
    drawn = iterations(rows)
    draw(path, drawn, "one iteration of each point")
    figures = Path(path).with_suffix(".json")
    figures.write_text(json.dumps({"points": drawn}, indent=2) + "\n")
    print(table(drawn))
    print(f"timeline: {path} (its figures: {figures})")
