"""The model zoo for real: every family trains with a parameter server and with all-reduce, and
what a run says about its size and its bytes can be derived by hand."""

from __future__ import annotations

import os

import pytest
import torch

from ps_bench.metrics.messages import batched_low_rank_factors
from ps_bench.models import DATA_PRESETS, MODEL_PRESETS, PRESET_DATA, TEST_SIZED, build_model
from ps_bench.predict.calibration import low_rank_ratios
from ps_bench.predict.inputs import model_buckets

SMALL = sorted(TEST_SIZED)  # every zoo model registered as a test-sized version of a full-size one
QUICK = ("--warmup-rounds", "1", "--rounds", "1", "--batch-size", "4")


def results_of(bench_runs, model: str, hook: str, *extra: str) -> dict:
    """One run per (model, hook, options), shared by the tests that read it."""
    return bench_runs.ok("--model", model, "--hook", hook, *QUICK, *extra)


# Zoo model classes the tests train at full size, with smaller images, instead of a test-sized preset
# (torchvision's classic CNNs have no smaller form): the test that does.
TRAINED_AT_FULL_SIZE = {"TorchvisionCNN": "test_vgg16_trains_with_a_parameter_server"}


def test_every_zoo_model_class_is_trained_here():
    for small, full in TEST_SIZED.items():  # the same model class at a smaller size
        assert MODEL_PRESETS[full]["model_class"] == MODEL_PRESETS[small]["model_class"]
    classes = {MODEL_PRESETS[name]["model_class"] for name in MODEL_PRESETS}
    tested = {MODEL_PRESETS[name]["model_class"] for name in TEST_SIZED}
    assert classes - tested == set(TRAINED_AT_FULL_SIZE), "a zoo model class that no test trains"
    assert all(test in globals() for test in TRAINED_AT_FULL_SIZE.values())


def test_vgg16_trains_with_a_parameter_server(bench_runs):
    """VGG-16 at its full 138 M parameters (the communication-bound classic: 553 MB of gradients,
    to one server in buckets whole), one round of one iteration (batch 16: the round's 16 samples a trainer) on
    32 x 32 images (its adaptive pooling takes them) so that it computes little. One run: it
    holds about 10 GB across its processes; all-reduce's bytes are checked on smaller models."""
    results = bench_runs.ok("--model", "vgg16", "--data", "images32", "--hook", "ps", "--batch-size", "16",
                            "--warmup-rounds", "0", "--rounds", "1", timeout_s=600)
    assert results["config"]["model_size"]["parameters"] == 138_357_544
    assert results["replicas"]["identical"] is True and results["rounds_completed"] == 1
    assert results["throughput"]["iterations"] == 1
    assert results["bytes"]["trainer_sent_per_iter"] == 4 * 138_357_544  # every gradient, once, to the server


@pytest.mark.parametrize("hook", ["ps", "allreduce"])
@pytest.mark.parametrize("model", SMALL)
def test_zoo_model_trains_with_identical_replicas(model, hook, bench_runs):
    results = results_of(bench_runs, model, hook)
    assert results["status"] == "ok"
    assert results["replicas"]["identical"] is True, results["replicas"]
    assert results["config"]["data"] == PRESET_DATA[model]  # the model's own data, unasked
    assert results["bytes"]["trainer_sent_per_iter"] > 0


@pytest.mark.parametrize("model", SMALL)
def test_size_up_front_matches_the_model(model, bench_runs):
    results = results_of(bench_runs, model, "ps")
    size = results["config"]["model_size"]
    network = build_model(MODEL_PRESETS[model]["model_class"], MODEL_PRESETS[model]["configurations"], 0)
    parameters = list(network.parameters())
    assert size["parameters"] == sum(p.numel() for p in parameters)
    assert size["dense_gradient_bytes"] + size["sparse_gradient_bytes"] == sum(4 * p.numel() for p in parameters)
    buckets = size["ddp_buckets"]  # a sparse bucket's bytes are what its last iteration touched
    assert buckets and sum(b["bytes"] for b in buckets if not b["sparse"]) == size["dense_gradient_bytes"]
    assert any(b["sparse"] for b in buckets) == (size["sparse_gradient_bytes"] > 0)
    if not size["sparse_gradient_bytes"]:  # dense buckets cross the wire whole, there and back
        assert results["bytes"]["trainer_sent_per_iter"] == 4 * size["parameters"]


def powersgd_elements(network: torch.nn.Module, rank: int, min_compression_rate: float = 2.0) -> int:
    """Elements one trainer all-reduces per iteration under torch's PowerSGD: each gradient is
    viewed as an n x m matrix (n = its first dimension); it is compressed to (n + m)·r elements,
    r = min(n, m, rank), when that times min_compression_rate is below n·m, else sent whole
    (1-D tensors always are)."""
    total = 0
    for parameter in network.parameters():
        n = parameter.shape[0]
        m = parameter.numel() // n
        r = min(n, m, rank)
        compressed = (n + m) * r
        total += compressed if parameter.dim() > 1 and compressed * min_compression_rate < n * m else parameter.numel()
    return total


def test_powersgd_bytes_are_what_its_rule_predicts(bench_runs):
    model = "resnet18_small"
    # several buckets in flight: PowerSGD's chained all-reduces must still match across trainers
    results = results_of(bench_runs, model, "powersgd", "--hook-option", "matrix_approximation_rank=2",
                         "--bucket-cap-mb", "0.5")
    assert len(results["config"]["model_size"]["ddp_buckets"]) > 1
    network = build_model(MODEL_PRESETS[model]["model_class"], MODEL_PRESETS[model]["configurations"], 0)
    expected = 4 * powersgd_elements(network, rank=2)  # float32; a 2-rank ring moves the buffer once each way
    assert results["bytes"]["trainer_sent_per_iter"] == expected
    assert expected < 4 * sum(p.numel() for p in network.parameters()) / 10  # it does compress
    # predict --compute-ms knows the same buckets (DDP's first is of the cap given, not 1 MiB)
    # and the same payload from the model built on the meta device
    buckets, _, _, facts = model_buckets(model, 0.5)
    assert [size for size, _, _ in buckets] == [b["bytes"] for b in results["config"]["model_size"]["ddp_buckets"]]
    assert low_rank_ratios(facts.bucket_shapes)["powersgd"] * 4 * facts.parameters == pytest.approx(expected)
    # PowerSGD computes in gloo's callback threads: they must round as the main thread does
    assert results["replicas"]["identical"] is True, results["replicas"]
    assert results["env"]["intra_op_threads"] == int(os.environ["OMP_NUM_THREADS"])  # ps_bench sets it


def test_batched_powersgd_sends_its_factors_whatever_a_bucket_holds(bench_runs):
    """torch's batched PowerSGD has no min_compression_rate: every bucket goes as P and Q of
    ceil(sqrt(n)) x rank, even where that is more than the bucket (8 elements send 12, 64 send
    32), and predict and --limits count it so (``messages.batched_low_rank_factors``)."""
    results = bench_runs.ok("--hook", "batched_powersgd", "--nserver", "0", "--rounds", "1",
                            "--bucket-cap-mb", "0.00001", "--model-option", "dense_layers_count=1")
    sizes = [bucket["bytes"] // 4 for bucket in results["config"]["model_size"]["ddp_buckets"]]
    assert sizes == [8, 64, 512]
    assert results["bytes"]["trainer_sent_per_iter"] == 4 * (2 * 3 * 2 + 2 * 8 * 2 + 2 * 23 * 2)
    assert results["bytes"]["trainer_sent_per_iter"] == 4 * sum(sum(batched_low_rank_factors(n, 2)) for n in sizes)


def test_zoo_data_entries_are_registered_for_every_model():
    for model, data in PRESET_DATA.items():
        assert data in DATA_PRESETS, (model, data)
