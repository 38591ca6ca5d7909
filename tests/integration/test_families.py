"""The sharded and low-communication families, for real: each is what it claims to be on the same
seed (FSDP2 and ZeRO train exactly as all-reduce does; local SGD and DiLoCo reduce to it at a
period of 1), sends what its record says, and keeps identical replicas where it synchronises."""

from __future__ import annotations

import pytest

from ps_bench.strategies import HOOKS
from ps_bench.strategies.record import LOCAL, SHARDED, expected_bytes
from tests.contract import check_contract
from tests.integration.shared_runs import MODEL_BYTES, PER_HOST, QUICK, quick_run

TRAINERS = 2
FAMILIES = [name for name in HOOKS.names() if HOOKS.record(name).family in (SHARDED, LOCAL)]


family_run = quick_run


def reference(bench_runs, *options: str) -> dict:
    """All-reduce on the same seed (``options``: ``--ntrainer 4``)."""
    return quick_run(bench_runs, "allreduce", *options)


def assert_same_parameters(results: dict, baseline: dict) -> None:
    assert results["replicas"]["identical"] is True, results["replicas"]
    assert results["replicas"]["param_norm"] == pytest.approx(baseline["replicas"]["param_norm"], rel=1e-5)
    for which in ("first", "last"):
        assert results["loss"][which] == pytest.approx(baseline["loss"][which], rel=1e-5)


# hsdp: its own test, on two hosts; DeepSpeed's: tests/integration/test_engines.py, against its comms logger too
@pytest.mark.parametrize("hook", [name for name in FAMILIES if HOOKS.record(name).family == SHARDED
                                  and not HOOKS.record(name).per_host and HOOKS.record(name).engine is None])
def test_a_sharded_strategy_ends_with_allreduces_parameters(hook, bench_runs):
    results = family_run(bench_runs, hook, "--verify")
    assert_same_parameters(results, reference(bench_runs))
    assert results["replicas"]["checked_at"] == HOOKS.record(hook).identical
    assert results["verify"]["buckets_checked"] > 0 and results["verify"]["grad_rel_error_max"] < 1e-6


def test_hsdp_shards_within_each_host_and_ends_with_allreduces_parameters(bench_runs):
    """4 trainers, 2 per host: parameters gathered and reduce-scattered among the 2 of a host
    (gloo: an all-reduce of the whole gradient), each host's half all-reduced with the other's."""
    results = family_run(bench_runs, "hsdp", *PER_HOST)
    baseline = reference(bench_runs, "--ntrainer", "4")
    assert_same_parameters(results, baseline)
    within = 2 * (MODEL_BYTES // 2) + MODEL_BYTES  # two all-gathers (n-1)/n, a gloo reduce-scatter 2(n-1)/n
    across = MODEL_BYTES // 2  # a ring all-reduce of the host's shard between two hosts
    assert results["bytes"]["trainer_sent_per_iter"] == within + across
    assert results["config"]["per_host"] == 2


def test_hierarchical_allreduces_within_then_across_hosts_and_ends_with_allreduces_parameters(bench_runs):
    """4 trainers, 2 per host: the bucket all-reduced within the host, each half across hosts by
    one trainer of each, the halves all-gathered within the host; --verify: the exact mean."""
    results = family_run(bench_runs, "hierarchical", *PER_HOST, "--verify")
    baseline = reference(bench_runs, "--ntrainer", "4")
    assert_same_parameters(results, baseline)
    assert results["verify"]["grad_rel_error_max"] < 1e-6, results["verify"]
    within = MODEL_BYTES + MODEL_BYTES // 2  # an all-reduce between two, then an all-gather of halves
    across = MODEL_BYTES // 2  # each half all-reduced between the two hosts
    assert results["bytes"]["trainer_sent_per_iter"] == within + across


@pytest.mark.parametrize("mapping", ["shard", "group"])
def test_ps_node_sums_each_host_once_and_ends_with_allreduces_parameters(mapping, bench_runs):
    """4 trainers, 2 per host, 2 servers: each host's gradient summed within the host, each trainer
    pushing and pulling its half of the sum, the halves all-gathered within the host; --verify:
    the exact mean; --limits: its floor is its halves' round trips to their servers and its sums
    and all-gathers within the host, and it costs no less."""
    results = bench_runs.ok("--hook", "ps_node", *QUICK, "--nserver", "2", "--mapping", mapping, *PER_HOST,
                            "--verify", "--limits", timeout_s=180)
    check_contract(results)
    baseline = reference(bench_runs, "--ntrainer", "4")
    assert_same_parameters(results, baseline)
    assert results["verify"]["grad_rel_error_max"] < 1e-6, results["verify"]
    assert results["bytes"]["server_recv_per_iter"] > 0
    limits, efficiency = results["limits"], results["efficiency"]
    assert limits["own"]["transport"] == "rpc" and limits["own"]["bytes_per_iter"] * 2 == limits["bytes_per_iter"]
    assert set(limits["steps"]["collectives"]) == {"all_reduce", "all_gather"}
    assert efficiency["floor_of"] == "its buckets and its own steps"
    assert efficiency["floor_ms"] == pytest.approx(limits["own"]["p50_ms"] + limits["steps"]["per_iter_ms"])
    assert 0 < efficiency["value"] <= 1.05, efficiency  # a floor is a floor


@pytest.mark.parametrize("hook, options", [("local_sgd", ("period=1",)),
                                           ("diloco", ("period=1", "outer_lr=1", "outer_momentum=0"))])
def test_a_local_strategy_with_a_period_of_one_is_allreduce(hook, options, bench_runs):
    flags = [flag for option in options for flag in ("--hook-option", option)]
    results = family_run(bench_runs, hook, *flags)
    assert_same_parameters(results, reference(bench_runs))
    assert results["bytes"]["trainer_sent_per_iter"] == reference(bench_runs)["bytes"]["trainer_sent_per_iter"]


@pytest.mark.parametrize("period", [4, 16])
def test_local_sgd_averages_every_period_and_sends_a_period_th_of_the_bytes(period, bench_runs):
    """32 iterations a round, a multiple of H: each round holds 32/H averagings, so each trainer
    sent 1/H of what all-reduce sends, and the parameters each trainer hands over, those right
    after its last averaging, are the same on every trainer (not all-reduce's)."""
    results = family_run(bench_runs, "local_sgd", "--hook-option", f"period={period}")
    baseline = reference(bench_runs)
    assert results["replicas"]["identical"] is True and results["replicas"]["checked_at"] == "the last synchronisation"
    assert results["replicas"]["param_norm"] != pytest.approx(baseline["replicas"]["param_norm"], rel=1e-7)
    for key in ("trainer_sent_per_iter", "trainer_recv_per_iter"):
        assert results["bytes"][key] * period == pytest.approx(baseline["bytes"][key])


ADAMW = ("--optimizer", "adamw", "--lr", "0.01")  # diloco's default period, 16, with AdamW inside


def test_fsdp_trains_a_gpt_with_tied_weights_as_allreduce_does(bench_runs):
    """FSDP2 on a GPT: its token embedding and output projection share one parameter, and its
    attention reads a child's weight without calling the child; the run ends with all-reduce's
    parameters and the exact mean gradient; torch's warning for units that return views (its
    own nn.Linear and nn.MultiheadAttention do) is not printed to the user."""
    gpt = ("--model", "gpt2_tiny", "--nserver", "0", "--rounds", "1", "--warmup-rounds", "0")
    baseline = bench_runs.ok("--hook", "allreduce", *gpt, timeout_s=240)
    run = bench_runs.shared("--hook", "fsdp", *gpt, "--verify", timeout_s=240)
    assert run.returncode == 0, run.output
    assert "returned a view tensor" not in run.output
    results = run.results
    check_contract(results)
    assert_same_parameters(results, baseline)
    assert results["verify"]["buckets_checked"] > 0 and results["verify"]["grad_rel_error_max"] < 1e-6


@pytest.mark.parametrize("hook, options, period", [("fsdp", ("--verify",), 1), ("zero1", ("--verify",), 1),
                                                   ("local_sgd", ("--hook-option", "period=4"), 4),
                                                   ("local_sgd", ("--hook-option", "period=16"), 16),
                                                   ("diloco", ADAMW, 16)])
def test_bytes_are_counted_from_the_collectives_each_strategy_issues(hook, options, period, bench_runs):
    """The byte counter reads the collectives torch really calls; the record says which they
    should be: FSDP2 all-gathers each unit's parameters before forward and again before backward,
    and reduce-scatters its gradients (on gloo, an all-reduce); ZeRO all-reduces (its DDP hook)
    and broadcasts each shard it stepped; local SGD and DiLoCo all-reduce the parameters once a
    period."""
    results = family_run(bench_runs, hook, *options)
    expected = expected_bytes(HOOKS.record(hook), MODEL_BYTES, TRAINERS, period)
    if hook == "zero1":  # its hook's all-reduce, counted from the buckets
        expected += reference(bench_runs)["bytes"]["trainer_sent_per_iter"]
    assert results["bytes"]["trainer_sent_per_iter"] == pytest.approx(expected)


def test_diloco_trains_with_adamw_inside_and_records_its_optimizer(bench_runs):
    results = family_run(bench_runs, "diloco", *ADAMW)
    assert results["config"]["optimizer"] == "adamw" and results["config"]["weight_decay"] == 0.01
    assert results["config"]["momentum"] == 0.0 and results["config"]["hook_options"] == {}
    assert results["loss"]["last"] < results["loss"]["first"]
    assert results["replicas"]["identical"] is True  # at its last synchronisation, iteration 64


@pytest.mark.parametrize("hook, options", [("fsdp", ()), ("diloco", ("--hook-option", "period=4"))])
def test_a_target_loss_is_judged_on_the_averaged_model_for_every_family(hook, options, bench_runs):
    results = family_run(bench_runs, hook, "--target-loss", "0.2", "--lr", "0.3", "--max-iterations", "400", *options)
    convergence = results["convergence"]
    assert convergence["reached"] and convergence["stopped_by"] == "target", convergence
    assert convergence["iterations"] < 400
