"""Session-wide: markers by folder, runs shared between tests, and no process left behind.

The folder a test lives in says what it needs, and marks it: ``tests/unit`` nothing (no
processes), ``tests/integration`` real process trees over loopback (``integration``),
``tests/cluster`` a real SLURM, sshd and network namespaces (``cluster``), ``tests/gpu`` a
GPU (``gpu``). ``python -m pytest -m "not cluster"`` or ``-m cluster`` runs one share.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.benchrun import BenchRun, descendants, run_bench

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = {"integration": "integration", "cluster": "cluster", "gpu": "gpu"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(item.fspath).resolve().relative_to(TESTS).parts[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])


@pytest.fixture
def results_path(tmp_path: Path) -> Path:
    return tmp_path / "results.json"


class BenchRuns:
    """Real runs shared by the tests that read them: one run per distinct command line, started
    by the first test that asks for it. A run that failed fails every test that reads it, each
    with its output."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.runs: dict[tuple[str, ...], BenchRun] = {}

    def get(self, *args: str, timeout_s: float = 300) -> BenchRun:
        if args not in self.runs:
            out = self.folder / f"run{len(self.runs)}.json"
            self.runs[args] = run_bench(*args, out=out, timeout_s=timeout_s)
        return self.runs[args]

    def ok(self, *args: str, timeout_s: float = 300) -> dict:
        """The results of a run that must have succeeded."""
        run = self.get(*args, timeout_s=timeout_s)
        assert run.returncode == 0, run.output
        return run.results


@pytest.fixture(scope="session")
def bare_import_s() -> float:
    """Seconds a bare ``import torch`` takes on this machine now (the slower of two), for tests
    that hold a command's quickness against it rather than against a fixed number of seconds."""
    times = []
    for _ in range(2):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
        times.append(time.monotonic() - started)
    return max(times)


@pytest.fixture(scope="session")
def bench_runs(tmp_path_factory) -> BenchRuns:
    return BenchRuns(tmp_path_factory.mktemp("shared-runs"))


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """The whole suite leaves no process behind: checked once every test has run."""
    yield
    deadline = time.monotonic() + 10
    while descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = descendants(os.getpid())
    assert not left, f"processes left behind by the tests: {left}"
