"""Elastic membership for real. ``--trainer-timeout``: a job of three trainers on parameter
servers loses one, and the two left finish it. A trainer that exits is dropped by the master as
its round fails; one that hangs, by the server whose bucket waited on it past the timeout. From
the drop on, every average is over the trainers that sent it: ``--verify`` holds each delivered
bucket to the exact float64 mean of the living trainers' gradients, and the replicas stay equal.
Nothing is left running, the hung trainer included. ``--server-replicas 1``: a job that loses
one of its two servers goes on, the other answering for it from the copies it kept, and ends
with the parameters of the same job that lost none. Servers that own the parameters
(``--staleness``) go on without a trainer that ends, as they do."""

from __future__ import annotations

import time

import pytest

from tests.benchrun import ranks_running

RUN = ("--hook", "ps", "--ntrainer", "3", "--warmup-rounds", "1", "--rounds", "2", "--verify")


def assert_went_on_with_two(results: dict, dropped: int) -> dict:
    assert results["status"] == "ok" and results["replicas"]["identical"] is True
    verify = results["verify"]
    assert verify["buckets_checked"] > 0 and verify["grad_rel_error_max"] < 1e-6
    entry, = results["recovery"]["trainers_dropped"]
    assert entry["trainer"] == dropped and entry["living"] == 2
    per_trainer = {row["index"]: row["iterations"] for row in results["throughput"]["per_trainer"]}
    assert per_trainer[dropped] < per_trainer[(dropped + 1) % 3] == 42  # 21 a round, 2 timed
    assert results["throughput"]["iterations"] == 42  # a living trainer's
    goodput = results["recovery"]["goodput"]
    assert goodput["committed_samples"] < 3 * 63 * 16  # 63 iterations of 3 trainers' batches
    return entry


@pytest.mark.timeout(300)
def test_a_trainer_that_exits_is_dropped_and_the_living_average_alone(bench_runs):
    before = ranks_running()
    run = bench_runs.shared(*RUN, "--nserver", "1", "--trainer-timeout", "20",
                         "--inject-fault", "trainer:1:30:exit", timeout_s=240)
    assert run.returncode == 0, run.output
    entry = assert_went_on_with_two(run.results, dropped=1)
    # its round failed as its process ended: the master dropped it long before the 20 s
    assert entry["noticed_by"] == "master" and entry["at_iteration"] == 30
    assert entry["failure"] == "InjectedFault: injected fault: trainer 1 at iteration 30 (exit)"
    assert 0 < entry["recovery_s"] < 10
    assert "ps_bench: trainer 1 dropped at iteration 30 by master" in run.stdout
    assert ranks_running() - before == set()


@pytest.mark.timeout(300)
def test_a_trainer_that_hangs_is_dropped_by_the_server_it_kept_waiting(bench_runs):
    before = ranks_running()
    began = time.monotonic()
    run = bench_runs.shared(*RUN, "--nserver", "2", "--trainer-timeout", "1.5",
                         "--inject-fault", "trainer:2:30:hang", timeout_s=240)
    assert run.returncode == 0, run.output
    entry = assert_went_on_with_two(run.results, dropped=2)
    assert entry["noticed_by"] in ("server 0", "server 1") and entry["at_iteration"] == 30
    assert 1.5 <= entry["waited_s"] < 10 and entry["failure"] is None
    # both servers waited on it; the first to notice told the other: one drop
    assert run.stdout.count("dropped at iteration") == 1
    assert ranks_running() - before == set()  # the hung trainer too, stopped after the job
    assert time.monotonic() - began < 120


@pytest.mark.timeout(300)
def test_a_lost_server_is_answered_for_by_its_replica(bench_runs):
    run = ("--hook", "ps", "--hook-option", "partition_mb=0.001", "--ntrainer", "3",
           "--nserver", "2", "--warmup-rounds", "1", "--rounds", "2", "--server-replicas", "1")
    before = ranks_running()
    lost = bench_runs.shared(*run, "--verify", "--inject-fault", "server:1:30:exit", timeout_s=240)
    assert lost.returncode == 0, lost.output
    kept = bench_runs.ok(*run, "--verify", timeout_s=240)
    results = lost.results
    entry, = results["recovery"]["servers_lost"]
    assert (entry["server"], entry["replica"], entry["answered_from_iteration"]) == (1, 0, 30)
    assert entry["failure"] == "InjectedFault: injected fault: server 1 at iteration 30 (exit)"
    assert 0 < entry["recovery_s"] < 2
    assert results["verify"]["grad_rel_error_max"] < 1e-6
    assert results["replicas"]["identical"] is True
    assert results["replicas"]["param_norm"] == pytest.approx(kept["replicas"]["param_norm"],
                                                               rel=1e-6)
    assert "recovery" not in kept or "servers_lost" not in (kept["recovery"] or {})
    assert ranks_running() - before == set()


@pytest.mark.timeout(300)
def test_servers_that_own_the_parameters_go_on_without_a_trainer_that_exits(bench_runs):
    """``--staleness 2``: the servers step the parameters themselves, so a trainer that ends holds
    nothing up once the master has dropped it: the bound counts the living, and the two left
    spend the whole round's budget of updates (three trainers' 21 iterations a round)."""
    before = ranks_running()
    run = bench_runs.shared("--hook", "ps", "--staleness", "2", "--ntrainer", "3", "--nserver", "1",
                         "--warmup-rounds", "1", "--rounds", "2", "--inject-fault", "trainer:1:10:exit",
                         timeout_s=240)
    assert run.returncode == 0, run.output
    results = run.results
    entry, = results["recovery"]["trainers_dropped"]
    assert entry["trainer"] == 1 and entry["living"] == 2
    assert results["staleness"]["max"] <= 2 and results["staleness"]["updates"] >= 2 * 3 * 21
    per_trainer = {row["index"]: row["iterations"] for row in results["throughput"]["per_trainer"]}
    assert per_trainer[1] == 0 and per_trainer[0] + per_trainer[2] >= 2 * 3 * 21
    assert "the servers, which own the parameters, apply their updates" in run.stdout
    assert ranks_running() - before == set()
