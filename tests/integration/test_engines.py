"""The engines users train with, for real: DeepSpeed's ZeRO stages 1, 2 and 3 train exactly as
all-reduce does and send what DeepSpeed's own comms logger says; a seed-style ds_config runs;
torchft's DiLoCo is ps_bench's DiLoCo, two implementations of one algorithm agreeing, and its
streaming form sends each fragment once a period; nothing of torchft or DeepSpeed outlives a run
or a failure."""

from __future__ import annotations

import json
import os
import signal

import pytest

from ps_bench.cli import main
from ps_bench.predict.inputs import TargetLink, model_buckets
from ps_bench.predict.predictor import calibrate
from ps_bench.predict.runs import Run
from ps_bench.strategies import HOOKS
from ps_bench.strategies.deepspeed_config import zero3_gathers
from tests.benchrun import ROOT, communicate, descendants, is_loopback, listening_sockets, rank_pids, \
    ranks_running, read_until, start_bench
from tests.integration.shared_runs import DILOCO, QUICK, quick_run

run = quick_run  # DummyModelSmall, 2 trainers, SGD: 32 iterations a round


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_trains_as_allreduce_and_sends_what_its_comms_logger_says(stage, bench_runs):
    results = run(bench_runs, f"deepspeed_zero{stage}", "--verify")
    baseline = run(bench_runs, "allreduce")
    assert results["replicas"]["identical"] is True
    assert results["replicas"]["checked_at"] == ("gathered full parameters" if stage == 3 else "every iteration")
    assert results["replicas"]["param_norm"] == pytest.approx(baseline["replicas"]["param_norm"], rel=1e-5)
    counted, logged = results["bytes"]["trainer_sent_per_iter"], results["verify"]["engine_sent_per_iter"]
    assert counted == pytest.approx(logged, rel=0.02)
    engine = results["verify"]["engine"]
    if stage < 3:  # DDP's all-reduce of the gradients (and a 4-byte norm), then the stepped parameters gathered
        assert engine["all_reduce"]["bytes_per_iter"] == pytest.approx(3200 + 4)
        assert engine["all_gather_into_tensor"]["bytes_per_iter"] == 3200
    else:  # the gradients reduce-scattered (gloo: an all-reduce's bytes), the parameters gathered
        assert engine["reduce_scatter_tensor"]["bytes_per_iter"] == 3200
        assert engine["all_gather_into_tensor"]["bytes_per_iter"] == 3200
    assert results["config"]["engine_config"]["zero_optimization"]["stage"] == stage


def test_deepspeed_zero3_gathers_again_what_predict_says_it_releases(bench_runs, tmp_path, capsys):
    """ZeRO-3 with a reuse distance and prefetch that keep some of DummyModelSmall's layers gathered
    from forward to backward and release the rest: the bytes DeepSpeed's own comms logger saw it
    all-gather are what predict's model of its parameter coordinator counts, once and again
    (``zero3_gathers``), and predict from the run takes that share, at the run's engine config."""
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps({"zero_optimization": {
        "stage": 3, "stage3_max_reuse_distance": 100, "stage3_prefetch_bucket_size": 70}}))
    results = run(bench_runs, "deepspeed_zero3", "--verify", "--ds-config", str(config))
    assert results["replicas"]["identical"] is True
    calls = model_buckets("DummyModelSmall", 25.0, None, 16)[3].modules
    once, again = zero3_gathers(calls, results["config"]["engine_config"])
    assert once == 800 and 0 < again < 800  # some kept, some released
    gathered = results["verify"]["engine"]["all_gather_into_tensor"]["bytes_per_iter"]
    assert gathered == 4 * (once + again)

    saved, timed, out = tmp_path / "run.json", tmp_path / "allreduce.json", tmp_path / "predict.json"
    saved.write_text(json.dumps(results))
    options = ["--link", "10gbit", "--trainers", "2,8", "--out", str(out)]
    assert main(["predict", str(saved), *options]) == 2  # ZeRO-3 builds no DDP buckets to time
    assert "the runs given (deepspeed_zero3) built no DDP buckets" in capsys.readouterr().err
    timed.write_text(json.dumps(run(bench_runs, "allreduce")))
    assert main(["predict", str(saved), str(timed), *options]) == 0
    assert "deepspeed_zero3 at its runs' engine config" in capsys.readouterr().out
    assert json.loads(out.read_text())["calibration"]["regathered"]["deepspeed_zero3"] == again / once


def test_a_seed_style_ds_config_runs_with_its_autos_filled_from_the_run(bench_runs, tmp_path, capsys):
    """The Hugging Face Trainer's ZeRO-2 config: "auto" batch sizes, AdamW with "auto" parameters,
    a WarmupLR scheduler, fp16 and bf16 "auto"."""
    path = ROOT / "configs" / "deepspeed" / "zero2_auto.json"
    got = bench_runs.get("--hook", "deepspeed_zero2", *QUICK, "--ds-config", str(path), timeout_s=240)
    assert got.returncode == 0, got.output
    assert "ps_bench: note: --ds-config" in got.stdout and "its scheduler (WarmupLR) is left out" in got.stdout
    results = got.results
    config = results["config"]
    assert config["optimizer"] == "adamw" and config["weight_decay"] == 0.01 and config["batch_size"] == 16
    engine = config["engine_config"]
    assert engine["train_micro_batch_size_per_gpu"] == 16 and engine["train_batch_size"] == 32
    assert engine["gradient_clipping"] == 0.0 and engine["fp16"]["enabled"] is False
    assert "scheduler" not in engine and "optimizer" not in engine
    assert results["replicas"]["identical"] is True and results["loss"]["last"] < results["loss"]["first"]

    # its overlap_comm: predict from the run reduces ZeRO-2's buckets as backward makes them,
    # where DeepSpeed's default (off at stage 2) reduces them after backward
    saved, timed, out = tmp_path / "zero2.json", tmp_path / "allreduce.json", tmp_path / "predict.json"
    saved.write_text(json.dumps(results))
    timed.write_text(json.dumps(run(bench_runs, "allreduce")))
    assert main(["predict", str(saved), str(timed), "--link", "10gbit", "--trainers", "8",
                 "--hooks", "deepspeed_zero2", "--out", str(out)]) == 0
    capsys.readouterr()
    predicted = json.loads(out.read_text())
    assert predicted["calibration"]["overlaps"] == {"deepspeed_zero2": True}
    assert predicted["predictions"][0]["communication_end_ms"] > 0


def test_the_configs_adamw_betas_reach_the_optimizer(bench_runs, tmp_path):
    """Same seed, same model, two ds_configs that differ in AdamW's betas alone: the runs end
    with other parameters."""
    norms = []
    for betas in ([0.5, 0.6], [0.9, 0.999]):
        path = tmp_path / f"betas-{betas[0]}.json"
        path.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": betas}}}))
        results = run(bench_runs, "deepspeed_zero2", "--ds-config", str(path))
        assert results["config"]["engine_config"]["ps_bench_optimizer_params"] == {"betas": betas}
        norms.append(results["replicas"]["param_norm"])
    assert abs(norms[0] - norms[1]) > 1e-4 * norms[1], norms


def test_deepspeed_in_bf16_moves_half_the_bytes_and_verifies(bench_runs, tmp_path):
    path = tmp_path / "bf16.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}}))
    results = run(bench_runs, "deepspeed_zero2", "--verify", "--ds-config", str(path))
    float32 = run(bench_runs, "deepspeed_zero2", "--verify")
    assert results["replicas"]["identical"] is True and results["verify"]["iterations"] > 0
    engine = results["verify"]["engine"]
    assert engine["all_gather_into_tensor"]["bytes_per_iter"] == 3200 / 2  # the stepped parameters, in bf16
    assert engine["all_reduce"]["bytes_per_iter"] == pytest.approx(3200 / 2 + 4, abs=2)  # and the gradients
    assert results["bytes"]["trainer_sent_per_iter"] == pytest.approx(
        float32["bytes"]["trainer_sent_per_iter"] / 2, abs=4)
    # predict from each run moves what it moved (it sent float32 whatever DeepSpeed trained in)
    wires = []
    for each in (results, float32):
        calibration = calibrate([Run.of(each, "run"), Run.of(run(bench_runs, "allreduce"), "ar")],
                                TargetLink("--link", 10e9, "ethernet", 0.8, 50e-6))
        wires.append(calibration.wire(HOOKS.record("deepspeed_zero2"), "deepspeed_zero2"))
    assert wires == [("bfloat16", "bfloat16"), ("float32", "float32")]


def test_torchft_diloco_is_ps_bench_diloco(bench_runs):
    theirs, ours = run(bench_runs, "torchft_diloco", *DILOCO), run(bench_runs, "diloco", *DILOCO)
    assert theirs["replicas"]["identical"] is True
    assert theirs["replicas"]["param_norm"] == pytest.approx(ours["replicas"]["param_norm"], rel=1e-5)
    assert theirs["loss"]["last"] == pytest.approx(ours["loss"]["last"], rel=1e-5)
    assert theirs["bytes"]["trainer_sent_per_iter"] == ours["bytes"]["trainer_sent_per_iter"] == 3200 / 4


def test_streaming_diloco_sends_each_fragment_once_a_period(bench_runs):
    """Period 4, 2 fragments: one fragment every 2 iterations, so each of them once in 4."""
    results = run(bench_runs, "torchft_diloco", "--hook-option", "period=4", "--hook-option", "fragments=2")
    sent = next(s for s in results["samples"] if s["role"] == "trainer")["metrics"]["bytes_sent"]
    assert sent[:4] == [0, sent[1], 0, sent[3]] and sent[1] and sent[3] and sent[1] + sent[3] == 3200
    assert sent == sent[:4] * (len(sent) // 4)  # the same fragment, the same bytes, every period
    assert results["replicas"]["identical"] is True  # each fragment at its own last synchronisation


def test_torchft_local_sgd_averages_every_period(bench_runs):
    results = run(bench_runs, "torchft_local_sgd", "--hook-option", "period=4")
    assert results["bytes"]["trainer_sent_per_iter"] == 3200 / 4 and results["replicas"]["identical"] is True


def test_torchft_listens_where_it_can_be_told_to_and_a_killed_trainer_ends_it(results_path):
    """The lighthouse (in the master) and every trainer's store bind to loopback; torchft's manager servers take
    no address (every interface). A trainer killed with SIGKILL ends the job, named, and no
    process of it survives (``communicate`` checks the whole session)."""
    process = start_bench("--hook", "torchft_diloco", "--nserver", "0", "--hook-option", "period=4", "--rounds",
                          "100000", "--rpc-timeout", "600", "--out", str(results_path))
    read_until(process, "[round 3/")
    pids = rank_pids(process.pid)
    sockets = listening_sockets([process.pid, *descendants(process.pid)])
    os.kill(pids[1], signal.SIGKILL)
    _, stderr, _ = communicate(process, 120, "the job")
    assert process.returncode == 1
    assert stderr.strip().splitlines()[-1].startswith("ps_bench: error: trainer 1 (rank 1, trainer1) was killed by "
                                                      "SIGKILL"), stderr
    assert sum(is_loopback(address) for address in sockets[pids[0]]) >= 2, sockets  # its store, RPC
    assert sum(is_loopback(address) for address in sockets[pids[-1]]) >= 2, sockets  # the master: RPC, the lighthouse
    assert json.loads(results_path.read_text())["status"] == "failed"


@pytest.mark.timeout(300)
def test_a_torchft_group_that_fails_heals_from_a_live_peer_while_the_others_commit(bench_runs):
    """Three replica groups, the middle one's process ended at iteration 300 of 4200: the other two
    go on committing steps while the launcher starts it again (a new interpreter, seconds), and at
    its first synchronisation it heals from a live peer through torchft's HTTP transport, ending
    with their parameters bit for bit; the job completes and nothing of it is left running."""
    before = ranks_running()
    completed = bench_runs.shared("--hook", "torchft_diloco", "--nserver", "0", "--ntrainer", "3", "--epochs", "40",
                               "--warmup-rounds", "1", "--rounds", "4", "--inject-fault", "trainer:1:300:exit",
                               timeout_s=240)
    assert completed.returncode == 0, completed.output
    results = completed.results
    recovery = results["recovery"]
    group, = recovery["groups_healed"]
    assert group["trainer"] == 1 and group["parameters_equal"] is True
    assert group["norm"] == group["their_norm"] and group["healed_at_step"] > 300 // 16
    assert group["steps_committed_while_away"] >= 1 and 0 < group["restart_s"] < group["recovery_s"] < 30
    assert group["iterations_after_healing"] > 0  # its samples count in the goodput
    dropped, = recovery["trainers_dropped"]
    assert dropped["at_iteration"] == 300 and dropped["living"] == 2
    steps = recovery["steps"]  # a living group's: a synchronisation every 16 iterations
    assert steps["committed"] + steps["failed"] == 4200 // 16 and steps["step_efficiency"] > 0.9
    assert results["replicas"]["identical"] is True  # the two that never failed
    assert "trainer 1's replica group started again" in completed.stdout and "step efficiency" in completed.stdout
    assert ranks_running() - before == set()


def test_a_killed_deepspeed_trainer_ends_the_job_named_and_leaves_nothing(results_path):
    """kill -9 of one rank of a ZeRO-3 job: the job ends, naming it, with every process of the
    session gone (``communicate``) and the finished rounds kept."""
    process = start_bench("--hook", "deepspeed_zero3", "--nserver", "0", "--rounds", "100000", "--rpc-timeout",
                          "600", "--out", str(results_path))
    read_until(process, "[round 3/")
    os.kill(rank_pids(process.pid)[0], signal.SIGKILL)
    _, stderr, _ = communicate(process, 120, "the job")
    assert process.returncode == 1
    assert stderr.strip().splitlines()[-1].startswith("ps_bench: error: trainer 0 (rank 0, trainer0) was killed by "
                                                      "SIGKILL"), stderr
    results = json.loads(results_path.read_text())
    assert results["status"] == "failed" and results["rounds_completed"] >= 1


def test_ctrl_c_stops_a_torchft_job_and_leaves_nothing(results_path):
    process = start_bench("--hook", "torchft_local_sgd", "--nserver", "0", "--rounds", "100000", "--out",
                          str(results_path))
    read_until(process, "[round 2/")
    process.send_signal(signal.SIGINT)
    _, stderr, _ = communicate(process, 120, "the job")
    assert process.returncode == 130 and "interrupted by SIGINT" in stderr, stderr
