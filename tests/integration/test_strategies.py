"""Every registered strategy, for real: speed aside, what it costs in bytes and in accuracy."""

from __future__ import annotations

import pytest

from benchrun import run_bench
from ps_bench.trainers.hooks import HOOKS

pytestmark = pytest.mark.integration

LOSSLESS = {"allreduce", "ps", "sparse_ps", "hybrid"}
LOSSY = {"fp16": "allreduce", "bf16": "allreduce", "powersgd": "allreduce", "batched_powersgd": "allreduce",
         "ps_fp16": "ps", "ps_bf16": "ps"}  # strategy -> the uncompressed strategy it must beat in bytes
NO_COMMUNICATION = {"noop"}
_results: dict[str, dict] = {}


def verified(hook: str, tmp_path_factory) -> dict:
    if hook not in _results:
        out = tmp_path_factory.mktemp(hook) / "results.json"
        run = run_bench("--hook", hook, "--verify", "--rounds", "2", out=out, timeout_s=120)
        assert run.returncode == 0, run.output
        _results[hook] = run.results
    return _results[hook]


def test_every_registered_strategy_is_in_this_table():
    assert set(HOOKS.names()) == LOSSLESS | set(LOSSY) | NO_COMMUNICATION


@pytest.mark.parametrize("hook", sorted(LOSSLESS))
def test_lossless_strategy(hook, tmp_path_factory):
    results = verified(hook, tmp_path_factory)
    assert results["replicas"]["identical"] is True
    check = results["verify"]
    assert check["iterations"] > 0 and check["buckets_checked"] > 0
    assert check["grad_rel_error_max"] <= 1e-6
    assert results["bytes"]["trainer_sent_per_iter"] > 0
    assert results["loss"]["first"] > 0


@pytest.mark.parametrize("hook", sorted(LOSSY))
def test_lossy_strategy_costs_accuracy_and_saves_bytes(hook, tmp_path_factory):
    results = verified(hook, tmp_path_factory)
    baseline = verified(LOSSY[hook], tmp_path_factory)
    assert results["replicas"]["identical"] is True
    assert results["verify"]["grad_rel_error_p50"] > 1e-6
    assert results["bytes"]["trainer_sent_per_iter"] < baseline["bytes"]["trainer_sent_per_iter"]
    assert results["bytes"]["trainer_recv_per_iter"] < baseline["bytes"]["trainer_recv_per_iter"]
    if hook.startswith("ps_"):  # 16-bit on the wire: exactly half of fp32
        assert results["bytes"]["trainer_sent_per_iter"] * 2 == baseline["bytes"]["trainer_sent_per_iter"]
        assert results["bytes"]["server_recv_per_iter"] * 2 == baseline["bytes"]["server_recv_per_iter"]


def test_no_communication_is_not_the_mean(tmp_path_factory):
    results = verified("noop", tmp_path_factory)
    assert results["bytes"]["trainer_sent_per_iter"] == 0
    assert results["verify"]["grad_rel_error_p50"] > 1e-3


def test_sparse_model_reaches_the_same_parameters_with_every_sparse_capable_strategy(tmp_path):
    norms = {}
    for hook in ("allreduce", "ps", "sparse_ps", "hybrid"):
        run = run_bench("--hook", hook, "--model", "DummyModelSmallSparse", "--batch-size", "10",
                        "--rounds", "2", out=tmp_path / f"{hook}.json", timeout_s=120)
        assert run.returncode == 0, run.output
        assert run.results["replicas"]["identical"] is True
        norms[hook] = run.results["replicas"]["param_norm"]
    for hook, norm in norms.items():
        assert abs(norm - norms["allreduce"]) / norms["allreduce"] < 1e-5, norms


def test_powersgd_options_reach_the_hook(tmp_path):
    """A higher rank approximates better: the option really changes what runs."""
    errors = {}
    for rank in (1, 4):
        run = run_bench("--hook", "powersgd", "--hook-option", f"matrix_approximation_rank={rank}", "--verify",
                        "--rounds", "1", out=tmp_path / f"{rank}.json", timeout_s=120)
        assert run.returncode == 0, run.output
        assert run.results["config"]["hook_options"] == {"matrix_approximation_rank": rank}
        errors[rank] = (run.results["verify"]["grad_rel_error_p50"], run.results["bytes"]["trainer_sent_per_iter"])
    assert errors[4][0] < errors[1][0] and errors[4][1] > errors[1][1]


def test_gradients_as_bucket_views_train_exactly_as_copies(tmp_path, tmp_path_factory):
    """--gradient-as-bucket-view only removes copies: the same run reaches the same parameters."""
    copies = verified("ps", tmp_path_factory)
    run = run_bench("--hook", "ps", "--verify", "--rounds", "2", "--gradient-as-bucket-view",
                    out=tmp_path / "views.json", timeout_s=120)
    assert run.returncode == 0, run.output
    views = run.results
    assert views["config"]["gradient_as_bucket_view"] is True and copies["config"]["gradient_as_bucket_view"] is False
    assert views["replicas"]["identical"] is True
    assert views["replicas"]["param_norm"] == copies["replicas"]["param_norm"]
    assert views["loss"] == copies["loss"]
    assert views["verify"]["grad_rel_error_max"] <= 1e-6
