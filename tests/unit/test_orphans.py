"""Run folders of launchers killed outright: the next launch keeps their finished rounds and
removes them, and never touches the folder of a launcher that lives."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ps_bench.processes import orphans
from ps_bench.config import RESULTS_SCHEMA
from ps_bench.results.files import write_snapshot


def run_folder(temporary: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix="ps_bench-", dir=temporary))


def claimed_by_a_process_now_gone(run_dir: Path, results_path: Path) -> None:
    code = f"from ps_bench.processes import orphans; orphans.claim({str(run_dir)!r}, {str(results_path)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def snapshot(rounds: int) -> dict:
    return {"schema": RESULTS_SCHEMA, "status": "running", "argv": ["bench.py"], "config": {"rounds": 9},
            "rounds_completed": rounds, "summary": []}


def test_a_living_launchers_folder_and_a_folder_of_no_launcher_are_left_alone(tmp_path):
    living = run_folder(tmp_path)
    owner = orphans.claim(str(living), str(tmp_path / "living.json"))
    write_snapshot(snapshot(3), living)
    other = run_folder(tmp_path)  # an earlier version's, or a launch between mkdtemp and claim
    (other / "partial.json").write_text(json.dumps(snapshot(1)))
    try:
        assert orphans.recover(str(tmp_path)) == []
        assert living.is_dir() and other.is_dir() and not (tmp_path / "living.json").exists()
    finally:
        owner.close()


def test_a_gone_launchers_finished_rounds_are_written_where_it_would_have_and_its_folder_removed(tmp_path):
    kept, empty = run_folder(tmp_path), run_folder(tmp_path)
    claimed_by_a_process_now_gone(kept, tmp_path / "out" / "kept.json")
    write_snapshot(snapshot(3), kept)
    claimed_by_a_process_now_gone(empty, tmp_path / "out" / "empty.json")  # killed before a round
    assert orphans.recover(str(tmp_path)) == [tmp_path / "out" / "kept.json"]
    results = json.loads((tmp_path / "out" / "kept.json").read_text())
    assert results["status"] == "failed" and results["rounds_completed"] == 3
    assert results["error"] == orphans.KILLED and results["config"] == {"rounds": 9}
    assert not kept.exists() and not empty.exists() and not (tmp_path / "out" / "empty.json").exists()
    assert orphans.recover(str(tmp_path)) == []  # once
