"""Session-wide: markers by folder, runs shared between tests, and no process left behind.

The folder a test lives in says what it needs, and marks it: ``tests/unit`` nothing (no
processes), ``tests/integration`` real process trees over loopback (``integration``),
``tests/cluster`` a real SLURM, sshd and network namespaces (``cluster``), ``tests/gpu`` a
GPU (``gpu``). ``python -m pytest -m "not cluster"`` or ``-m cluster`` runs one share.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.benchrun import ROOT, BenchRun, descendants, run_bench, wait_session_gone

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = {"integration": "integration", "cluster": "cluster", "gpu": "gpu"}


def pytest_configure(config: pytest.Config) -> None:
    """What the tests start as a user's shell would (``python``, ``torchrun``, a cloud
    machine's run script) is this interpreter's: its folder comes first on PATH, so that
    ``/path/to/venv/bin/python -m pytest`` runs them in that environment, activated or not."""
    here = str(Path(sys.executable).parent)
    os.environ["PATH"] = os.pathsep.join([here, os.environ.get("PATH", "")])


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test by its folder. Under pytest-xdist (``-n 2``, the suite's default) every
    test that starts processes is in one group, run by one worker in order, one at a time, as
    their machine-wide checks (no rank left, ports, links shaped) need: the unit tests, which
    start none, run on the other worker beside them."""
    for item in items:
        folder = Path(item.fspath).resolve().relative_to(TESTS).parts[0]
        if folder in FOLDER_MARKERS:
            item.add_marker(FOLDER_MARKERS[folder])
            item.add_marker(pytest.mark.xdist_group("processes"))


@pytest.fixture
def results_path(tmp_path: Path) -> Path:
    return tmp_path / "results.json"


class SharedLauncher:
    """``tests/shared_launcher.py``, started once: runs a command line's job as ``bench.py
    sweep`` runs a point, its ranks forked from the one forkserver it keeps (see there)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.process: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.shared_launcher", str(self.folder / "ranks.log")],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                start_new_session=True)
        return self.process

    def run(self, args: tuple[str, ...], folder: Path, timeout_s: float) -> BenchRun | None:
        """The run's outcome; None where the launcher would not take the command line (it is
        then run with bench.py)."""
        process = self.start()
        process.stdin.write(json.dumps({"argv": list(args), "folder": str(folder),
                                        "timeout_s": timeout_s}) + "\n")
        process.stdin.flush()
        # the run's own watchdog (run_point's) stops it at timeout_s: this is for the launcher
        ready, _, _ = select.select([process.stdout], [], [], timeout_s + 120)
        line = process.stdout.readline() if ready else ""
        if not line:
            self.close()
            pytest.fail(f"the shared launcher did not answer for {' '.join(args)} within "
                        f"{timeout_s + 120} s; its ranks' output: {self.folder / 'ranks.log'}")
        outcome = json.loads(line)
        if outcome["status"] == "refused":
            return None
        return BenchRun(0 if outcome["status"] == "ok" else 1, outcome["log"],
                        outcome["error"] or "", outcome["elapsed_s"], outcome["results"])

    def close(self) -> None:
        if self.process is None:
            return
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if not wait_session_gone(self.process.pid, 10):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process = None


class BenchRuns:
    """Real runs shared by the tests that read them: one run per distinct command line, started
    by the first test that asks for it. A run that failed fails every test that reads it, each
    with its output.

    ``ok`` (the results of a run that must succeed) and ``shared`` (a run however it ends) run
    the job through the shared launcher, as ``bench.py sweep`` runs a point: the same
    validation, launcher code and ranks, but no torch imported again for each run. ``get`` (what
    ``python bench.py`` prints, its exit status) runs ``bench.py`` itself."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.runs: dict[tuple[str, ...], BenchRun] = {}  # bench.py's
        self.results: dict[tuple[str, ...], BenchRun] = {}  # the shared launcher's
        self.launcher = SharedLauncher(folder)

    def get(self, *args: str, timeout_s: float = 300) -> BenchRun:
        if args not in self.runs:
            out = self.folder / f"run{len(self.runs) + len(self.results)}.json"
            self.runs[args] = run_bench(*args, out=out, timeout_s=timeout_s)
        return self.runs[args]

    def ok(self, *args: str, timeout_s: float = 300) -> dict:
        """The results of a run that must have succeeded."""
        run = self.shared(*args, timeout_s=timeout_s)
        assert run.returncode == 0, run.output
        return run.results

    def shared(self, *args: str, timeout_s: float = 300) -> BenchRun:
        """A run through the shared launcher, however it ended: exit status 0 where it succeeded,
        else 1; its output the job's own (every rank's, the master's report included), its
        stderr the results' error. For a test of what a job did and said, not of how ``bench.py``
        itself ends (its last line, its exit status, its signals: ``get``)."""
        run = self.runs.get(args) or self.results.get(args)
        if run is None:
            folder = self.folder / f"run{len(self.runs) + len(self.results)}"
            run = self.launcher.run(args, folder, timeout_s) or self.get(*args, timeout_s=timeout_s)
            self.results.setdefault(args, run)
        return run


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
    runs = BenchRuns(tmp_path_factory.mktemp("shared-runs"))
    yield runs
    runs.launcher.close()


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """The whole suite leaves no process behind: checked once every test has run."""
    yield
    deadline = time.monotonic() + 10
    while descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = descendants(os.getpid())
    assert not left, f"processes left behind by the tests: {left}"


@pytest.fixture(scope="session", autouse=True)
def temporary_folder(tmp_path_factory) -> Path:
    """What the tests' processes leave in the temporary folder (torchrun's ``torchelastic_*``
    folders, which it never removes; multiprocessing's ``pymp-*`` and the run folders of
    launchers killed on purpose) goes under this session's pytest folder, which pytest prunes,
    not into /tmp: TMPDIR for every process the tests start, ``tempfile`` for this one."""
    folder = tmp_path_factory.mktemp("tmp")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
    yield folder
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]
