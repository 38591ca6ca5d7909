"""Predicts the goodput of each strategy of a failures sweep (``configs/sweeps/failures.json``)
at each failure rate, from its own failure-free points and its own measured recoveries, with
``predict``'s models (``ps_bench.predict.goodput``), and sets it against the goodput measured.

A rate's measured goodput is the mean over its points' seeds (``torch_seed``: each draws its own
schedule), those that drew no failure included: predict's goodput is an expectation, and one
run draws a handful of failures, so the mean carries its standard error. One seed
(``failures.json``) sets one draw against it; ``failures_seeds.json`` runs the restarting
strategies over five seeds.

For points that restart from their checkpoints: the failure-free points' goodput (committed
samples over wall time: start-up and checkpoint saves included) times the share of time Daly's
model keeps under failures, over the share it keeps without them: ``restart_ettr(τ, δ, R, M)
(τ + δ) / τ``, with τ the checkpoint interval (``checkpoint_every`` iterations at the
failure-free pace), δ those points' median p50 save, R the median recovery (failure to
training again) of the failing points' own failures, M the points' ``--mtbf``. For points whose
groups heal (torchft's): ``heal_ettr``, each failure costing every group the step in flight and
one group its restart and heal. Nothing is fitted; a point whose trainers are dropped for good
(``--trainer-timeout``, ``--staleness``) has no such model and is shown measured only.

    python bench.py sweep configs/sweeps/failures_seeds.json --out results/sweeps/failures_seeds
    python benchmarks/goodput_sweep_check.py results/sweeps/failures_seeds
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
from ps_bench.results.recovery import failures_in  # noqa: E402
from ps_bench.runtime.faults import parse_duration  # noqa: E402
from ps_bench.strategies.hook_options import hook_options  # noqa: E402


def pace(free: list[dict]) -> tuple[float, float]:
    """The failure-free points' goodput and iterations a second (means over their seeds)."""
    goodput = statistics.fmean(line["recovery"]["goodput"]["samples_per_s"] for line in free)
    iterations_per_s = statistics.fmean(
        line["throughput"]["samples_per_s"] / line["throughput"]["samples_per_iteration"]
        for line in free)
    return goodput, iterations_per_s


def healed(free: list[dict], failing: list[dict]) -> tuple[float | None, str]:
    """Points whose groups heal (torchft's): each failure costs every group the step in flight
    and one of the groups its restart and heal (``heal_ettr``), with R the median of the points'
    own failures to first commit and the step its period of iterations at the failure-free
    pace."""
    cfg = failing[0]["config"]
    recoveries = [group["recovery_s"] for line in failing
                  for group in (line.get("recovery") or {}).get("groups_healed") or []
                  if group.get("recovery_s")]
    if not recoveries:
        return None, "no heal measured"
    good, iterations_per_s = pace(free)
    step_s = hook_options(cfg["hook"], cfg.get("hook_options") or {})["period"] / iterations_per_s
    restart_s, mtbf_s = statistics.median(recoveries), parse_duration(cfg["mtbf"])
    kept = heal_ettr(restart_s, 0.0, cfg["ntrainer"], step_s, mtbf_s)
    return good * kept, (f"step {step_s:.3f} s, R {restart_s:.1f} s, {cfg['ntrainer']} groups, "
                         f"M {mtbf_s:g} s")


def predicted(free: list[dict], failing: list[dict]) -> tuple[float | None, str]:
    """The failing points' goodput as their failure-free twins and their own recoveries predict
    it."""
    if any((line.get("recovery") or {}).get("groups_healed") for line in failing):
        return healed(free, failing)
    cfg = failing[0]["config"]
    every = cfg.get("checkpoint_every")
    recoveries = [failure["recovery_s"] for line in failing
                  for failure in (line.get("recovery") or {}).get("failures") or []
                  if failure.get("recovery_s")]
    if every is None or not recoveries:
        return None, "no restart model" if every is None else "no failure measured"
    good, iterations_per_s = pace(free)
    tau = every / iterations_per_s
    delta = statistics.median(line["recovery"]["checkpoints"]["save_s_p50"] or 0.0
                              for line in free)
    restart_s = statistics.median(recoveries)
    mtbf_s = parse_duration(cfg["mtbf"])
    kept = restart_ettr(tau, delta, restart_s, mtbf_s) * (tau + delta) / tau
    return good * kept, f"τ {tau:.2f} s, δ {delta:.3f} s, R {restart_s:.1f} s, M {mtbf_s:g} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", help="the failures sweep's folder (its results.jsonl)")
    args = parser.parse_args()
    read = [json.loads(line) for line in
            (Path(args.sweep) / "results.jsonl").read_text().splitlines() if line.strip()]
    # a point run again (``sweep --resume`` after a change to it): its latest line
    lines = {(line["point"]["overrides"].get("variant"), line["config"].get("mtbf"),
              line["config"].get("torch_seed")): line for line in read}
    groups: dict[tuple, list[dict]] = {}  # a strategy at a rate: its points over the seeds
    for (variant, mtbf, _), line in lines.items():
        if line["status"] == "ok" or mtbf is not None:
            groups.setdefault((variant, mtbf), []).append(line)
    rows, errors = [], []
    for (variant, mtbf), failing in groups.items():
        if mtbf is None:
            continue
        free = groups.get((variant, None), [])
        measured = [(line.get("recovery") or {}).get("goodput", {}).get("samples_per_s")
                    for line in failing]
        measured = [value for value in measured if value]
        failures = sum(failures_in(line.get("recovery") or {}) for line in failing)
        mean = statistics.fmean(measured) if measured else None
        spread = (statistics.stdev(measured) / len(measured) ** 0.5 if len(measured) > 1
                  else None)
        if not failures:  # none drawn within the jobs: nothing to predict
            forecast, inputs = None, "no failure drawn"
        elif free and mean:
            forecast, inputs = predicted(free, failing)
        else:
            forecast, inputs = None, "no failure-free point"
        error = forecast / mean - 1 if forecast and mean else None
        if error is not None:
            errors.append(abs(error))
        rows.append([variant, mtbf, len(failing), failures,
                     (f"{mean:.0f}" + (f" ± {spread:.0f}" if spread else "")) if mean else "-",
                     f"{forecast:.0f}" if forecast else "-",
                     f"{error:+.1%}" if error is not None else "-", inputs])
    print(tabulate(rows, headers=["strategy", "mtbf", "runs", "failures",
                                  "measured goodput/s (± s.e.)", "predicted goodput/s", "error",
                                  "inputs"]))
    if errors:
        print(f"{len(errors)} points predicted: median error {statistics.median(errors):.1%}, "
              f"largest {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
