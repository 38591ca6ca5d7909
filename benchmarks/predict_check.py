"""Checks ``bench.py predict`` against emulated runs: every trainer and server on a host of its
own behind a shaped link (``bench.py emulate``, needs root), upstream's ``DummyModel``.

Runs ``allreduce`` and ``fp16`` at 2, 3 and 4 trainers, and ``ps`` at 2, 3 and 4 trainers with 1
and 2 servers; calibrates on the 2-trainer runs alone (``allreduce``, ``fp16`` and ``ps`` with 1
server, made with ``--limits``), predicts every point, and prints predicted, measured and error
per point, then the median and largest |error| over the points the calibration did not see.
Runs already in the output folder are reused (delete it to measure again).

    sudo $(which python) benchmarks/predict_check.py [--link 1gbit] [--out results/predict_check] [--plot FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BATCH, ITERATIONS = 32, 6  # per trainer and round: every trainer count runs the same iterations
TRAINERS = (2, 3, 4)
POINTS = [(hook, n, 0) for hook in ("allreduce", "fp16") for n in TRAINERS] + [
    ("ps", n, k) for k in (1, 2) for n in TRAINERS]
CALIBRATION = {("allreduce", 2, 0), ("fp16", 2, 0), ("ps", 2, 1)}
DUMMY_DATA = {"max_val": 1024, "sample_length": 1024, "sparsity_percentage": 20}


def run_point(out: Path, link: str, hook: str, n: int, k: int) -> Path:
    path = out / f"{hook}-{n}t{k}s.json"
    if path.exists():
        return path
    data = out / "data.json"
    data.write_text(json.dumps({f"Check{t}": {"data_class": "DummyData", "configurations": {
        **DUMMY_DATA, "sample_count": t * BATCH * ITERATIONS}} for t in TRAINERS}))
    command = [sys.executable, str(ROOT / "bench.py"), "emulate", "--link", link, "--",
               "--model", "DummyModel", "--data", f"Check{n}", "--data-config-path", str(data),
               "--batch-size", str(BATCH), "--hook", hook, "--ntrainer", str(n), "--nserver", str(k),
               "--warmup-rounds", "1", "--rounds", "2", "--out", str(path)]
    if (hook, n, k) in CALIBRATION:
        command.append("--limits")
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"predict_check: {hook} {n}t{k}s failed (exit {done.returncode}): "
                 f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    print(f"  ran {hook} {n} trainers {k} servers in {time.monotonic() - started:.0f} s", flush=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", default="1gbit", help="the emulated link (default 1gbit)")
    parser.add_argument("--out", default=str(ROOT / "results" / "predict_check"), help="folder for the runs")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw predicted and measured batch times")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"predict_check: {len(POINTS)} emulated runs at {args.link} (DummyModel, batch {BATCH})", flush=True)
    paths = {point: run_point(out, args.link, *point) for point in POINTS}
    prediction = out / "prediction.json"
    calibration_files = [str(paths[point]) for point in sorted(CALIBRATION)]
    others = [str(paths[point]) for point in POINTS if point not in CALIBRATION]
    subprocess.run([sys.executable, str(ROOT / "bench.py"), "predict", *calibration_files, "--compare", *others,
                    "--trainers", ",".join(map(str, TRAINERS)), "--servers", "1,2", "--hooks", "allreduce,fp16,ps",
                    "--out", str(prediction), *(["--plot", args.plot] if args.plot else [])],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    predicted = {(row["strategy"], row["trainers"], row["servers"] or 0): row["batch_ms"]
                 for row in json.loads(prediction.read_text())["predictions"]}
    print(f"\n{'strategy':10} {'trainers':>8} {'servers':>7} {'predicted ms':>12} {'measured ms':>11} {'error %':>8}")
    errors = []
    for point in POINTS:
        results = json.loads(paths[point].read_text())
        measured = next(row["p50"] for row in results["summary"] if row["role"] == "trainer" and row["metric"] == "batch")
        error = (predicted[point] - measured) / measured * 100.0
        note = "  (calibration)" if point in CALIBRATION else ""
        if point not in CALIBRATION:
            errors.append(abs(error))
        hook, n, k = point
        print(f"{hook:10} {n:>8} {k or '-':>7} {predicted[point]:>12.1f} {measured:>11.1f} {error:>+8.1f}{note}")
    median, largest = statistics.median(errors), max(errors)
    verdict = "held" if median <= 15 and largest <= 30 else "missed"
    print(f"\n|error| over the {len(errors)} points the calibration did not see: median {median:.1f} %, "
          f"largest {largest:.1f} % (targets 15 % and 30 %: {verdict})")
    return 0 if verdict == "held" else 1


if __name__ == "__main__":
    sys.exit(main())
