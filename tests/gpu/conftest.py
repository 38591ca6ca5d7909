"""GPU tests are skipped, with the reason, where torch sees no GPU (CI and the CPU machines);
``python -m pytest -m gpu`` runs them where it does (``scripts/gpu_check.sh`` does it all)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu import GPUS

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if GPUS:
        return
    skip = pytest.mark.skip(reason="needs a GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(skip)
