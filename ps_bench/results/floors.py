"""``--limits`` in the results: the floors a run measured (``ps_bench.metrics.limits``), and the
strategy's efficiency against the floor of what it sends.

A strategy's floor is the raw transfer of what it puts on the wire, measured in the same job by
the same processes: its DDP buckets over its transport (float32, or its own messages where it
compresses), plus its own steps besides the buckets, each collective it issues on the group it
issues it on (``Synchroniser.floor_steps``: FSDP2's gathers and scatter, ZeRO's broadcast,
DeepSpeed's all-reduce and all-gather, local SGD's and DiLoCo's all-reduce once a period, HSDP's
and hierarchical all-reduce's steps within and across hosts). Efficiency is the floor over the
time the strategy had a bucket or a collective open: 1.0 means it costs no more than moving its
bytes. Per collective, the floor of that collective over the time its calls were open. A
strategy that synchronises once a period is held per iteration, its floor amortised and its cost
the mean over iterations (the typical iteration sends nothing).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ps_bench.metrics import limits as measure
from ps_bench.metrics.messages import answered_bytes, message_bytes
from ps_bench.strategies import hook_options
from ps_bench.strategies.record import calls_per_iteration

STEP = "step_"  # floor samples of a strategy's own steps: step_<collective>_ms, step_total_ms


def limits(record: Any) -> dict | None:
    """The floors' statistics over every round's samples, pooled over trainers, and memcpy;
    None until the memcpy floor is in (``--limits``, once the rounds are over)."""
    samples = record.floor_samples
    if record.floor_messages is None or record.memcpy is None:
        return None
    per_iteration = message_bytes(record.floor_messages)
    strategy, trainers = record.strategy, record.topology.num_trainers
    own = None
    if record.own_messages is not None and samples["own_ms"]:
        own_bytes = message_bytes(record.own_messages)
        own = {**measure.floor_summary(samples["own_ms"], own_bytes,
                                       world=trainers if strategy.floor == "collective" else None,
                                       gathered_bytes=gathered_bytes(record, record.own_messages)),
               "transport": strategy.floor, "bytes_per_iter": own_bytes,
               "answered_bytes_per_iter": answered_bytes(record.own_messages),
               "messages": {str(index): parts for index, parts in record.own_messages.items()}}
    return {
        "bytes_per_iter": per_iteration,
        "buckets": len(record.floor_messages),
        "rpc": ({**measure.floor_summary(samples["rpc_ms"], per_iteration),
                 "tensors": "cuda" if record.topology.rpc_on_gpu else "cpu"}
                if samples["rpc_ms"] else None),
        "collective": {**measure.floor_summary(
                           samples["collective_ms"], per_iteration, world=trainers,
                           gathered_bytes=gathered_bytes(record, record.floor_messages)),
                       "backend": record.config.backend,
                       "all_gathered": list(record.floor_gathered)},
        "own": own,
        "steps": steps(record),
        "memcpy": record.memcpy,
        "link": measure.link_summary(
            {int(kind[5:]): values for kind, values in samples.items() if kind.startswith("link_")},
            "allreduce" if trainers > 1 else "rpc", trainers),
        "compute": {"count": len(samples["compute_ms"]),
                    "p50_ms": float(np.median(samples["compute_ms"]))},
    }


def gathered_bytes(record: Any, messages: dict[int, list[tuple[int, str]]]) -> int:
    """The bytes of ``messages`` that collective floors all-gather: the sparse buckets'."""
    return message_bytes({index: parts for index, parts in messages.items()
                          if index in record.floor_gathered})


def periods(record: Any) -> dict[str, float]:
    """Each collective of the record's ``sends`` -> how many iterations one of its calls serves
    (a period's; a fraction for one made every micro-batch of ``--grad-accum``)."""
    period = hook_options(record.config.hook, record.config.hook_options).get("period", 1)
    micro = getattr(record.config, "grad_accum", 1)
    return {collective: 1.0 / calls_per_iteration(per, period, micro)
            for collective, per in record.strategy.sends}


def steps(record: Any) -> dict | None:
    """The floor of the strategy's own steps: per collective (its samples' count, p50 and p90 ms,
    and how many iterations one serves) and per iteration (each collective's p50 over its period,
    summed); None without any."""
    samples = record.floor_samples
    kinds = sorted(key[len(STEP):-3] for key in samples
                   if key.startswith(STEP) and key != f"{STEP}total_ms")
    if not kinds:
        return None
    serves = periods(record)
    collectives = {kind: {"count": len(samples[f"{STEP}{kind}_ms"]),
                          "p50_ms": float(np.median(samples[f"{STEP}{kind}_ms"])),
                          "p90_ms": float(np.percentile(samples[f"{STEP}{kind}_ms"], 90)),
                          "iterations": serves.get(kind, 1)}
                   for kind in kinds}
    return {"collectives": collectives, "p50_ms": float(np.median(samples[f"{STEP}total_ms"])),
            "per_iter_ms": sum(entry["p50_ms"] / entry["iterations"]
                               for entry in collectives.values())}


def efficiency(record: Any, floors: dict) -> dict | None:
    """The strategy's floor over its cost (see the module), and the float32 floor over the same
    cost; per collective of its own steps, that collective's floor over the time its calls were
    open (None for strategies that move nothing)."""
    strategy, own_steps = record.strategy, floors.get("steps")
    rows = {r.metric: r for r in record.rows() if r.role == "trainer" and r.unit == "ms"}
    if "comm" not in rows or (strategy.floor is None and own_steps is None):
        return None
    # a hook whose own steps are the whole of what it sends: hierarchical's collectives on its
    # groups, the compressors' all-gathers
    steps_only = not strategy.needs_servers and (strategy.per_host
                                                 or strategy.payload == "compressed")
    buckets = ((floors["own"] or floors.get(strategy.floor))
               if strategy.hook_sends and not steps_only else None)
    steps = (own_steps or {}).get("collectives", {}).values()
    period = max((entry["iterations"] for entry in steps), default=1)
    periodic = period > 1
    cost = rows["comm"].mean if periodic else rows["comm"].p50
    # fewer timed iterations a trainer than the period: its synchronisations are not amortised
    timed = record.collective_iterations // max(1, record.topology.num_trainers)
    floor_ms = ((buckets["p50_ms"] if buckets else 0.0) +
                (own_steps["per_iter_ms"] if own_steps else 0.0))
    uncompressed = floors.get(strategy.floor) if strategy.floor else None
    exposed_ms = max(0.0, rows["batch"].p50 - floors["compute"]["p50_ms"])
    out = {"floor": strategy.floor or "collective",
           "floor_of": ("its own steps" if not buckets
                        else "its buckets and its own steps" if own_steps
                        else "its own messages" if floors["own"] else "its float32 buckets"),
           "floor_ms": floor_ms, "cost": f"trainer comm {'mean' if periodic else 'p50'}",
           "cost_ms": cost,
           "value": measure.efficiency(floor_ms, cost) if timed >= period else None,
           "exposed_ms": exposed_ms, "exposed_value": measure.efficiency(floor_ms, exposed_ms),
           "float32_floor_ms": uncompressed["p50_ms"] if uncompressed else None,
           "gain_over_float32": (measure.efficiency(uncompressed["p50_ms"], cost)
                                 if uncompressed and (buckets or strategy.payload == "compressed")
                                 else None)}
    if periodic:
        out.update(period=period, timed_iterations=timed)
    if own_steps:
        spent = ({kind: ms / record.collective_iterations
                  for kind, ms in record.collective_ms.items()}
                 if record.collective_iterations else {})
        out["collectives"] = {kind: {"floor_ms": entry["p50_ms"] / entry["iterations"],
                                     "measured_ms": spent.get(kind),
                                     "value": measure.efficiency(
                                         entry["p50_ms"] / entry["iterations"], spent.get(kind))}
                              for kind, entry in own_steps["collectives"].items()}
    return out
