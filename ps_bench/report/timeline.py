"""``bench.py report --timeline FILE.png``: one typical iteration of each point, side by side, as
a Gantt chart: the trainer's compute (forward, backward, the optimizer step; each phase's p50),
on the lane beneath it each bucket's communication, from DDP handing it over to the hook's
answer (the results' ``timeline``: each bucket's median over the round's last iterations, after
backward began), and beneath that, for parameter servers, each piece on its server: from its
first contribution's arrival to its last's, then its aggregation and answer (the results'
``server_timeline``, after trainer 0's backward began: on the clock of one machine, a server
of another host set by its clock's measured offset, ``env.clocks``). Beside the figure,
``FILE.json`` holds the figures it draws, and the report prints them as a table: with each
point's ``comm`` and ``exposed`` p50 (what of it no compute hid) and its servers' aggregation
p50.

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
           "bucket": "tab:red", "receive": "tab:gray", "answer": "tab:purple"}
LANES = 3.0  # a point's height: compute, buckets, servers


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
        pieces = [{"server": piece["server"], "slice": piece["slice"], "piece": piece["piece"],
                   "received": [began + piece["first_ms"], began + piece["last_ms"]],
                   "answered": [began + piece["last_ms"], began + piece["answered_ms"]]}
                  for piece in row.results.get("server_timeline") or []]
        out.append({"point": label(row, names) or row.label, "hook": row.option("hook"),
                    "phases": phases, "buckets": buckets, "servers": pieces,
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
             ms(entry["comm_ms"]), ms(entry["exposed_ms"]), ms(entry["server_aggregate_ms"]),
             ms(max((piece["answered"][1] for piece in entry["servers"]), default=None))]
            for entry in drawn]
    return tabulate(body, headers=["point", "forward", "backward", "optimizer", "buckets",
                                   "last bucket done", "comm", "exposed", "server aggregate",
                                   "last piece answered"], disable_numparse=True)


def draw(path: str, drawn: list[dict], title: str) -> None:
    """Three lanes a point, top to bottom in the points' order: compute, buckets, servers."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(9.0, 1.0 + 1.2 * len(drawn)))
    ticks, names, labelled = [], [], set()

    def bar(span: list[float], lane: float, kind: str, words: str, **style) -> None:
        axes.broken_barh([(span[0], span[1] - span[0])], (lane, 0.8), color=COLOURS[kind],
                         label=None if kind in labelled else words, **style)
        labelled.add(kind)

    for place, entry in enumerate(drawn):
        base = -place * LANES
        for phase in PHASES:
            bar(entry["phases"][phase], base, phase, phase)
        for bucket in entry["buckets"]:
            bar(bucket["span"], base - 0.9, "bucket", "bucket, handed over to answered",
                alpha=0.6, edgecolor="black", linewidth=0.5)
        for piece in entry["servers"]:
            bar(piece["received"], base - 1.8, "receive", "piece on its server, receiving",
                alpha=0.5)
            bar(piece["answered"], base - 1.8, "answer", "aggregating and answering",
                edgecolor="black", linewidth=0.5)
        lanes = [f"{entry['point']}: compute", "buckets", *(["servers"] if entry["servers"]
                                                             else [])]
        ticks += [base + 0.4, base - 0.5, base - 1.4][:len(lanes)]
        names += lanes
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
