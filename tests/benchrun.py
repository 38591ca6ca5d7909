"""Helpers for integration tests: run ``bench.py`` as a real process tree, with a timeout and a survivor check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class BenchRun:
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float
    results: dict | None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_session_gone(pgid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not session_alive(pgid):
            return True
        time.sleep(0.1)
    return not session_alive(pgid)


def run_bench(*args: str, timeout_s: float = 180, out: Path | None = None, env: dict | None = None) -> BenchRun:
    """Runs ``python bench.py ARGS`` in its own session; a hang fails the test, and every
    process of the run must be gone shortly after the launcher exits."""
    command = [sys.executable, str(ROOT / "bench.py"), *args]
    if out is not None:
        command += ["--out", str(out)]
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, **(env or {})},
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"bench.py {' '.join(args)} did not finish in {timeout_s} s\n{stdout}\n{stderr}")
    elapsed = time.monotonic() - start
    if not wait_session_gone(process.pid, 10):
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"processes of bench.py {' '.join(args)} survived the launcher")
    results = json.loads(out.read_text()) if out is not None and out.exists() else None
    return BenchRun(process.returncode, stdout, stderr, elapsed, results)
