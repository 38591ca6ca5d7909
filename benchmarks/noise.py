"""The harness's own noise on this machine, an A/A test: the same command N times (a sweep of one
point with ``"repeat": N``), then how often ``bench.py compare`` calls two groups of those runs
significantly different at the default threshold, when nothing differs but the time they ran.

Runs are split, in the order they ran, into disjoint pairs of 3 against the next 3 (interval
from the runs, the way ``compare`` is meant to be used) and into disjoint pairs of 1 against
the next 1 (interval from the iterations within the runs alone). For each, the fraction of pairs
called faster or slower, per metric and for any metric. A 95 % interval promises at most 5 %
per metric; the threshold lowers it further.
Runs already in the output folder are reused (delete it to measure again; a larger --runs adds
only the missing ones).

    python benchmarks/noise.py [--runs 120] [--out results/noise] [-- run options, e.g. --hook allreduce]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ps_bench.cli import build_parser  # noqa: E402
from ps_bench.compare import DEFAULT_THRESHOLD_PCT, METRICS, Run, Side, compare_sides  # noqa: E402
from ps_bench.options import parse_run_options  # noqa: E402
from ps_bench.results.files import RESULTS_NAME  # noqa: E402
from ps_bench.results.load import load_lines  # noqa: E402


def make_runs(out: Path, runs: int, options: dict) -> list[Run]:
    """The sweep's successful runs, in the order they ran (the sweep resumes: present ones are kept)."""
    sweep = out / "noise.json"
    sweep.write_text(json.dumps({"name": "noise", "base": options, "variants": [{"name": "same command"}],
                                 "repeat": runs}, indent=2))
    done = subprocess.run([sys.executable, str(ROOT / "bench.py"), "sweep", str(sweep), "--out", str(out / "runs"),
                           "--resume"], cwd=ROOT)
    if done.returncode not in (0, 1):
        sys.exit(f"noise: the sweep stopped (exit {done.returncode})")
    lines = [line for line in load_lines(out / "runs" / RESULTS_NAME) if line.get("status") == "ok"]
    latest = {line["point"]["repeat"]: line for line in lines}  # a repeat re-run after a failure: its latest line
    return [Run(f"run {repeat}", latest[repeat]) for repeat in sorted(latest)]


def rates(runs: list[Run], per_side: int, threshold_pct: float) -> tuple[int, dict[str, int], int]:
    """Pairs of ``per_side`` runs against the next ``per_side``, disjoint: how many pairs, and how
    many were called significant per metric and for any metric."""
    pairs = len(runs) // (2 * per_side)
    called = {metric.name: 0 for metric in METRICS}
    any_metric = 0
    for pair in range(pairs):
        start = 2 * per_side * pair
        base = Side("base", f"runs {start + 1}-{start + per_side}", "runs", runs[start:start + per_side])
        new = Side("new", f"runs {start + per_side + 1}-{start + 2 * per_side}", "runs",
                   runs[start + per_side:start + 2 * per_side])
        significant = {row.metric.name for row in compare_sides(base, new, threshold_pct=threshold_pct).rows
                       if row.significant}
        for name in significant:
            called[name] += 1
        any_metric += bool(significant)
    return pairs, called, any_metric


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=120, help="how many runs of the command (default 120)")
    parser.add_argument("--out", default=str(ROOT / "results" / "noise"), help="folder for the runs")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD_PCT,
                        help=f"compare's --threshold, %% (default {DEFAULT_THRESHOLD_PCT:g})")
    own = sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
    run_argv = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    args = parser.parse_args(own)
    options, config_path = parse_run_options(run_argv, build_parser())
    if config_path:
        sys.exit("noise: give the run's options on the command line, not --config")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"noise: {args.runs} runs of bench.py {' '.join(run_argv) or '(the default job)'}", flush=True)
    runs = make_runs(out, args.runs, options)
    if len(runs) < 6:
        sys.exit(f"noise: {len(runs)} successful runs; 3 vs 3 needs at least 6")
    print(f"\n{len(runs)} runs from {runs[0].results['started']} to {runs[-1].results['finished']}, torch "
          f"{runs[0].results['env']['torch']} on {runs[0].results['env']['hostname']} ({os.cpu_count()} cores); "
          f"threshold {args.threshold:g} %")
    print(f"{'':>28} {'3 vs 3 runs':>14} {'1 vs 1 (within-run)':>20}")
    three = rates(runs, 3, args.threshold)
    one = rates(runs, 1, args.threshold)
    print(f"{'pairs':>28} {three[0]:>14} {one[0]:>20}")
    for metric in METRICS:
        if metric.name in three[1] and any(metric.value(run.results) is not None for run in runs):
            print(f"{metric.name + ' called significant':>28} {three[1][metric.name] / three[0]:>14.1%} "
                  f"{one[1][metric.name] / one[0]:>20.1%}")
    print(f"{'any metric significant':>28} {three[2] / three[0]:>14.1%} {one[2] / one[0]:>20.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
