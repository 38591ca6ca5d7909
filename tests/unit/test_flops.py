"""Tokens a second and MFU (``ps_bench.metrics.flops``): a model's FLOPs a token as counted on the
meta device against 6N + 12·L·d·T, the peaks of the GPU table, and what a run's throughput adds."""

from __future__ import annotations

import json

import pytest

from ps_bench.config import RunConfig
from ps_bench.metrics import flops
from ps_bench.models import DATA, DATA_PRESETS, MODELS, default_data, model_entry
from ps_bench.models.entries import Entry, construct, load_entry

pytest.importorskip("transformers")


def test_a_llamas_flops_a_token_are_six_n_plus_its_attention():
    """hf:llama-tiny at 48 tokens: the forward's matrix products and attention counted on the meta
    device, times three, against 6 x the parameters that multiply (the embedding lookup left out)
    + 12 x layers x width x tokens. benchmarks/flops_check.py does Llama-3-8B and 70B at 4096."""
    entry = model_entry("hf:llama-tiny", {}, RunConfig().model_config_path)
    data = load_entry(RunConfig().data_config_path, default_data(entry), "data_class", DATA, "data",
                      DATA_PRESETS)
    tokens = 48
    data = Entry(data.id, data.class_name, {**data.kwargs, "sequence_length": tokens}, data.source)
    counted = flops.model_flops_per_sample(entry, data, MODELS, DATA) / tokens
    network = construct(entry, MODELS)
    config = network.model.config
    embedding, output = (network.model.get_input_embeddings().weight,
                         network.model.get_output_embeddings().weight)
    multiplying = sum(p.numel() for p in network.parameters()) - (0 if embedding is output else embedding.numel())
    assert counted == pytest.approx(6 * multiplying + 12 * config.num_hidden_layers * config.hidden_size * tokens,
                                    rel=0.02)


def test_the_peak_is_the_gpus_in_the_runs_precision_or_the_one_given():
    assert flops.peak_tflops(None, ["NVIDIA H100 80GB HBM3"], "bf16") == (989.4, "NVIDIA H100 80GB HBM3, dense bf16")
    assert flops.peak_tflops(None, ["NVIDIA H100 PCIe"], "fp32")[0] == 51.2
    assert flops.peak_tflops(None, ["NVIDIA H200"], "fp16")[0] == 989.4
    assert flops.peak_tflops(None, ["NVIDIA A100-SXM4-80GB"], "fp32")[0] == 19.5
    assert flops.peak_tflops(None, [], "bf16") is None  # a CPU run: no MFU
    assert flops.peak_tflops(100.0, [], "fp32") == (100.0, "--peak-tflops")


def test_a_runs_throughput_gains_tokens_and_mfu_only_for_sequences():
    assert flops.throughput_of(100.0, 2, None, None, None) == {}
    out = flops.throughput_of(100.0, 2, 64, 64 * 1e9, (10.0, "--peak-tflops"))
    assert out["tokens_per_s"] == 6400 and out["tokens_per_s_per_trainer"] == 3200
    assert out["model_flops_per_token"] == 1e9 and out["model_tflops_per_s_per_trainer"] == pytest.approx(3.2)
    assert out["mfu"] == pytest.approx(0.32) and out["peak_from"] == "--peak-tflops"
    assert "mfu" not in flops.throughput_of(100.0, 2, 64, 64 * 1e9, None)


def test_predict_gives_each_row_its_mfu_against_the_peak_given(tmp_path, capsys):
    from ps_bench.cli import main

    out = tmp_path / "predict.json"
    assert main(["predict", "--model", "hf:llama-tiny", "--batch-size", "2", "--sequence-length", "48",
                 "--compute-ms", "forward=1,backward=2,optimizer=1", "--link", "100gbit", "--trainers", "1,4",
                 "--hooks", "allreduce", "--peak-tflops", "0.001", "--out", str(out)]) == 0
    assert "MFU" in capsys.readouterr().out
    entry = model_entry("hf:llama-tiny", {}, RunConfig().model_config_path)
    data = load_entry(RunConfig().data_config_path, default_data(entry), "data_class", DATA, "data",
                      DATA_PRESETS)
    data = Entry(data.id, data.class_name, {**data.kwargs, "sequence_length": 48}, data.source)
    per_sample = flops.model_flops_per_sample(entry, data, MODELS, DATA)
    for row in json.loads(out.read_text())["predictions"]:
        assert row["mfu"] == pytest.approx(per_sample * 2 / (row["batch_ms"] / 1e3) / 1e9, rel=1e-3), row["trainers"]


def test_predict_says_which_rows_fit_only_with_activation_checkpointing(tmp_path, capsys):
    """A GPU's memory between what a row needs with every unit recomputed and without: the row fits,
    and the table says it does only so."""
    from ps_bench.cli import main

    base = ["predict", "--model", "hf:llama-tiny", "--batch-size", "2", "--sequence-length", "48",
            "--compute-ms", "forward=1,backward=2,optimizer=1", "--link", "100gbit", "--trainers", "4",
            "--hooks", "allreduce"]
    needs = {}
    for mode in ("none", "full"):
        out = tmp_path / f"{mode}.json"
        assert main([*base, "--activation-checkpointing", mode, "--gpu-memory", "1TB", "--out", str(out)]) == 0
        needs[mode] = json.loads(out.read_text())["predictions"][0]["memory_bytes"]
    assert needs["full"] < needs["none"]
    capsys.readouterr()
    between = (needs["full"] + needs["none"]) // 2
    out = tmp_path / "between.json"
    assert main([*base, "--activation-checkpointing", "full", "--gpu-memory", f"{between}B", "--out", str(out)]) == 0
    row, = json.loads(out.read_text())["predictions"]
    assert row["fits"] is True and row["fits_only_recomputing"] is True
    assert "yes, recomputing" in capsys.readouterr().out
