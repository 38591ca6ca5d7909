"""Predicts the goodput of each point of a failures sweep (``configs/sweeps/failures.json``) that
drew failures, from its own strategy's failure-free point and its own measured recovery, with
``predict``'s restart model (``ps_bench.predict.goodput``), and sets it against the goodput the
point measured.

For a point that restarts from its checkpoints: the failure-free point's goodput (its committed
samples over its wall time: start-up and checkpoint saves included) times the share of time
Daly's model keeps under failures, over the share it keeps without them: ``restart_ettr(τ, δ,
R, M) (τ + δ) / τ``, with τ the checkpoint interval (``checkpoint_every`` iterations at the
failure-free point's pace), δ that point's p50 save, R the median recovery (failure to training
again) of the failing point's own failures, M the point's ``--mtbf``. For a point whose groups
heal (torchft's): ``heal_ettr``, each failure costing every group the step in flight and one
group its restart and heal. Nothing is fitted; a point whose trainers are dropped for good
(``--trainer-timeout``, ``--staleness``) has no such model and is shown measured only.

    python bench.py sweep configs/sweeps/failures.json --out results/sweeps/failures
    python benchmarks/goodput_sweep_check.py results/sweeps/failures
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ps_bench.predict.goodput import heal_ettr, restart_ettr  # noqa: E402
from ps_bench.runtime.faults import parse_duration  # noqa: E402
from ps_bench.strategies.hook_options import hook_options  # noqa: E402


def healed(free: dict, failing: dict) -> tuple[float | None, str]:
    """A point whose groups heal (torchft's): each failure costs every group the step in flight
    and one of the groups its restart and heal (``heal_ettr``), with R the median of the point's
    own failures to first commit and the step its period of iterations at the failure-free pace."""
    cfg, good = failing["config"], free["recovery"]["goodput"]
    recoveries = [group["recovery_s"] for group in failing["recovery"]["groups_healed"]
                  if group.get("recovery_s")]
    if not recoveries:
        return None, "no heal measured"
    throughput = free["throughput"]
    iteration_s = throughput["samples_per_iteration"] / throughput["samples_per_s"]
    step_s = hook_options(cfg["hook"], cfg.get("hook_options") or {})["period"] * iteration_s
    restart_s, mtbf_s = statistics.median(recoveries), parse_duration(cfg["mtbf"])
    kept = heal_ettr(restart_s, 0.0, cfg["ntrainer"], step_s, mtbf_s)
    return good["samples_per_s"] * kept, (f"step {step_s:.3f} s, R {restart_s:.1f} s, "
                                          f"{cfg['ntrainer']} groups, M {mtbf_s:g} s")


def predicted(free: dict, failing: dict) -> tuple[float | None, str]:
    """The failing point's goodput as its failure-free twin and its own recovery predict it."""
    if (failing.get("recovery") or {}).get("groups_healed"):
        return healed(free, failing)
    cfg, good = failing["config"], free["recovery"]["goodput"]
    every = cfg.get("checkpoint_every")
    recoveries = [f["recovery_s"] for f in failing["recovery"].get("failures", [])
                  if f.get("recovery_s")]
    if every is None or not recoveries:
        return None, "no restart model" if every is None else "no failure measured"
    throughput = free["throughput"]
    iterations_per_s = throughput["samples_per_s"] / throughput["samples_per_iteration"]
    tau = every / iterations_per_s
    delta = free["recovery"]["checkpoints"]["save_s_p50"] or 0.0
    restart_s = statistics.median(recoveries)
    mtbf_s = parse_duration(cfg["mtbf"])
    kept = restart_ettr(tau, delta, restart_s, mtbf_s) * (tau + delta) / tau
    return good["samples_per_s"] * kept, (f"τ {tau:.2f} s, δ {delta:.3f} s, R {restart_s:.1f} s, "
                                          f"M {mtbf_s:g} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="the failures sweep's folder (its results.jsonl)")
    args = parser.parse_args()
    read = [json.loads(line) for line in
            (Path(args.sweep) / "results.jsonl").read_text().splitlines() if line.strip()]
    # a point run again (``sweep --resume`` after a change to it): its latest line
    lines = list({(line["point"]["overrides"].get("variant"), line["config"].get("mtbf")): line
                  for line in read}.values())
    free = {line["point"]["overrides"].get("variant"): line for line in lines
            if line["config"].get("mtbf") is None and line["status"] == "ok"}
    rows, errors = [], []
    for line in lines:
        if line["config"].get("mtbf") is None:
            continue
        variant = line["point"]["overrides"].get("variant")
        recovery = line.get("recovery") or {}
        good = recovery.get("goodput") or {}
        measured = good.get("samples_per_s")
        failures = sum(len(recovery.get(key) or []) for key in ("failures", "trainers_dropped"))
        if not failures:  # none drawn within the job: nothing to predict
            forecast, inputs = None, "no failure drawn"
        elif variant in free and measured:
            forecast, inputs = predicted(free[variant], line)
        else:
            forecast, inputs = None, "no failure-free point"
        error = forecast / measured - 1 if forecast and measured else None
        if error is not None:
            errors.append(abs(error))
        rows.append([variant, line["config"]["mtbf"], line["status"], failures,
                     f"{measured:.0f}" if measured else "-",
                     f"{forecast:.0f}" if forecast else "-",
                     f"{error:+.1%}" if error is not None else "-", inputs])
    print(tabulate(rows, headers=["strategy", "mtbf", "status", "failures", "measured goodput/s",
                                  "predicted goodput/s", "error", "inputs"]))
    if errors:
        print(f"{len(errors)} points predicted: median error {statistics.median(errors):.1%}, "
              f"largest {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
