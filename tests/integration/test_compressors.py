"""The compressors for real (``topk``, ``randomk``, ``signsgd``, ``qsgd``, ``int8``), on the runs
``test_strategies.py`` verifies (2 trainers, DummyModelSmall, --verify): the bytes a trainer
sends an iteration are its record's formula to the byte, the sparse ones a few per cent of
all-reduce's, and top-k of everything without error feedback trains as all-reduce does;
through the parameter servers (``ps_compressed``) a trainer sends its messages and receives the
average compressed alike."""

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
    record = HOOKS.record(hook)
    codec = record.compressor(hook_options(hook, results["config"]["hook_options"]))
    buckets = results["config"]["model_size"]["ddp_buckets"]
    assert buckets and not any(bucket["sparse"] for bucket in buckets)
    messages = [codec.message_bytes(bucket["bytes"] // 4, len(bucket["shapes"])) for bucket in buckets]
    if record.needs_servers:  # each message once, to its server
        return sum(messages)
    return sum(allgather_bytes(message, TRAINERS) for message in messages)


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


def test_through_the_servers_signs_go_and_come_back_compressed(bench_runs):
    """signsgd through a server: a trainer sends its signs and scale and receives the signs of
    the sum and their scale (signSGD with majority vote), 104 bytes each way; ``--limits``
    floors those messages' round trips."""
    signs = verified(bench_runs, "ps_compressed", "--hook-option", "compressor=signsgd", "--limits")
    assert signs["bytes"]["trainer_sent_per_iter"] == formula_bytes(signs, "ps_compressed") == 104
    assert signs["bytes"]["trainer_recv_per_iter"] == 104
    assert signs["replicas"]["identical"] is True
    assert signs["limits"]["own"]["bytes_per_iter"] == 104
    assert signs["efficiency"]["floor_of"] == "its own messages"


def test_limits_floor_the_all_gathers_alone(bench_runs):
    """All-gathered, a compressor's floor is its own all-gathers, not the float32 all-reduce it
    avoids, which is what it gains over."""
    results = bench_runs.ok("--hook", "topk", "--nserver", "0", "--limits", "--rounds", "2",
                            timeout_s=120)
    efficiency = results["efficiency"]
    assert efficiency["floor_of"] == "its own steps" and "all_gather" in efficiency["collectives"]
    assert efficiency["floor_ms"] == results["limits"]["steps"]["per_iter_ms"]
    assert efficiency["gain_over_float32"] is not None
    # its encoding runs on backward's thread before the all-gather goes off: recorded per bucket,
    # for predict to count as topk's own compute
    assert results["timeline"] and all(0 < row["held_ms"] <= row["done_ms"] for row in results["timeline"])
