"""Every registered DDP-hook strategy (the all-reduce and parameter-server families), for real:
speed aside, what it costs in bytes and in accuracy, as its ``Strategy`` record says (a new
strategy is tested here without editing a table). The sharded and local families have their own,
``test_families.py``."""

from __future__ import annotations

import math

import pytest

from ps_bench.metrics.messages import low_rank_factors
from ps_bench.predict.inputs import model_buckets
from ps_bench.predict.memory import kept_bytes
from ps_bench.strategies import HOOKS, hook_options
from ps_bench.strategies.record import ALLREDUCE, SERVERS

# hierarchical needs hosts of several trainers: its own test, tests/integration/test_families.py
HOOK_STRATEGIES = [name for name in HOOKS.names() if HOOKS.record(name).family in (ALLREDUCE, SERVERS)
                   and not HOOKS.record(name).per_host]
LOSSLESS = [name for name in HOOK_STRATEGIES if HOOKS.record(name).lossless]
LOSSY = [name for name in HOOK_STRATEGIES if HOOKS.record(name).uncompressed]
SILENT = [name for name in HOOK_STRATEGIES if HOOKS.record(name).transport is None]
HALF_WIDTH = ("float16", "bfloat16")


def verified(bench_runs, hook: str) -> dict:
    """One verified run per strategy, shared by every test that reads it."""
    return bench_runs.ok("--hook", hook, "--verify", "--rounds", "2", timeout_s=120)


def test_every_strategy_is_lossless_lossy_or_silent():
    assert sorted(LOSSLESS + LOSSY + SILENT) == HOOK_STRATEGIES


@pytest.mark.parametrize("hook", LOSSLESS)
def test_lossless_strategy(hook, bench_runs):
    results = verified(bench_runs, hook)
    assert results["replicas"]["identical"] is True
    check = results["verify"]
    assert check["iterations"] > 0 and check["buckets_checked"] > 0
    assert check["grad_rel_error_max"] <= 1e-6
    assert results["bytes"]["trainer_sent_per_iter"] > 0
    assert results["loss"]["first"] > 0


@pytest.mark.parametrize("hook", LOSSY)
def test_lossy_strategy_costs_accuracy_and_saves_bytes(hook, bench_runs):
    record = HOOKS.record(hook)
    results, baseline = verified(bench_runs, hook), verified(bench_runs, record.uncompressed)
    assert results["replicas"]["identical"] is True
    assert results["verify"]["grad_rel_error_p50"] > 1e-6
    for key in ("trainer_sent_per_iter", "trainer_recv_per_iter"):
        assert results["bytes"][key] < baseline["bytes"][key]
    if record.payload in HALF_WIDTH:  # 16 bits on the wire: exactly half of float32, to servers and back
        for key, moved in results["bytes"].items():
            assert moved * 2 == baseline["bytes"][key], key
    memory = results["memory"]["trainer"]
    assert memory["peak_bytes"] == (memory["model_states"]["total_bytes"] + memory["activations_bytes"]
                                    + memory["buffers_bytes"])
    kept, gradients = memory["buffers_bytes"], memory["model_states"]["gradients_bytes"]
    options = hook_options(hook, {})
    feedback = options.get("error_feedback")
    if feedback is None and record.compressor is not None:
        feedback = record.compressor(options).error_feedback
    if record.family == SERVERS and record.payload in HALF_WIDTH:
        # every bucket copied as it travels, in 16 bits, and kept for the next iteration
        assert kept * 2 == gradients
    elif record.factors is not None:  # PowerSGD: each bucket's error, and its P and Q (warm start)
        shapes = [bucket["shapes"] for bucket in results["config"]["model_size"]["ddp_buckets"]]
        if record.factors == "tensor":
            factors = sum(p + q for _, p, q in (low_rank_factors(bucket, 2, 2.0) for bucket in shapes))
            assert kept == gradients + 4 * factors
        else:  # the bucket as one square matrix, its error padded to the square
            sides = [math.isqrt(sum(math.prod(shape) for shape in bucket) - 1) + 1 for bucket in shapes]
            assert kept == 4 * sum(side * side + 2 * side * 2 for side in sides)
    else:  # error feedback keeps a float32 residual of each bucket; without it nothing is kept
        assert kept == (gradients if feedback else 0), (hook, feedback)
    if not (record.family == SERVERS and record.payload in HALF_WIDTH):  # those copies: CPU only
        # what predict adds to a GPU's memory for the strategy, from the model on the meta device
        facts = model_buckets(results["config"]["model"], results["config"]["bucket_cap_mb"])[3]
        assert kept_bytes(hook, facts) == kept


@pytest.mark.parametrize("hook", SILENT)
def test_no_communication_is_not_the_mean(hook, bench_runs):
    results = verified(bench_runs, hook)
    assert results["bytes"]["trainer_sent_per_iter"] == 0
    assert results["verify"]["grad_rel_error_p50"] > 1e-3


def test_powersgd_options_reach_the_hook(bench_runs):
    """A lower rank than the default (2) approximates worse and sends less: the option really
    changes what runs."""
    default = verified(bench_runs, "powersgd")
    low = bench_runs.ok("--hook", "powersgd", "--hook-option", "matrix_approximation_rank=1", "--verify",
                        "--rounds", "2", timeout_s=120)
    assert low["config"]["hook_options"] == {"matrix_approximation_rank": 1} and default["config"]["hook_options"] == {}
    assert low["verify"]["grad_rel_error_p50"] > default["verify"]["grad_rel_error_p50"]
    assert low["bytes"]["trainer_sent_per_iter"] < default["bytes"]["trainer_sent_per_iter"]


def test_gradients_as_bucket_views_train_exactly_as_copies(bench_runs):
    """--gradient-as-bucket-view only removes copies: the same run reaches the same parameters."""
    copies = verified(bench_runs, "ps")
    views = bench_runs.ok("--hook", "ps", "--verify", "--rounds", "2", "--gradient-as-bucket-view", timeout_s=120)
    assert views["config"]["gradient_as_bucket_view"] is True and copies["config"]["gradient_as_bucket_view"] is False
    assert views["replicas"]["identical"] is True
    assert views["replicas"]["param_norm"] == copies["replicas"]["param_norm"]
    assert views["loss"] == copies["loss"]
    assert views["verify"]["grad_rel_error_max"] <= 1e-6
