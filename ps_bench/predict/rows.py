"""The rows of ``bench.py predict``: each strategy at each trainer count and, for parameter
servers, each server count and place, with the given runs of the same point beside it."""

from __future__ import annotations

from ps_bench.metrics import costs
from ps_bench.options import plural
from ps_bench.predict.calibration import Calibration
from ps_bench.predict.predictor import at_options, predict
from ps_bench.predict.runs import Run
from ps_bench.config import ConfigError
from ps_bench.registry import UnknownNameError
from ps_bench.strategies import HOOKS, RPC


DEFAULT_HOOKS = ("allreduce", "ps", "fp16")  # predicted where --hooks is not given

def server_counts(n: int) -> list[int]:
    """The server counts ``auto`` tries at ``n`` trainers: powers of two up to n, and n."""
    return sorted({2 ** i for i in range(n.bit_length())} | {n})


def colocated_counts(servers: list[int | str], nodes: int) -> tuple[list[int], list[int]]:
    """Of the server counts given, those ``nodes`` nodes can hold co-located (as many on each,
    at least one), and those they cannot."""
    explicit = [k for k in servers if k != "auto"]
    fit = sorted({k for k in explicit if k >= nodes and k % nodes == 0})
    return fit, sorted({k for k in explicit if k not in fit})


def unplaced(servers: list[int | str], trainers: list[int], per_node: int) -> str | None:
    """A line naming the node counts that cannot hold a given server count co-located, and what
    their rows predict instead (the counts they can hold, else auto's best, else one server a
    node); None where all can."""
    left = {}
    for n in trainers:
        fit, dropped = colocated_counts(servers, n // per_node)
        if dropped:
            left[n // per_node] = (dropped, fit)
    if not left:
        return None
    instead = "auto's best" if "auto" in servers else None
    return "--servers-on colocated places as many servers on every node: " + "; ".join(
        f"{plural(nodes, 'node')} cannot hold {', '.join(map(str, dropped))} (predicted with "
        f"{', '.join(map(str, fit)) if fit else instead or nodes})"
        for nodes, (dropped, fit) in sorted(left.items()))


def prediction_rows(calibration: Calibration, hooks: list[str], trainers: list[int],
                    servers: list[int | str], mapping: str, link_bps: float | None,
                    compared: list[Run] = (), per_node: int = 1,
                    servers_on: list[str] = ("dedicated",)) -> list[dict]:
    """One row per strategy, trainer count and (parameter-server strategies) server count; with
    ``auto``, the server count of the shortest predicted batch is added, marked ``auto`` (1, 2,
    4, ... up to the trainers; co-located, 1, 2, 4, ... up to the trainers a node on each node);
    with servers ``colocated``, a row for each server count given that the nodes can share
    evenly (one a node when none is and no ``auto``)."""
    rows = []
    explicit = [k for k in servers if k != "auto"]

    def row(hook, n, k, place="dedicated"):
        return row_of(calibration, hook, n, k, mapping, link_bps, compared, per_node, place)

    for n in trainers:
        for hook in hooks:
            if HOOKS.record(hook).transport != RPC:
                rows.append(row(hook, n, None))
                continue
            for place in servers_on:
                nodes = n // per_node
                if place == "dedicated":
                    counts, tried = explicit, server_counts(n)
                else:  # as many on each node: one a node where no count given fits, or auto
                    counts = (colocated_counts(explicit, nodes)[0]
                              or ([] if "auto" in servers else [nodes]))
                    tried = [nodes * m for m in server_counts(per_node)]
                # each count predicted once, whether given, tried by auto or both
                made = {k: row(hook, n, k, place) for k in
                        dict.fromkeys([*counts, *(tried if "auto" in servers else [])])}
                predicted = {k: made[k] for k in counts}
                if "auto" in servers:
                    best = min((made[k] for k in tried), key=lambda r: r["batch_ms"])
                    if best["servers"] not in predicted:
                        predicted[best["servers"]] = {**best, "auto": True}
                rows.extend(r for _, r in sorted(predicted.items()))
    return rows


def row_of(calibration: Calibration, hook: str, n: int, k: int | None, mapping: str,
           link_bps: float | None, compared: list[Run], per_node: int = 1,
           servers_on: str = "dedicated") -> dict:
    predicted = predict(calibration, hook, n, k or 0, mapping, per_node=per_node,
                        servers_on=servers_on)
    row = {"strategy": hook, "trainers": n, "nodes": n // per_node, "per_node": per_node,
           "servers": k, **({"servers_on": servers_on} if k else {}), **predicted,
           **measured(calibration, compared, hook, n, k or 0, mapping, link_bps,
                      predicted["batch_ms"], per_node, servers_on)}
    # the best any parameter-server layout could do with its extra servers (BytePS sums within a
    # node first)
    if k:
        row["byteps_bound_ms"] = costs.byteps_bound_ms(n // per_node,
                                                        0 if servers_on == "colocated" else k,
                                                        calibration.gradient_bytes,
                                                        calibration.link)
    return row


def measured(calibration: Calibration, compared: list[Run], hook: str, n: int, k: int,
             mapping: str, link_bps: float | None, predicted_ms: float, per_node: int = 1,
             servers_on: str = "dedicated") -> dict:
    """The given runs of this point (same strategy and hook options, trainers, trainers per
    host, servers and their place, network, micro-batches a step, precision): their iteration
    (``Run.batch_ms``), the prediction's error against it, and whether one of them calibrated
    the strategy's own compute (then the error is about 0 by construction)."""
    uses_servers = HOOKS.record(hook).transport == RPC
    matches = [run for run in at_options([*calibration.runs, *compared], calibration)
               if run.hook == hook and run.trainers == n and run.per_host == per_node
               and (not uses_servers or (run.servers == k and run.mapping == mapping
                                         and run.servers_on == servers_on))
               and (link_bps is None or run.link_rate_bps == link_bps)
               and run.grad_accum == calibration.micro_batches
               and run.precision == calibration.precision]
    if not matches:
        return {"measured_ms": None, "error_pct": None}
    value = sorted(run.batch_ms for run in matches)[len(matches) // 2]
    return {"measured_ms": value, "error_pct": (predicted_ms - value) / value * 100.0,
            "runs": [run.path for run in matches],
            "calibration": any(run in calibration.runs for run in matches)}


def strategy(name: str, flag: str) -> str:
    """A strategy's registered name for ``name`` (a name or alias), or a ConfigError as a run's
    ``--hook`` gives (with "did you mean")."""
    try:
        return HOOKS.canonical(name.strip())
    except UnknownNameError as error:
        raise ConfigError(f"{flag}: {error}") from None


def strategies(text: str) -> list[str]:
    """``--hooks``' strategies by their registered names."""
    return [strategy(name, "--hooks") for name in text.split(",")]


def choose_hooks(text: str | None, runs: list[Run], calibration: Calibration,
                 per_node: int = 1) -> list[str]:
    """The strategies to predict: ``--hooks``, else the runs' and the defaults (and, on nodes of
    several trainers, ``ps_node`` beside ``ps``)."""
    if text is None:
        defaults = ([*DEFAULT_HOOKS[:2], "ps_node", *DEFAULT_HOOKS[2:]] if per_node > 1
                    else list(DEFAULT_HOOKS))
        names = list(dict.fromkeys([run.hook for run in runs] + defaults))
        return [name for name in names if predict(calibration, name, 2, 1) is not None]
    hooks = []
    for hook in strategies(text):
        if predict(calibration, hook, 2, 1) is None:
            raise ConfigError(f"--hooks: {hook} sends low-rank factors whose size depends on the "
                              f"layers' shapes, which these results files do not record: give "
                              f"a run of {hook} to calibrate it")
        hooks.append(hook)
    return list(dict.fromkeys(hooks))
