"""What the benchmarks share: ``bench.py`` run as a user runs it, in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def batch_p50(results: dict) -> float:
    """The trainers' batch time p50 (ms) of a loaded results file."""
    return next(row["p50"] for row in results["summary"] if row["role"] == "trainer" and row["metric"] == "batch")


def bench(script: str, what: str, args: list[str], checkout: Path = ROOT) -> None:
    """Runs ``checkout``'s ``bench.py`` with ``args``; if it fails, exits with one line: the
    benchmark (``script``), what failed (``what``), its exit status and the last line it wrote
    to stderr."""
    done = subprocess.run([sys.executable, str(checkout / "bench.py"), *args], cwd=checkout,
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"{script}: {what} failed (exit {done.returncode}): {last}")
