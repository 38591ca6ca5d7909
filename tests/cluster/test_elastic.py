"""torchrun's elastic restarts: a worker lost on the first attempt, the job started over and completed."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests.benchrun import ROOT, communicate, read_until

pytestmark = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")

QUICK = ("--warmup-rounds", "1", "--rounds", "2")


def torchrun(*args: str, timeout_s: float = 300, env: dict | None = None) -> tuple[int, str]:
    command = [sys.executable, "-m", "torch.distributed.run", *args]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=None if env is None else {**os.environ, **env})
    stdout, _, _ = communicate(process, timeout_s, " ".join(args))
    return process.returncode, stdout


def test_a_worker_lost_on_the_first_attempt_is_recovered_by_a_restart_from_its_checkpoint(tmp_path, bench_runs):
    """torchrun restarts every rank; the job resumes from its checkpoint of iteration 20, redoes
    the 4 iterations after it that trainer 1 had done, and ends where a run that never failed
    ends."""
    out, temporary = tmp_path / "results.json", tmp_path / "tmp"
    temporary.mkdir()
    run = ("--hook", "allreduce", "--ntrainer", "2", "--nserver", "0", *QUICK)  # 32 iterations a round
    code, output = torchrun("--standalone", "--nproc-per-node", "3", "--max-restarts", "2", "bench.py", *run,
                            "--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path / "ck"),
                            "--inject-fault", "trainer:1:25:exit:first", "--out", str(out),
                            env={"TMPDIR": str(temporary)})
    assert code == 0, output
    assert "torchrun restart 1 of 2" in output and "resumed from the checkpoint of iteration 20" in output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "results.json", "tmp"]  # the lost attempt wrote no file
    # the ranks torchrun stopped after the loss left their folders in torchrun's, none loose in TMPDIR
    assert not list(temporary.glob("ps_bench-*")), list(temporary.iterdir())
    results = json.loads(out.read_text())
    assert results["status"] == "ok"
    assert results["restarts"] == 1
    [recovered] = results["recovered"]
    assert recovered["attempt"] == 0 and recovered["role"] == "trainer" and recovered["rank"] == 1
    assert "injected fault: trainer 1 at iteration 25" in recovered["failure"]
    [failure] = results["recovery"]["failures"]
    assert (failure["iterations_done"], failure["resumed_from"], failure["iterations_redone"]) == (24, 20, 4)
    assert 0 < failure["restart_s"] < failure["recovery_s"]
    assert [(a["began_at_iteration"], a["ended_at_iteration"]) for a in results["recovery"]["attempts"]] == [
        (0, 24), (20, 96)]
    goodput = results["recovery"]["goodput"]
    assert goodput["committed_iterations"] == 96 and goodput["step_efficiency"] == pytest.approx(96 / 100)
    assert results["replicas"]["identical"] is True
    assert results["replicas"]["param_norm"] == pytest.approx(bench_runs.ok(*run)["replicas"]["param_norm"],
                                                              rel=1e-6)
    [host] = results["env"]["hosts"]
    assert host["ranks"] == [0, 1, 2] and host["cpus"] >= 1


def test_without_restarts_left_the_first_attempt_fault_ends_the_job(tmp_path):
    out = tmp_path / "results.json"
    code, output = torchrun("--standalone", "--nproc-per-node", "2", "bench.py", "--ntrainer", "1", "--nserver", "0",
                            "--hook", "allreduce", "--inject-fault", "master:0:2:raise:first", *QUICK, "--out", str(out))
    assert code != 0
    results = json.loads(out.read_text())
    assert results["status"] == "failed" and results["restarts"] == 0
    assert "injected fault: master 0 at iteration 2" in results["error"]


def test_a_job_torchrun_stops_keeps_every_round_it_announced(tmp_path):
    # torchrun, stopped, stops its ranks with SIGTERM: no launcher of ours is there to keep the
    # rounds, so the master writes the failed run's file itself
    out = tmp_path / "results.json"
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "bench.py",
         "--ntrainer", "1", "--nserver", "0", "--hook", "allreduce", "--rounds", "100000", "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    announced = read_until(process, "[round 4/")
    process.send_signal(signal.SIGTERM)
    stdout, _, _ = communicate(process, 120, "torchrun, stopped")
    assert process.returncode != 0
    assert f"results (failed run): {out}" in stdout
    results = json.loads(out.read_text())
    finished = [line for line in announced if re.match(r"\[round \d+/\d+\] timed +[\d.]+ s ", line)]
    assert results["status"] == "failed" and results["rounds_completed"] >= len(finished) >= 3
    assert results["error"].startswith("master 0 (rank 1, master) stopped by SIGTERM before the job finished")
