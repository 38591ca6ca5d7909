"""A Hugging Face architecture for real: a tiny Llama built from its config by transformers
trains under every family's strategies, the lossless ones (and local SGD at a period of one)
ending with all-reduce's parameters, and its loss falls to a target."""

from __future__ import annotations

import pytest

from tests.contract import check_contract

TINY = ("--model", "hf:llama-tiny", "--warmup-rounds", "0", "--rounds", "1")  # 2 layers, hidden 64; 16 iterations a round
SGD = ("--optimizer", "sgd", "--lr", "0.1")
SAME_AS_ALLREDUCE = [("fsdp", ("--nserver", "0")), ("zero1", ("--nserver", "0")), ("ps", ("--nserver", "1")),
                     ("local_sgd", ("--nserver", "0", "--hook-option", "period=1"))]


def tiny_run(bench_runs, hook: str, *options: str) -> dict:
    results = bench_runs.ok("--hook", hook, *TINY, *SGD, *options, timeout_s=240)
    check_contract(results)
    return results


@pytest.mark.parametrize("hook, options", SAME_AS_ALLREDUCE, ids=[hook for hook, _ in SAME_AS_ALLREDUCE])
def test_a_tiny_llama_ends_with_allreduces_parameters(hook, options, bench_runs):
    baseline = tiny_run(bench_runs, "allreduce", "--nserver", "0")
    results = tiny_run(bench_runs, hook, *options)
    assert results["replicas"]["identical"] is True, results["replicas"]
    assert results["replicas"]["param_norm"] == pytest.approx(baseline["replicas"]["param_norm"], rel=1e-5)
    assert results["loss"]["last"] == pytest.approx(baseline["loss"]["last"], rel=1e-5)


def test_the_run_records_the_architecture_and_its_size(bench_runs):
    results = tiny_run(bench_runs, "allreduce", "--nserver", "0")
    model = results["config"]["model_config"]
    assert model["class"] == "HuggingFace" and model["source"].endswith("configs/hf/llama-tiny.json")
    assert model["configurations"]["config"]["num_hidden_layers"] == 2
    assert model["configurations"]["config"]["hidden_size"] == 64
    size = results["config"]["model_size"]
    assert size["dense_gradient_bytes"] == 4 * size["parameters"] and size["sparse_gradient_bytes"] == 0
    assert results["config"]["data"] == "tokens64"  # token data with a teacher, unasked
    assert results["bytes"]["trainer_sent_per_iter"] == size["dense_gradient_bytes"]  # 2 trainers: 2(n-1)/n = 1


@pytest.mark.parametrize("hook, options", [
    ("diloco", ("--nserver", "0", "--hook-option", "period=4")),
    ("hsdp", ("--nserver", "0", "--ntrainer", "4", "--per-host", "2")),
], ids=["diloco", "hsdp"])
def test_every_family_trains_a_tiny_llama(hook, options, bench_runs):
    """Beyond the runs above (all-reduce, parameter servers, FSDP2, ZeRO, local SGD): DiLoCo, and
    HSDP on two hosts of two trainers."""
    results = tiny_run(bench_runs, hook, *options)
    assert results["replicas"]["identical"] is True, results["replicas"]
    assert results["bytes"]["trainer_sent_per_iter"] > 0


def test_a_tiny_llamas_loss_falls_to_a_target(bench_runs):
    """From ln 512 = 6.24 (a uniform guess over the vocabulary) to 0.5: it learns the teacher's successors
    (about 60 iterations on the development machine)."""
    results = bench_runs.ok("--hook", "allreduce", "--nserver", "0", "--model", "hf:llama-tiny", "--lr", "0.5",
                            "--target-loss", "0.5", "--max-iterations", "400", timeout_s=300)
    convergence = results["convergence"]
    assert convergence["reached"] and convergence["stopped_by"] == "target", convergence
    assert results["loss"]["last"] < results["loss"]["first"]
    assert convergence["held_out"][-1][2] < 1.0  # sequences it never saw follow the same successors
