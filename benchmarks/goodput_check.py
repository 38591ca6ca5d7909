"""Checks ``bench.py predict --mtbf`` against runs that fail: each case is run under torchrun
with failures drawn at a mean time between them (``--mtbf``, the job's, over its trainers) and
checkpoints every N iterations, torchrun restarting it each time; then ``bench.py predict`` is
given that run alone, as a user would give it: its timed rounds calibrate the batch time (its
``--limits`` link probe the link), its own checkpoints' write rate the checkpoint's cost and its
own failures' median recovery the restart. The predicted goodput (the failure-free samples a
second times Daly's share of wall time kept at that interval) is set against the run's measured
goodput (committed samples over the whole wall time, start-up included), with the failures the
run drew beside the number expected.

Nothing is set per case: the failures' mean and the work are the same for every case, and the
model is predict's (``ps_bench.predict.goodput``).

    python benchmarks/goodput_check.py [--mtbf 30s] [--rounds 2] [--out results/goodput_check]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ps_bench.runtime.faults import parse_duration  # noqa: E402

TRAINERS = 3
# (name, hook, checkpoint every N iterations): DDP's all-reduce saving often and seldom, and
# ZeRO-1 (its optimizer's shards consolidated into each checkpoint)
CASES = [("allreduce-200", "allreduce", 200), ("allreduce-1000", "allreduce", 1000),
         ("zero1-200", "zero1", 200)]
EPOCHS = 100  # passes over each trainer's shard a round: 2,100 iterations a round at 3 trainers


def run_case(hook: str, every: int, mtbf: str, rounds: int, folder: Path) -> dict:
    """The case's run under torchrun, or the one its folder holds already."""
    out = folder / f"{hook}-{every}.json"
    if out.exists():
        return json.loads(out.read_text()) | {"path": str(out)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(TRAINERS + 1), "--max-restarts", "1000", str(ROOT / "bench.py"), "--hook", hook,
               "--ntrainer", str(TRAINERS), "--nserver", "0", "--epochs", str(EPOCHS),
               "--warmup-rounds", "1", "--rounds", str(rounds), "--limits",
               "--checkpoint-every", str(every), "--checkpoint-dir", str(folder / f"ck-{hook}-{every}"),
               "--mtbf", mtbf, "--out", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text()) | {"path": str(out)}


def predict(results: dict, hook: str, every: int, mtbf_s: float, folder: Path) -> dict:
    out = folder / f"{hook}-{every}-predicted.json"
    command = [sys.executable, str(ROOT / "bench.py"), "predict", results["path"], "--trainers",
               str(TRAINERS), "--hooks", hook, "--mtbf", f"{mtbf_s * TRAINERS:g}s",
               "--checkpoint-every", str(every), "--out", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    [row] = json.loads(out.read_text())["predictions"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mtbf", default="30s", help="the jobs' mean time between failures")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds of each run")
    parser.add_argument("--out", default="results/goodput_check", help="the runs' folder")
    args = parser.parse_args(argv)
    mtbf_s = parse_duration(args.mtbf)
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, hook, every in CASES:
        print(f"{name}: running under failures (a mean of {args.mtbf} between them)", file=sys.stderr,
              flush=True)
        results = run_case(hook, every, args.mtbf, args.rounds, folder)
        predicted = predict(results, hook, every, mtbf_s, folder)
        good = results["recovery"]["goodput"]
        measured, forecast = good["samples_per_s"], predicted["goodput_samples_per_s"]
        failures = len(results["recovery"]["failures"])
        expected = good["wall_s"] / mtbf_s
        rows.append([name, failures, f"{expected:.1f}", f"{good['step_efficiency']:.3f}",
                     f"{measured / good['failure_free_samples_per_s']:.3f}", f"{predicted['ettr']:.3f}",
                     f"{measured:.0f}", f"{forecast:.0f}", f"{(forecast - measured) / measured * 100:+.1f} %"])
    print(tabulate(rows, headers=["case", "failures", "expected", "step efficiency", "measured ETTR",
                                  "predicted ETTR", "measured goodput/s", "predicted goodput/s", "error"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
