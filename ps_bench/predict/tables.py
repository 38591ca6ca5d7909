"""What ``bench.py predict`` prints and draws: the calibration, the table of predictions with
the measured runs beside them, the winner at each scale and where it changes, and the plot."""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from ps_bench.options import plural
from ps_bench.predict.calibration import Calibration, shown
from ps_bench.plots import pyplot
from ps_bench.results.printed import format_bytes
from ps_bench.strategies import HOOKS


GIB = 2 ** 30
TIE = 0.01  # strategies predicted within 1 % of the fastest tie with it


def winners(rows: list[dict]) -> list[dict]:
    """The fastest strategy (and server count) at each trainer count, and the others that tie
    with it (``tied_with``: within ``TIE`` of its batch time, labelled as ``label`` does); with
    ``--gpu-memory``, of those that fit. A strategy that synchronises nothing (``noop``, the
    compute-only headroom: its replicas drift apart) is shown but never wins."""
    best: dict[int, dict] = {}
    rows = [row for row in rows if row.get("fits") is not False  # one that does not fit: out
            and HOOKS.record(row["strategy"]).transport is not None]
    for row in rows:
        if row["trainers"] not in best or row["batch_ms"] < best[row["trainers"]]["batch_ms"]:
            best[row["trainers"]] = row
    return [{"trainers": n, "strategy": row["strategy"], "servers": row["servers"],
             "batch_ms": row["batch_ms"],
             **({"servers_on": row["servers_on"]} if row.get("servers_on") else {}),
             "tied_with": [label(other) for other in rows
                           if other["trainers"] == n and other is not row
                           and other["batch_ms"] <= row["batch_ms"] * (1 + TIE)]}
            for n, row in sorted(best.items())]


def label(row: dict) -> str:
    """A strategy with its servers, as the winner lines name it."""
    if row["servers"] is None:
        return row["strategy"]
    kind = "colocated server" if row.get("servers_on") == "colocated" else "server"
    return f"{row['strategy']} ({plural(row['servers'], kind)})"


def servers_label(row: dict) -> str:
    if row["servers"] is None:
        return "-"
    return f"{row['servers']}" + (" colocated" if row.get("servers_on") == "colocated" else "")


def describe_calibration(calibration: Calibration, hooks: list[str] | None = None) -> str:
    """What predict calibrated, as printed above its table; of the per-strategy terms, those of
    ``hooks`` (the strategies predicted; None: every one known)."""
    c = calibration.to_dict()
    phases, link = c["phases_ms"], c["link"]
    own = (", ".join(f"{hook} {ms:+.1f} ms" for hook, ms in sorted(c["own_ms"].items())) or
           ("none: it is fitted only from runs whose link is known (made with --limits, or on "
            "an emulated link at --link's rate)" if c["runs"] else "none: no runs given"))
    times = [f"{bucket['ready_ms']:.1f}" for bucket in c["buckets"]]
    ratios = {hook: ratio for hook, ratio in c["payload_ratio"].items()
              if hooks is None or hook in hooks}
    ready = ", ".join(times if len(times) <= 8 else [*times[:4], "...", *times[-2:]])
    return (f"calibration: {c['model']} at batch {c['batch_size']}, from "
            f"{plural(len(c['runs']), 'run')}\n"
            f"  compute: forward {phases['forward']:.1f} ms, backward {phases['backward']:.1f} ms, "
            f"optimizer {phases['optimizer']:.1f} ms; {plural(len(c['buckets']), 'bucket')}, "
            f"{format_bytes(calibration.gradient_bytes)}, "
            f"ready at {ready} ms ({c['overlap_from']})\n"
            f"  link: latency {link['latency_us']:.1f} us, {link['bandwidth_gbit_s']:.3f} Gbit/s "
            f"({link['from']})\n"
            + (f"  a node's local link: latency {c['intra_link']['latency_us']:.1f} us, "
               f"{c['intra_link']['bandwidth_gbit_s']:.3f} Gbit/s ({c['intra_link']['from']})\n"
               if c["intra_link"] else "")
            + f"  each strategy's own compute, from its run: {own} (a strategy without a run: that "
            f"of the one it costs like, ps for ps_fp16 and ps_node; else 0)\n"
            + ("  hook options, as every run of the strategy had them or --hook-option gives them: "
               + "; ".join(f"{hook} {shown(given)}" for hook, given in sorted(c["options"].items()))
               + "\n"
               if c["options"] else "")
            + ("  low-rank payloads, of the float32 gradient's bytes: "
               + ", ".join(f"{hook} {ratio:.2%} ({c['payload_from'][hook]})"
                           for hook, ratio in sorted(ratios.items())) + "\n"
               if ratios else "")
            + ("  parameters gathered again in a step: "
               + ", ".join(f"{hook} {share:.1%}" for hook, share in sorted(c["regathered"].items()))
               + f" ({c['regathered_from']})\n"
               if c["regathered"] else "")
            + ("  sent in, where not float32 (gradients; parameters gathered): "
               + ", ".join(f"{hook} {gradients}" + (f"; {parameters}" if parameters != gradients
                                                     else "")
                           for hook, (gradients, parameters) in sorted(c["wires"].items()))
               + "\n" if c["wires"] else "")
            + "".join(f"  note: {note}\n" for note in c["notes"]))



def render(rows: list[dict]) -> str:
    best = {(w["trainers"], w["strategy"], w["servers"], w.get("servers_on"))
            for w in winners(rows)}
    nodes = any(row.get("per_node", 1) > 1 for row in rows)
    held = any("model_states_bytes" in row for row in rows)
    fits = any("fits" in row for row in rows)
    failing = any("ettr" in row for row in rows)
    mfu = any("mfu" in row for row in rows)
    body = [[*([f"{row['nodes']} x {row['per_node']}"] if nodes else []), row["trainers"],
             row["strategy"], servers_label(row),
             f"{row['batch_ms']:.1f}",
             f"{row['samples_per_s']:.0f}" if row["samples_per_s"] else "-",
             "-" if row["measured_ms"] is None else f"{row['measured_ms']:.1f}",
             ("-" if row["error_pct"] is None else
              f"{row['error_pct']:+.1f}" + (" (cal.)" if row.get("calibration") else "")),
             "-" if row.get("byteps_bound_ms") is None else f"{row['byteps_bound_ms']:.1f}",
             "*" if (row["trainers"], row["strategy"], row["servers"],
                     row.get("servers_on")) in best else "",
             *(memory_cells(row) if held else []),
             *(goodput_cells(row) if failing else []),
             *([f"{row['mfu']:.1%}"] if mfu else [])]
            for row in rows]
    return tabulate(body, headers=[*(["nodes x G"] if nodes else []), "trainers", "strategy",
                                   "servers", "batch ms", "samples/s", "measured ms",
                                   "error %", "BytePS bound ms", "best",
                                   *(["states GiB", "memory GiB"] if held else []),
                                   *(["fits"] if fits else []),
                                   *(["goodput/s", "ETTR", "checkpoint every"]
                                     if failing else []), *(["MFU"] if mfu else [])],
                    disable_numparse=True) + (
        "\nBytePS bound: the least any parameter-server layout with that many servers needs to "
        "move the gradients (communication only)") + (
        "\nstates: parameters, gradients, optimizer state and gathered layers a GPU holds; "
        "memory: with the activations and what the strategy keeps between iterations (error "
        "feedback's residuals, PowerSGD's state)" if held else "") + (
        "; NO: does not fit --gpu-memory (never the best); recomputing: fits only with its "
        "--activation-checkpointing" if fits else "") + (
        "\ngoodput: the samples a second training keeps under failures (ETTR: the share of wall "
        "time it keeps); checkpoint every: the interval of work between checkpoints, where the "
        "strategy restarts from one" if failing else "") + (
        "\nMFU: the model's FLOPs a second a GPU (three times its forward's, counted on the meta "
        "device) over --peak-tflops" if mfu else "")


def goodput_cells(row: dict) -> list[str]:
    interval = row.get("checkpoint_interval_s")
    return [f"{row['goodput_samples_per_s']:.0f}", f"{row['ettr']:.3f}",
            "-" if interval is None else minutes(interval)]


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def gib(nbytes: float) -> str:
    """GiB to a tenth, or to three figures below a tenth (a small model's 0.000171, not 0.0)."""
    value = nbytes / GIB
    return f"{value:.1f}" if value >= 0.1 or value == 0 else f"{value:.3g}"


def memory_cells(row: dict) -> list[str]:
    """A row's model states and memory, GiB, and whether it fits (where asked)."""
    total = row.get("memory_bytes")
    return [gib(row["model_states_bytes"]), "-" if total is None else gib(total),
            *([] if "fits" not in row else [
                "NO" if not row["fits"] else
                "yes, recomputing" if row.get("fits_only_recomputing") else "yes"])]


ETHERNET_CHECKED_NODES = 4  # benchmarks/published_check.py: every point from here up was slower


def ethernet_note(kind: str | None, rows: list[dict]) -> str | None:
    """A line where ``--link`` is Ethernet and rows have 4 nodes or more: every published
    cluster of that kind and size predict was checked against ran slower than predicted
    (``benchmarks/published_check.py`` says whether that still holds), so those rows are what
    the links allow, not a forecast."""
    far = sorted({row["nodes"] for row in rows if row["nodes"] >= ETHERNET_CHECKED_NODES})
    if kind != "ethernet" or not far:
        return None
    return (f"note: every published cluster of {ETHERNET_CHECKED_NODES} nodes or more over "
            f"Ethernet (TCP) that predict was checked against ran slower than predicted "
            f"(benchmarks/published_check.py, docs/predict.md): read the rows of "
            f"{', '.join(map(str, far))} nodes as what the links allow, not as a forecast "
            f"(--link-kind ethernet, the default: give infiniband or roce for an RDMA network)")


def render_winners(best: list[dict], why_none: str = "no strategy fits --gpu-memory") -> str:
    """The winner at each trainer count ("tie: a, b" within 1 %), and where the winners change:
    a crossover between two counts whose winners (and those tied with them) have none in common."""
    def named(w: dict) -> str:
        return f"tie: {', '.join([label(w), *w['tied_with']])}" if w["tied_with"] else label(w)

    def strategies(w: dict) -> set[str]:
        return {w["strategy"], *(tied.split(" (")[0] for tied in w["tied_with"])}

    lines = ["", "winner per trainer count: " +
             (", ".join(f"{w['trainers']}: {named(w)}" for w in best)
              or f"none: {why_none}")]
    for before, after in zip(best, best[1:]):
        if not strategies(before) & strategies(after):
            lines.append(f"crossover: {' and '.join(sorted(strategies(before)))} "
                         f"{'tie' if len(strategies(before)) > 1 else 'wins'} at "
                         f"{before['trainers']} trainers, "
                         f"{' and '.join(sorted(strategies(after)))} "
                         f"{'tie' if len(strategies(after)) > 1 else 'win'} at "
                         f"{after['trainers']}".replace(" win at", " at"))
    return "\n".join(lines)


def plot_series(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows as the plot's lines, one point a trainer count each: a strategy, with its server
    count (or the best, ``--servers auto``) where it has servers, and where they run."""
    series: dict[str, list[dict]] = {}
    for row in rows:
        colocated = "colocated " if row.get("servers_on") == "colocated" else ""
        name = (row["strategy"] if row["servers"] is None else
                f"{row['strategy']} (best {colocated}servers)" if row.get("auto") else label(row))
        series.setdefault(name, []).append(row)
    return series


def plot(path: str, rows: list[dict], calibration: Calibration) -> None:
    plt = pyplot("predict")
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, members in plot_series(rows).items():
        axes.plot([r["trainers"] for r in members], [r["batch_ms"] for r in members], marker="o",
                  label=name)
        measured_points = [(r["trainers"], r["measured_ms"]) for r in members
                           if r["measured_ms"] is not None]
        if measured_points:
            axes.scatter(*zip(*measured_points), marker="x", color=axes.lines[-1].get_color())
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("trainers")
    axes.set_ylabel("batch ms (predicted; x measured)")
    link = calibration.to_dict()["link"]
    axes.set_title(f"{calibration.model}, batch {calibration.batch_size}: "
                   f"{link['bandwidth_gbit_s']:.3g} Gbit/s, {link['latency_us']:.3g} us")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
