"""Memory beside time, for real: the model states each trainer holds, counted from its tensors,
against the model predict costs memory with (``ps_bench.predict.memory``), on a shrunk Llama
(hf:llama-tiny, 139,584 parameters in 21 tensors) on 4 trainers with AdamW."""

from __future__ import annotations

import json

import pytest

from ps_bench.predict.inputs import model_buckets
from ps_bench.predict.memory import model_states
from ps_bench.strategies import HOOKS

pytest.importorskip("transformers")

TRAINERS = 4
LLAMA = ("--model", "hf:llama-tiny", "--optimizer", "adamw", "--ntrainer", str(TRAINERS),
         "--nserver", "0", "--rounds", "1", "--warmup-rounds", "0")


def held(results: dict) -> dict:
    return results["memory"]["trainer"]["model_states"]


def predicted(hook: str, precision: str = "fp32") -> dict:
    facts = model_buckets("hf:llama-tiny", 25.0)[3]
    return model_states(HOOKS.record(hook), facts, TRAINERS, 1, precision, "adamw")


def test_each_strategy_holds_its_share_of_the_model_states(bench_runs, tmp_path):
    """allreduce holds everything whole and fsdp a quarter of it, both to the byte as predict
    counts them; zero1 a quarter of the optimizer state; DeepSpeed ZeRO-3 in bf16 its partitions
    of the 16-bit parameters and gradients and of the float32 master weights and moments (what
    DeepSpeed's estimator adds, the float32 gradient partition, is made during the step)."""
    whole = bench_runs.ok(*LLAMA, "--hook", "allreduce", timeout_s=180)
    sharded = bench_runs.ok(*LLAMA, "--hook", "fsdp", timeout_s=180)
    zero1 = bench_runs.ok(*LLAMA, "--hook", "zero1", timeout_s=180)
    for results, hook in ((whole, "allreduce"), (sharded, "fsdp")):
        expected = predicted(hook)
        assert {key: held(results)[f"{key}_bytes"] for key in ("parameters", "gradients", "optimizer")} == {
            key: expected[f"{key}_bytes"] for key in ("parameters", "gradients", "optimizer")}, hook
    assert held(whole)["parameters_bytes"] == 4 * 139_584
    assert held(sharded)["total_bytes"] == pytest.approx(held(whole)["total_bytes"] / TRAINERS, rel=0.10)
    assert held(zero1)["optimizer_bytes"] == pytest.approx(held(whole)["optimizer_bytes"] / TRAINERS, rel=0.10)
    assert held(zero1)["parameters_bytes"] == held(whole)["parameters_bytes"]
    memory = whole["memory"]["trainer"]
    assert memory["activations_bytes"] > 0 and memory["peak_from"].startswith("model states")
    # a model of sequences: tokens a second; no MFU on a CPU without --peak-tflops
    throughput = whole["throughput"]
    assert throughput["tokens_per_s"] == pytest.approx(throughput["samples_per_s"] * 64)
    assert throughput["model_flops_per_token"] > 6 * 139_584 / 2 and "mfu" not in throughput
    assert memory["peak_bytes"] == memory["model_states"]["total_bytes"] + memory["activations_bytes"]

    config = tmp_path / "zero3_bf16.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    zero3 = held(bench_runs.ok(*LLAMA, "--hook", "deepspeed_zero3", "--ds-config", str(config),
                               timeout_s=240))
    expected = predicted("deepspeed_zero3", "bf16")
    shard = 139_584 // TRAINERS
    assert zero3["parameters_bytes"] == expected["parameters_bytes"] == 2 * shard
    assert zero3["gradients_bytes"] == 2 * shard  # the 16-bit partition, kept between steps
    # master weights and moments (and one step count); predict adds the float32 gradients
    assert zero3["optimizer_bytes"] == 12 * shard + 4 == expected["optimizer_bytes"] - 4 * shard


def test_a_parameter_server_holds_two_sums_of_its_share_after_ddp_rebuilds_its_buckets(bench_runs):
    """DDP rebuilds its buckets after the first iteration, here into another layout (ResNet-18's
    small form with 2 MiB buckets), and the trainers deal the new layout's pieces over the
    servers from the third: between rounds the servers let go of the pieces the round's last
    iteration did not send them, and hold two sums (the turns an answer on its way needs) of
    each piece they own: 2 x its share of the gradients (until 2026-11-28, 4.2 x)."""
    results = bench_runs.ok("--model", "resnet18_small", "--bucket-cap-mb", "2", "--nserver", "2",
                            "--batch-size", "4", "--warmup-rounds", "1", "--rounds", "1", timeout_s=180)
    dense = results["config"]["model_size"]["dense_gradient_bytes"]
    held = results["memory"]["server"]["model_states"]["gradients_bytes"]  # the server that holds the most
    assert dense / 2 * 2 <= held <= dense / 2 * 2 * 1.1, (held, dense)
    assert results["replicas"]["identical"] is True


def test_activation_checkpointing_changes_no_gradient_and_keeps_what_predict_counts(bench_runs, tmp_path):
    """``--activation-checkpointing full`` under allreduce, fsdp and DeepSpeed's ZeRO-3: the same
    parameters at the end as without it (every unit recomputed gives the same gradients), fewer
    activations kept, and predict's count of them on the meta device within 10 % of the run's,
    with checkpointing and without."""
    config = tmp_path / "zero3_bf16.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}))
    for hook, extra in (("allreduce", ()), ("fsdp", ()), ("deepspeed_zero3", ("--ds-config", str(config)))):
        plain = bench_runs.ok(*LLAMA, "--hook", hook, *extra, timeout_s=240)
        recomputed = bench_runs.ok(*LLAMA, "--hook", hook, *extra, "--activation-checkpointing", "full",
                                   "--peak-tflops", "2", timeout_s=240)
        throughput = recomputed["throughput"]  # its recomputation is no model FLOP
        assert throughput["mfu"] == pytest.approx(throughput["model_tflops_per_s_per_trainer"] / 2)
        assert throughput["model_flops_per_token"] == plain["throughput"]["model_flops_per_token"]
        assert recomputed["replicas"]["param_norm"] == pytest.approx(plain["replicas"]["param_norm"], rel=1e-6), hook
        kept = {mode: results["memory"]["trainer"]["activations_bytes"]
                for mode, results in (("none", plain), ("full", recomputed))}
        assert kept["full"] < kept["none"] / 2, (hook, kept)
        if hook == "allreduce":
            cfg = plain["config"]
            for mode, measured in kept.items():
                facts = model_buckets("hf:llama-tiny", 25.0, None, cfg["batch_size"], None, "fp32",
                                      cfg.get("data_config"), mode)[3]
                assert facts.activations_bytes == pytest.approx(measured, rel=0.10), (mode, facts.activations_bytes)
