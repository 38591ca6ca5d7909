"""Sweeps run points as separate process trees, survive failing points, resume, and report."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.benchrun import ROOT, run_bench, small_file_system, wait_session_gone

QUICK = {"warmup_rounds": 1, "rounds": 1}


def write_sweep(tmp_path: Path, content: dict) -> str:
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(content))
    return str(path)


def lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_sweep_resume_and_report(tmp_path):
    sweep = write_sweep(tmp_path, {"name": "two", "base": {**QUICK, "verify": True},
                                   "grid": {"hook": ["allreduce", "ps"]}})
    out = tmp_path / "out"
    run = run_bench("sweep", sweep, "--out", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    recorded = lines(out)
    assert [r["status"] for r in recorded] == ["ok", "ok"]
    assert [r["point"]["overrides"] for r in recorded] == [{"hook": h} for h in ("allreduce", "ps")]
    assert all(r["schema"] == "ps_bench.result/1" and r["summary"] for r in recorded)
    assert "[2/2] hook=ps" in run.stdout and "left)" in run.stdout
    assert "sweep two: ran 2 points: 2 ok, 0 failed;" in run.stdout
    assert len(list((out / "logs").glob("*.log"))) == 2

    point_files = sorted((out / "points").iterdir())
    again = run_bench("sweep", sweep, "--out", str(out), "--resume")
    assert again.returncode == 0
    assert "2 already done, 0 to run" in again.stdout
    assert len(lines(out)) == 2 and sorted((out / "points").iterdir()) == point_files  # nothing ran again

    csv_path, png_path, timeline = tmp_path / "r.csv", tmp_path / "r.png", tmp_path / "timeline.png"
    report = run_bench("report", str(out), "--baseline", "hook=ps", "--csv", str(csv_path), "--plot", str(png_path),
                       "--timeline", str(timeline))
    assert report.returncode == 0, report.stderr
    table = report.stdout.splitlines()
    assert table[0].split()[:3] == ["hook", "batch", "p50"]
    body = [line.split() for line in table[2:4]]
    assert [row[0] for row in body] == ["allreduce", "ps"]
    assert body[1][-2] == "1.00x" and all(row[-2].endswith("x") for row in body)
    csv_lines = csv_path.read_text().splitlines()
    assert csv_lines[0].startswith("hook,batch p50 ms,batch p90 ms,samples/s,bytes/iter,trainer MiB,grad error,speedup")
    assert len(csv_lines) == 3
    # each point's trainers' memory beside its time, as its run's Memory table gives it
    assert [line.split(",")[5] for line in csv_lines[1:]] == [
        f"{r['memory']['trainer']['peak_bytes'] / 2 ** 20:.1f}" for r in recorded]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000
    # --timeline: each point's iteration as its results give it, the figures beside the picture
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = json.loads(timeline.with_suffix(".json").read_text())["points"]
    assert [entry["point"] for entry in drawn] == ["allreduce", "ps"]
    for entry, results in zip(drawn, recorded):
        p50 = {row["metric"]: row["p50"] for row in results["summary"] if row["role"] == "trainer"}
        forward, backward = entry["phases"]["forward"], entry["phases"]["backward"]
        assert forward == [0.0, p50["forward"]] and backward == [p50["forward"], p50["forward"] + p50["backward"]]
        assert entry["phases"]["optimizer"][1] == pytest.approx(p50["forward"] + p50["backward"] + p50["optimizer"])
        assert [bucket["span"] for bucket in entry["buckets"]] == [
            [p50["forward"] + bucket["ready_ms"], p50["forward"] + bucket["done_ms"]] for bucket in results["timeline"]]
        assert entry["buckets"] and (entry["comm_ms"], entry["exposed_ms"]) == (p50["comm"], p50["exposed"])
    assert drawn[0]["server_aggregate_ms"] is None and drawn[1]["server_aggregate_ms"] > 0
    # the servers' lane: ps's every bucket on its server, within the iteration, as drawn
    lane, p90 = recorded[1]["server_timeline"], {
        row["metric"]: row["p90"] for row in recorded[1]["summary"] if row["role"] == "trainer"}
    assert recorded[0]["server_timeline"] is None and drawn[0]["servers"] == []
    assert {piece["slice"] for piece in lane} == {bucket["index"] for bucket in recorded[1]["timeline"]}  # uncut
    assert all(0 <= piece["answered_ms"] <= p90["batch"] for piece in lane)
    forward = drawn[1]["phases"]["forward"][1]
    assert [(piece["received"], piece["answered"]) for piece in drawn[1]["servers"]] == [
        ([forward + piece["first_ms"], forward + piece["last_ms"]],
         [forward + piece["last_ms"], forward + piece["answered_ms"]]) for piece in lane]
    assert "last bucket done" in report.stdout and f"timeline: {timeline}" in report.stdout


def test_a_failing_point_is_recorded_and_resume_reruns_only_it(tmp_path):
    sweep = write_sweep(tmp_path, {"name": "faulty", "base": QUICK, "variants": [
        {"name": "broken", "hook": "ps", "inject_fault": "trainer:0:2:raise"},
        {"name": "last", "hook": "allreduce"},
    ]})
    out = tmp_path / "out"
    run = run_bench("sweep", sweep, "--out", str(out))
    assert run.returncode == 1
    assert [(r["point"]["name"], r["status"]) for r in lines(out)] == [("broken", "failed"), ("last", "ok")]
    assert "injected fault" in lines(out)[0]["error"]  # the next point ran all the same
    assert "[1/2] broken" in run.stdout and "FAILED" in run.stdout

    again = run_bench("sweep", sweep, "--out", str(out), "--resume")
    assert again.returncode == 1
    assert "1 already done, 1 to run" in again.stdout
    recorded = lines(out)
    assert len(recorded) == 3 and recorded[-1]["point"]["name"] == "broken"


def test_interrupting_a_sweep_stops_the_point_and_keeps_what_finished(tmp_path):
    sweep = write_sweep(tmp_path, {"name": "long", "variants": [
        {"name": "short", **QUICK}, {"name": "endless", "rounds": 100000}]})
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, str(ROOT / "bench.py"), "sweep", sweep, "--out", str(out)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in process.stdout:
            if line.startswith("[1/2]"):
                break
        wait_for_rounds(out / "logs")  # the endless point is running its rounds
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130
    assert "--resume continues" in stderr
    assert [r["point"]["name"] for r in lines(out)] == ["short"]
    # the interrupted point kept its finished rounds in its own file, outside results.jsonl
    kept = [json.loads(path.read_text()) for path in (out / "points").glob("002-*-1.json")]
    assert len(kept) == 1 and kept[0]["status"] == "failed" and kept[0]["error"] == "interrupted by SIGINT"
    assert kept[0]["rounds_completed"] >= 1
    # every process of the sweep (the forkserver, every point's ranks) is gone with it
    assert wait_session_gone(process.pid, 10)


def wait_for_rounds(logs: Path, within_s: float = 300) -> None:
    """Returns once the point now running has logged a timed round."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if len([log for log in logs.glob("*.log") if re.search(r"^\[round \d+/\d+\] timed", log.read_text(),
                                                                 re.MULTILINE)]) == 2:
            return
        time.sleep(0.2)
    pytest.fail(f"the second point logged no timed round within {within_s} s")


def test_a_sweep_whose_disk_fills_stops_with_one_line_saying_where_and_how_to_go_on(tmp_path):
    """The sweep's own files (a point's log, results.jsonl) on a disk that fills: one line, exit
    1, no traceback. A file system of one page stands in: the first point's configuration file
    takes the page, and its log's first line finds no room."""
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"base": {"rounds": 1}, "grid": {"hook": ["ps", "allreduce"]}}))
    with small_file_system(tmp_path / "full", "4k") as full:
        run = run_bench("sweep", str(sweep), "--out", str(full / "sweep"), timeout_s=120)
    assert run.returncode == 1, run.output
    assert run.stderr.strip() == (
        f"ps_bench: error: sweep stopped at point 1 (hook=ps): {full / 'sweep'}: No space left on "
        f"device; 0 points of this run are in {full / 'sweep' / 'results.jsonl'}; --resume continues")


def test_a_point_whose_results_find_no_room_is_recorded_from_the_temporary_folder(tmp_path):
    """A point's results file (indented JSON, about six pages) finds the disk full, while its
    line in results.jsonl (four or five) still fits beside the sweep's lock, the point's config
    and its log (a page each): the point keeps its results in the temporary folder, and the
    sweep records them from there, saying where they are."""
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"base": {"rounds": 1}, "grid": {"hook": ["ps"]}}))
    with small_file_system(tmp_path / "full", "32k") as full:
        run = run_bench("sweep", str(sweep), "--out", str(full / "sweep"), timeout_s=120)
        recorded = lines(full / "sweep")
    assert run.returncode == 0, run.output
    warning = re.fullmatch(r"ps_bench: warning: point 1's results could not be written to (\S+); "
                           r"they are in (\S+)", run.stderr.strip())
    assert warning, run.stderr
    assert not Path(warning[1]).exists() and Path(warning[1]).parent == full / "sweep" / "points"
    kept = json.loads(Path(warning[2]).read_text())
    assert kept["status"] == "ok" and Path(warning[2]).is_relative_to(tempfile.gettempdir())
    assert [r["status"] for r in recorded] == ["ok"]
    assert recorded[0]["summary"] == kept["summary"]


def test_bad_sweep_is_refused_before_anything_runs(tmp_path):
    sweep = write_sweep(tmp_path, {"grid": {"hook": ["ps", "allredcue"]}})
    run = run_bench("sweep", sweep, "--out", str(tmp_path / "out"), timeout_s=120)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "point 2 (hook=allredcue)" in run.stderr
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_report_without_results_is_a_clear_error(tmp_path):
    run = run_bench("report", str(tmp_path / "nothing"), timeout_s=120)
    assert run.returncode == 2 and "does not exist" in run.stderr and run.stderr.count("\n") == 1


@pytest.mark.timeout(300)
def test_a_point_with_max_restarts_runs_under_torchrun(tmp_path):
    """A point with ``max_restarts`` runs under torchrun, with that many restarts to give (what
    torchrun does with them, a restart from the checkpoint, is tests/cluster/test_elastic.py's),
    and the report gives its goodput."""
    sweep = write_sweep(tmp_path, {"name": "restartable", "base": {
        **QUICK, "hook": "allreduce", "nserver": 0, "checkpoint_every": 10,
        "checkpoint_dir": str(tmp_path / "ck"), "max_restarts": 1},
        "variants": [{"name": "under torchrun"}]})
    out = tmp_path / "out"
    run = run_bench("sweep", sweep, "--out", str(out), timeout_s=240)
    assert run.returncode == 0, run.stdout + run.stderr
    recorded, = lines(out)
    assert recorded["status"] == "ok" and recorded["restarts"] == 0
    assert recorded["recovery"]["checkpoints"]["saves"] > 0
    log = next((out / "logs").glob("*.log")).read_text()
    assert "under torchrun: -m torch.distributed.run --standalone" in log and "--max-restarts 1" in log
    report = run_bench("report", str(out))
    assert report.returncode == 0 and "goodput samples/s" in report.stdout.splitlines()[0]
