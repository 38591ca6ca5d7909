import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/benchrun.py


@pytest.fixture
def results_path(tmp_path: Path) -> Path:
    return tmp_path / "results.json"
