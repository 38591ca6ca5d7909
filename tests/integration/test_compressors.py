"""The compressors for real (``topk``, ``randomk``, ``signsgd``, ``qsgd``, ``int8``), on the runs
``test_strategies.py`` verifies (2 trainers, DummyModelSmall, --verify): the bytes a trainer
sends an iteration are its record's formula to the byte, the sparse ones a few per cent of
all-reduce's, and top-k of everything without error feedback trains as all-reduce does;
through the parameter servers (``ps_compressed``) a trainer sends its messages and receives the
average compressed alike. On a bucket of an odd number of values, whose messages lie at every
alignment in an all-gather, every compressor runs through both routes at 2 and 3 trainers."""

from __future__ import annotations

import pytest

from ps_bench.metrics.costs import allgather_bytes
from ps_bench.strategies import HOOKS, hook_options

COMPRESSORS = [name for name in HOOKS.names() if HOOKS.record(name).payload == "compressed"]
TRAINERS = 2


def verified(bench_runs, hook: str, *options: str) -> dict:
    return bench_runs.ok("--hook", hook, *options, "--verify", "--rounds", "2", timeout_s=120)


def formula_bytes(results: dict, hook: str, answered: bool = False) -> int:
    """What the record says a trainer sends an iteration: each dense bucket's message to each of
    the others (all-gather), DDP's buckets as the run built them; through the servers, each
    message once, to its server (``answered``: what the server answers it with)."""
    record = HOOKS.record(hook)
    codec = record.compressor(hook_options(hook, results["config"]["hook_options"]))
    buckets = results["config"]["model_size"]["ddp_buckets"]
    assert buckets and not any(bucket["sparse"] for bucket in buckets)
    size = codec.answer_bytes if answered else codec.message_bytes
    messages = [size(bucket["bytes"] // 4, len(bucket["shapes"])) for bucket in buckets]
    if record.needs_servers:
        return sum(messages)
    return sum(allgather_bytes(message, results["config"]["ntrainer"]) for message in messages)


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


# DummyModelSmall at 9 wide and 65 embeddings: one bucket of 945 values in 9 tensors, so that
# signs' messages (119 + 4 bytes, 119 + 36 per tensor), int8's and QSGD's (949, 1894) start
# trainer 1's and 2's rows of an all-gather off a multiple of 4 bytes
ODD = ("--model", "DummyModelSmall", "--model-option",
       "embedding_dim=9,dense_input_size=9,dense_output_size=9,num_embeddings=65")
# (hook options, trainers): every compressor at 3 trainers; the two message layouts (packed signs,
# a byte a value) at 2
GATHERED = [("topk", (), 3), ("randomk", (), 3), ("signsgd", (), 3), ("signsgd", ("per_tensor=true",), 3),
            ("qsgd", (), 3), ("qsgd", ("levels=255",), 3), ("int8", (), 3), ("signsgd", (), 2),
            ("int8", (), 2)]
SERVED = [("signsgd", ()), ("signsgd", ("per_tensor=true", "answer=dense")), ("int8", ()),
          ("qsgd", ("levels=255",)), ("topk", ("answer=dense",)), ("randomk", ())]


def odd_run(bench_runs, hook: str, options: tuple[str, ...], trainers: int, *more: str) -> dict:
    given = [arg for option in options for arg in ("--hook-option", option)]
    servers = "1" if HOOKS.record(hook).needs_servers else "0"
    results = bench_runs.ok("--hook", hook, *given, *ODD, "--ntrainer", str(trainers),
                            "--nserver", servers, "--verify", "--rounds", "2", *more,
                            timeout_s=120)
    (bucket,) = results["config"]["model_size"]["ddp_buckets"]
    assert bucket["bytes"] == 4 * 945 and len(bucket["shapes"]) == 9
    return results


@pytest.mark.parametrize("hook, options, trainers", GATHERED,
                         ids=[f"{h}-{'-'.join(o)}-{t}t" for h, o, t in GATHERED])
def test_all_gathered_messages_of_odd_buckets_decode_on_every_trainer(bench_runs, hook, options,
                                                                      trainers):
    results = odd_run(bench_runs, hook, options, trainers)
    assert results["replicas"]["identical"] is True
    assert results["bytes"]["trainer_sent_per_iter"] == formula_bytes(results, hook)


@pytest.mark.parametrize("compressor, options", SERVED,
                         ids=[f"{c}-{'-'.join(o)}" for c, o in SERVED])
def test_through_the_servers_odd_buckets_go_and_come_back_as_the_formula_says(
        bench_runs, compressor, options):
    dense = "answer=dense" in options
    # --limits on one dense answer: its floor sends the message and gets the gradient back
    limits = ("--limits",) if dense and compressor == "signsgd" else ()
    results = odd_run(bench_runs, "ps_compressed", (f"compressor={compressor}", *options), 3,
                      *limits)
    assert results["replicas"]["identical"] is True
    sent, answered = (formula_bytes(results, "ps_compressed"),
                      formula_bytes(results, "ps_compressed", answered=True))
    assert results["bytes"]["trainer_sent_per_iter"] == sent
    assert results["bytes"]["trainer_recv_per_iter"] == answered
    assert (answered == 4 * 945) == dense
    if limits:
        own = results["limits"]["own"]
        assert (own["bytes_per_iter"], own["answered_bytes_per_iter"]) == (119 + 36, 4 * 945)
