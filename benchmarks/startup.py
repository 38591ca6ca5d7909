"""What a job costs before and around its timed rounds: the default job's wall time against a
bare ``import torch, torch.distributed.rpc``, and where the start-up went.

Runs ``python bench.py`` (the default job, its results in a temporary folder) and the bare
import alternately, PAIRS times each (alternating, so a machine whose load drifts moves both
alike), and prints both medians, their ratio, and the median of each start-up phase the job
recorded (``env.startup_s``, the same as ``bench.py --verbose`` prints).

    python benchmarks/startup.py [--pairs N] [-- BENCH OPTIONS]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ps_bench.results.load import load_file

ROOT = Path(__file__).resolve().parent.parent
BARE = [sys.executable, "-c", "import torch, torch.distributed.rpc"]


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, help="runs of each command (default 5)")
    parser.add_argument("bench_options", nargs="*", help="options for bench.py, after -- (default: none)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ps_bench-startup-"))
    jobs, bare, phases = [], [], []
    for pair in range(args.pairs):
        out = folder / f"job{pair}.json"
        job = [sys.executable, str(ROOT / "bench.py"), *args.bench_options, "--out", str(out)]
        for kind in ("job", "bare") if pair % 2 == 0 else ("bare", "job"):
            if kind == "job":
                jobs.append(timed(job))
                phases.append(load_file(out)["env"]["startup_s"])
            else:
                bare.append(timed(BARE))
        print(f"pair {pair + 1}/{args.pairs}: job {jobs[-1]:.2f} s, bare import {bare[-1]:.2f} s", flush=True)
    job_s, bare_s = statistics.median(jobs), statistics.median(bare)
    print(f"\nbench.py {' '.join(args.bench_options) or '(default job)'}: median {job_s:.2f} s over {args.pairs} runs "
          f"(min {min(jobs):.2f}, max {max(jobs):.2f})")
    print(f"import torch, torch.distributed.rpc: median {bare_s:.2f} s (min {min(bare):.2f}, max {max(bare):.2f})")
    print(f"ratio of the medians: {job_s / bare_s:.2f}")
    print("\nstart-up phases, median s:")
    for phase in phases[0]:
        print(f"  {phase:26} {statistics.median(p[phase] for p in phases):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
