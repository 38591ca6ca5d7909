import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/benchrun.py


@pytest.fixture
def results_path(tmp_path: Path) -> Path:
    return tmp_path / "results.json"


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = [int(p) for p in out.split()]
    return children + [d for child in children for d in descendants(child)]


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """The whole suite leaves no process behind: checked once every test has run."""
    yield
    deadline = time.monotonic() + 10
    while descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = descendants(os.getpid())
    assert not left, f"processes left behind by the tests: {left}"
