"""Servers that own the parameters (``--staleness S``), for real: bulk-synchronous equals the
synchronous ``ps`` strategy, the bound holds, a slow trainer costs less when the others need
not wait for it, stragglers slow down synchronous runs too, and a killed trainer ends the job."""

from __future__ import annotations

import pytest

from tests.benchrun import run_bench
from tests.contract import check_contract

STRAGGLING = ("--ntrainer", "3", "--nserver", "1", "--straggler", "trainer:1:10ms", "--rounds", "2")


def staleness_run(bench_runs, bound: str, *extra: str) -> dict:
    results = bench_runs.ok("--staleness", bound, *extra, timeout_s=180)
    check_contract(results)
    return results


def test_bulk_synchronous_gives_the_parameters_of_synchronous_ps(bench_runs):
    ssp = staleness_run(bench_runs, "0", "--rounds", "2")
    ps = bench_runs.ok("--hook", "ps", "--rounds", "2", timeout_s=120)
    assert ssp["staleness"]["max"] == 0 and ssp["staleness"]["updates"] == 2 * ssp["throughput"]["iterations"]
    # the same arithmetic in another place (the servers step, not the trainers): float rounding
    # apart, which compounds over the iterations to a few parts in a million at most (once 3.7e-6
    # on a busy machine); a wrong average or a stale update moves the loss by 1e-3 or more
    assert ssp["replicas"]["param_norm"] == pytest.approx(ps["replicas"]["param_norm"], rel=2e-5)
    for which in ("first", "last"):  # every trainer's loss, iteration by iteration, averaged per round
        assert ssp["loss"][which] == pytest.approx(ps["loss"][which], rel=2e-5)
    assert ssp["config"]["trainer"] == ssp["config"]["server"] == "ssp"


def test_no_update_is_applied_staler_than_the_bound(bench_runs):
    stale = staleness_run(bench_runs, "2", *STRAGGLING)["staleness"]
    assert stale["bound"] == "2" and stale["updates"] > 0
    assert stale["max"] == 2  # the others run ahead of the slow trainer as far as the bound lets them


def test_without_waiting_for_a_slow_trainer_the_others_do_more(bench_runs):
    synchronous = staleness_run(bench_runs, "0", *STRAGGLING)
    free = staleness_run(bench_runs, "inf", *STRAGGLING)
    ratio = free["throughput"]["samples_per_s"] / synchronous["throughput"]["samples_per_s"]
    assert ratio > 1.3, ratio
    per_trainer = {entry["index"]: entry["iterations"] for entry in free["throughput"]["per_trainer"]}
    assert per_trainer[0] > per_trainer[1] < per_trainer[2]
    assert len({entry["iterations"] for entry in synchronous["throughput"]["per_trainer"]}) == 1
    assert free["staleness"]["max"] > 2 and synchronous["staleness"]["max"] == 0
    assert free["config"]["straggler"] == ["trainer:1:10ms"]
    # each iteration pushes the gradients and reads the parameters, whatever the trainers' counts
    # (the bytes were over a rounded count, and a round's first pull went uncounted: recv 3125)
    dense = free["config"]["model_size"]["dense_gradient_bytes"]
    moved = free["bytes"]
    assert moved["trainer_sent_per_iter"] == pytest.approx(dense) == moved["trainer_recv_per_iter"]
    assert moved["server_recv_per_iter"] == pytest.approx(3 * dense)


TRANSIENT = ("--ntrainer", "3", "--nserver", "1", "--straggler", "any:30ms:0.2", "--rounds", "2")


def test_a_bounded_staleness_absorbs_stragglers_that_come_and_go(bench_runs):
    """Each trainer is delayed in a fifth of its iterations (several times an iteration), never
    the same trainer for long: a synchronous run waits for whoever is slow each time, a run with
    --staleness 4 lets the delays even out within the bound."""
    synchronous = staleness_run(bench_runs, "0", *TRANSIENT)
    bounded = staleness_run(bench_runs, "4", *TRANSIENT)
    ratio = bounded["throughput"]["samples_per_s"] / synchronous["throughput"]["samples_per_s"]
    assert ratio > 1.2, ratio
    assert 0 < bounded["staleness"]["max"] <= 4 and synchronous["staleness"]["max"] == 0
    assert bounded["config"]["straggler"] == ["any:30ms:0.2"]


def test_asynchronous_training_reaches_a_target_judged_on_the_servers_model(bench_runs):
    results = staleness_run(bench_runs, "inf", *STRAGGLING[:-2], "--target-loss", "0.2", "--lr", "0.3")
    convergence = results["convergence"]
    assert convergence["reached"] and convergence["stopped_by"] == "target"
    assert convergence["held_out"][-1][0] == convergence["iterations"]
    assert convergence["held_out"][-1][2] < convergence["held_out"][0][2] / 2
    assert convergence["seconds"] == convergence["loss_curve"][-1][1] > 0


def test_a_straggler_slows_a_synchronous_run_too(bench_runs):
    results = bench_runs.ok("--hook", "allreduce", "--nserver", "0", "--straggler", "trainer:1:20ms", "--rounds", "1",
                            timeout_s=120)
    p50 = {(entry["rank"], metric): sorted(values)[len(values) // 2]
           for entry in results["samples"] for metric, values in entry["metrics"].items()}
    assert p50[(1, "forward")] >= 20 > p50[(0, "forward")]
    assert p50[(0, "comm")] >= 10  # trainer 0 waits for it in the all-reduce


def test_a_killed_server_ends_the_job_named(results_path):
    """The servers own the parameters: losing one ends the job (a trainer lost is gone on without,
    ``test_membership``)."""
    run = run_bench("--staleness", "1", "--inject-fault", "server:0:5:exit", "--rpc-timeout", "30",
                    out=results_path, timeout_s=180)
    assert run.returncode == 1
    assert "server 0 (rank 2, server2) exited with status 3" in run.stderr.strip().splitlines()[-1], run.stderr
    assert run.results["status"] == "failed"
