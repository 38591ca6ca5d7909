"""The compressors for real (``topk``, ``randomk``, ``signsgd``, ``qsgd``, ``int8``), on the runs
``test_strategies.py`` verifies (2 trainers, DummyModelSmall, --verify): the bytes a trainer
sends an iteration are its record's formula to the byte, the sparse ones a few per cent of
all-reduce's, and top-k of everything without error feedback trains as all-reduce does."""

from __future__ import annotations

import pytest

from ps_bench.metrics.costs import allgather_bytes
from ps_bench.strategies import HOOKS, hook_options

COMPRESSORS = [name for name in HOOKS.names() if HOOKS.record(name).payload == "compressed"]
TRAINERS = 2


def verified(bench_runs, hook: str, *options: str) -> dict:
    return bench_runs.ok("--hook", hook, *options, "--verify", "--rounds", "2", timeout_s=120)


def formula_bytes(results: dict, hook: str) -> int:
    """What the record says a trainer sends an iteration: each dense bucket's message to each of
    the others (all-gather), DDP's buckets as the run built them."""
    codec = HOOKS.record(hook).compressor(hook_options(hook, results["config"]["hook_options"]))
    buckets = results["config"]["model_size"]["ddp_buckets"]
    assert buckets and not any(bucket["sparse"] for bucket in buckets)
    return sum(allgather_bytes(codec.message_bytes(bucket["bytes"] // 4, len(bucket["shapes"])),
                               TRAINERS) for bucket in buckets)


@pytest.mark.parametrize("hook", COMPRESSORS)
def test_bytes_an_iteration_are_the_records_formula(hook, bench_runs):
    results = verified(bench_runs, hook)
    assert results["config"]["ntrainer"] == TRAINERS
    assert results["bytes"]["trainer_sent_per_iter"] == formula_bytes(results, hook)
    assert results["verify"]["grad_rel_error_p50"] > 0  # lossy, and said how much


def test_sparse_and_sign_compressors_send_a_few_per_cent_of_allreduce(bench_runs):
    dense = verified(bench_runs, "allreduce")["bytes"]["trainer_sent_per_iter"]
    assert verified(bench_runs, "topk")["bytes"]["trainer_sent_per_iter"] <= 0.03 * dense
    assert verified(bench_runs, "signsgd")["bytes"]["trainer_sent_per_iter"] <= 0.04 * dense


def test_topk_of_everything_without_error_feedback_is_allreduce(bench_runs):
    whole = verified(bench_runs, "topk", "--hook-option", "ratio=1.0",
                     "--hook-option", "error_feedback=false")
    assert whole["replicas"]["param_norm"] == pytest.approx(
        verified(bench_runs, "allreduce")["replicas"]["param_norm"], rel=1e-5)
    assert whole["verify"]["grad_rel_error_max"] <= 1e-6
