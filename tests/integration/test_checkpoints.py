"""Checkpoints for real (``--checkpoint-every``): a run that loses a trainer at iteration 25,
started again with the same options, resumes from its checkpoint of iteration 20 (it does not
start over) and ends with the parameters a run that never failed ends with, for FSDP2 with
momentum and DeepSpeed's ZeRO-2 (each its engine's own checkpoint); and a save in
the background commits each checkpoint all the same. torchrun's own restart is in
``tests/cluster/test_elastic.py``."""

from __future__ import annotations

import json

import pytest

from ps_bench.runtime import checkpoints

QUICK = ("--ntrainer", "2", "--warmup-rounds", "1", "--rounds", "2")  # 32 iterations a round
# DDP's all-reduce under torchrun's own restart: tests/cluster/test_elastic.py
STRATEGIES = [("fsdp", "--momentum", "0.9"), ("deepspeed_zero2",)]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=[strategy[0] for strategy in STRATEGIES])
def test_a_failed_run_started_again_resumes_from_its_checkpoint(bench_runs, tmp_path, strategy):
    hook, *options = strategy
    run = ("--hook", hook, *options, *QUICK)
    saved = ("--checkpoint-every", "10", "--checkpoint-dir", str(tmp_path / "ck"))
    failed = bench_runs.shared(*run, *saved, "--inject-fault", "trainer:1:25:exit", timeout_s=240)
    assert failed.returncode == 1, failed.output
    assert [path.name for path in checkpoints.steps(tmp_path / "ck")] == ["step-00000010",
                                                                          "step-00000020"]
    resumed = bench_runs.ok(*run, *saved, timeout_s=240)
    never_failed = bench_runs.ok(*run, timeout_s=240)
    recovery = resumed["recovery"]
    assert recovery["resumed_from_an_earlier_run"] == 20
    assert recovery["checkpoints"]["restore_s"] > 0 and recovery["checkpoints"]["saves"] == 7
    assert recovery["goodput"]["committed_iterations"] == 96 - 20  # this run's own
    assert resumed["replicas"]["identical"] is True
    assert resumed["replicas"]["param_norm"] == pytest.approx(
        never_failed["replicas"]["param_norm"], rel=1e-6)
    assert checkpoints.finished(tmp_path / "ck")
    manifest = checkpoints.newest(tmp_path / "ck")
    assert manifest["iteration"] == 90 and manifest["trajectory"]["hook"] == hook


def test_saves_in_the_background_are_committed_and_timed_apart(bench_runs, tmp_path):
    results = bench_runs.ok("--hook", "allreduce", *QUICK, "--checkpoint-every", "16",
                            "--checkpoint-async", "--checkpoint-dir", str(tmp_path / "ck"),
                            timeout_s=240)
    saves = results["recovery"]["checkpoints"]
    assert saves["background"] is True and saves["saves"] == 6 and saves["restore_s"] is None
    assert results["throughput"]["untimed_s"] > 0  # the timed rounds' saves: outside their clock
    steps = [json.loads((path / checkpoints.MANIFEST).read_text())["iteration"]
             for path in checkpoints.steps(tmp_path / "ck")]
    assert steps == [80, 96]  # the newest two, the last committed at the end of training
    goodput = results["recovery"]["goodput"]
    assert goodput["step_efficiency"] == 1.0 and goodput["committed_samples"] == 96 * 2 * 16
    assert 0 < goodput["samples_per_s"] < goodput["failure_free_samples_per_s"]


def test_a_failure_drawn_by_mtbf_ends_a_run_torchrun_does_not_restart(bench_runs, tmp_path):
    """Without torchrun nothing restarts the job: the first failure --mtbf draws ends it, named,
    and the failed run's results keep its checkpoints' books."""
    run = bench_runs.shared("--hook", "allreduce", *QUICK[:2], "--rounds", "100000", "--mtbf", "300ms",
                         "--checkpoint-every", "50", "--checkpoint-dir", str(tmp_path / "ck"),
                         timeout_s=120)
    assert run.returncode == 1
    assert "failed: InjectedFault: failure drawn by --mtbf (mean 0.3 s): trainer " in run.stderr
    assert run.results["status"] == "failed" and run.results["recovery"]["checkpoints"]["every"] == 50
