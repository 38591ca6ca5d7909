"""Training as users run it: gradient accumulation (``--grad-accum``) and mixed precision
(``--precision``, ``--reduce-dtype``), for real. Four micro-batches of 4 train exactly as one
batch of 16 and, where the strategy synchronises once a step, send the same bytes; DeepSpeed
accumulates as its config says, its comms logger agreeing; bf16 runs verify, and FSDP2 sends in
its reduce dtype."""

from __future__ import annotations

import pytest

from ps_bench.strategies import HOOKS
from ps_bench.strategies.record import expected_bytes
from tests.benchrun import ROOT
from tests.integration.shared_runs import MODEL_BYTES, QUICK, quick_run

ACCUMULATED = ("--grad-accum", "4", "--batch-size", "4")  # the default batch of 16 in 4 micro-batches
PS = ("--hook", "ps", "--rounds", "2")  # one server, as the staleness tests run it


def norm(results: dict) -> float:
    return results["replicas"]["param_norm"]


def sent(results: dict) -> float:
    return results["bytes"]["trainer_sent_per_iter"]


def test_accumulated_micro_batches_train_as_one_batch_and_hooks_send_once_a_step(bench_runs):
    """DDP's all-reduce (``no_sync`` before the last micro-batch) and the parameter servers: the
    same parameters as batch 16, the same bytes per optimizer step; the step is the iteration the
    results count, and its samples are 16."""
    for whole, accumulated in ((quick_run(bench_runs, "allreduce"), quick_run(bench_runs, "allreduce", *ACCUMULATED)),
                               (bench_runs.ok(*PS, timeout_s=120), bench_runs.ok(*PS, *ACCUMULATED, timeout_s=120))):
        assert accumulated["config"]["grad_accum"] == 4 and accumulated["config"]["batch_size"] == 4
        assert norm(accumulated) == pytest.approx(norm(whole), rel=1e-5)
        assert sent(accumulated) == pytest.approx(sent(whole), rel=0.02)
        assert accumulated["throughput"]["iterations"] == whole["throughput"]["iterations"]
        assert accumulated["throughput"]["samples_per_iteration"] == whole["throughput"]["samples_per_iteration"] == 16


def test_fsdp_accumulates_without_reducing_and_gathers_for_every_micro_batch(bench_runs):
    whole = quick_run(bench_runs, "fsdp", "--verify")
    accumulated = quick_run(bench_runs, "fsdp", *ACCUMULATED)
    assert norm(accumulated) == pytest.approx(norm(whole), rel=1e-5)
    # set_requires_gradient_sync: one reduce-scatter a step; the parameters gathered twice a micro-batch
    assert sent(accumulated) == expected_bytes(HOOKS.record("fsdp"), MODEL_BYTES, 2, micro_batches=4)
    assert sent(whole) == expected_bytes(HOOKS.record("fsdp"), MODEL_BYTES, 2)


def test_a_ds_config_that_accumulates_runs_as_deepspeed_does_it(bench_runs):
    """gradient_accumulation_steps 4 and train_micro_batch_size_per_gpu 4 under ZeRO-2: the batch of
    16's parameters, and ZeRO-2's reduction at every micro-batch, as DeepSpeed's logger counts it."""
    path = ROOT / "configs" / "deepspeed" / "zero2_accumulate.json"
    results = bench_runs.ok("--hook", "deepspeed_zero2", *QUICK, "--ds-config", str(path), "--verify",
                            timeout_s=240)
    assert results["config"]["grad_accum"] == 4 and results["config"]["batch_size"] == 4
    assert norm(results) == pytest.approx(norm(quick_run(bench_runs, "allreduce")), rel=1e-5)
    assert sent(results) == pytest.approx(results["verify"]["engine_sent_per_iter"], rel=0.02)
    engine = results["verify"]["engine"]
    # the gradients all-reduced at every micro-batch (and a norm of a few bytes), gathered once
    assert engine["all_reduce"]["bytes_per_iter"] == pytest.approx(4 * MODEL_BYTES, abs=16)
    assert engine["all_gather_into_tensor"]["bytes_per_iter"] == MODEL_BYTES


def test_bf16_autocast_verifies_and_fsdp_sends_in_its_reduce_dtype(bench_runs):
    verified = quick_run(bench_runs, "allreduce", "--precision", "bf16", "--verify")
    assert verified["config"]["precision"] == "bf16" and verified["replicas"]["identical"] is True
    fp32 = sent(quick_run(bench_runs, "fsdp", "--verify"))
    half = quick_run(bench_runs, "fsdp", "--precision", "bf16", "--reduce-dtype", "bf16")
    assert sent(half) == pytest.approx(fp32 / 2, rel=0.05)
    assert sent(quick_run(bench_runs, "fsdp", "--precision", "bf16", "--reduce-dtype", "fp32")) == \
        pytest.approx(fp32, rel=0.05)
    assert half["config"]["reduce_dtype"] == "bf16"


@pytest.mark.parametrize("hook", ["allreduce", "fsdp"])
def test_compiled_units_train_as_eager_ones_and_compile_in_the_warmup(hook, bench_runs):
    """``--compile``: the model's units compiled with inductor on the CPU before the strategy wraps
    them (DDP's and FSDP2's), the gradients as exact as --verify asks, the same parameters as
    eager at the end, and the compile time in the warmup, apart from the timed rounds."""
    eager = quick_run(bench_runs, hook, "--verify")
    compiled = quick_run(bench_runs, hook, "--verify", "--compile")
    assert compiled["config"]["compile"] is True and "compile" not in eager
    books = compiled["compile"]
    assert books["backend"] == "inductor" and books["units"] == 5  # DummyModelSmall's 5 layers
    assert books["warmup_s"] > 0 and books["timed_rounds_s"] == 0
    assert len(books["per_trainer"]) == 2
    assert compiled["verify"]["grad_rel_error_max"] <= 1e-6
    assert norm(compiled) == pytest.approx(norm(eager), rel=1e-5)
