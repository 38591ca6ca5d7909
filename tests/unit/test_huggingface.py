"""Hugging Face architectures from their config, without processes: the shipped configs give the
published sizes on the meta device, predict builds DDP's buckets for them, and bad input is one
line and exit 2 before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ps_bench.cli import main
from ps_bench.config import ConfigError, RunConfig
from ps_bench.job import validate
from ps_bench.models import MODELS, build_data, build_model, model_entry
from ps_bench.models.entries import construct, model_size
from ps_bench.models.huggingface import SHIPPED, shipped
from ps_bench.strategies.sharded import shard_units

ROOT = Path(__file__).resolve().parents[2]
# Parameters of each shipped config as published by its authors (model cards, papers), and as
# transformers counts them: GPT-2 124M, Llama 3 8B and 70B, Mistral 7B, Qwen2.5 7B (7.61 B),
# Mixtral 8x7B (46.7 B), T5-base (223 M, its embedding shared by encoder, decoder and output),
# BERT-Base (110 M; as a language model its output is tied to the token embedding, no pooler).
PUBLISHED = {"gpt2": 124.44e6, "llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "mistral-7b": 7.24e9,
             "qwen2.5-7b": 7.61e9, "mixtral-8x7b": 46.70e9, "t5-base": 222.9e6, "bert-base": 110e6}


def entry(name: str, **options):
    return model_entry(f"hf:{name}", options, RunConfig().model_config_path)


def test_ps_bench_ships_the_architectures_users_train():
    assert set(PUBLISHED) | {"llama-tiny"} == set(shipped())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_shipped_config_has_its_published_size_on_the_meta_device(name):
    size = model_size(construct(entry(name), MODELS))
    assert size["parameters"] == pytest.approx(PUBLISHED[name], rel=0.005)
    assert size["dense_gradient_bytes"] == 4 * size["parameters"] and size["sparse_gradient_bytes"] == 0


def test_the_run_records_the_config_it_used_in_float32_without_dropout():
    config = entry("gpt2", n_layer=2).kwargs["config"]
    assert config["n_layer"] == 2 and config["model_type"] == "gpt2"
    assert config["attn_pdrop"] == config["resid_pdrop"] == config["embd_pdrop"] == 0.0
    assert "torch_dtype" not in config and "dtype" not in config
    assert entry("gpt2", n_layer=2, attn_pdrop=0.1).kwargs["config"]["attn_pdrop"] == 0.1  # asked for: kept
    network = construct(entry("llama3-8b", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                              num_attention_heads=4, num_key_value_heads=2), MODELS)
    assert {p.dtype for p in network.parameters()} == {__import__("torch").float32}


def test_the_default_token_data_fits_a_small_vocabulary_and_context(tmp_path):
    """A config of 256 tokens and a 32-token context trains on the default data as it stands
    (its tokens and sequences fitted to the model); naming data that does not fit says what to pass."""
    config = tmp_path / "small_vocab.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "max_position_embeddings": 32}))
    job = validate(RunConfig(model=f"hf:{config}", ntrainer=2, nserver=0, hook="allreduce"))
    assert job.data.id == "tokens64" and job.data.kwargs["vocab_size"] == 256
    assert job.data.kwargs["sequence_length"] == 32
    network = build_model(job.model.class_name, job.model.kwargs, 0)
    data = build_data(job.data.class_name, job.data.kwargs, 0, job.config.labels)
    loss = torch.nn.functional.cross_entropy(network(data.inputs[0][:4]), data.targets[:4])
    assert torch.isfinite(loss)
    with pytest.raises(ConfigError, match="the model has 256 .leave --data out"):
        validate(RunConfig(model=f"hf:{config}", data="tokens64", ntrainer=2, nserver=0, hook="allreduce"))


def test_fsdp_wraps_each_transformer_block():
    network = construct(entry("llama-tiny"), MODELS)
    assert [type(unit).__name__ for unit in shard_units(network)] == ["LlamaDecoderLayer"] * 2
    t5 = construct(entry("t5-base", num_layers=2, num_decoder_layers=3), MODELS)
    assert [type(unit).__name__ for unit in shard_units(t5)] == ["T5Block"] * 5


def test_predict_builds_ddps_buckets_for_a_real_size_config(tmp_path, capsys):
    out = tmp_path / "predict.json"
    code = main(["predict", "--model", "hf:llama3-8b", "--batch-size", "1", "--compute-ms",
                 "forward=100,backward=200,optimizer=20", "--link", "100gbit", "--intra-link", "2400gbit",
                 "--per-node", "8", "--nodes", "1,16", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    buckets = json.loads(out.read_text())["calibration"]["buckets"]
    parameters = model_size(construct(entry("llama3-8b"), MODELS))["parameters"]
    assert sum(bucket["bytes"] for bucket in buckets) == 4 * parameters
    assert len(buckets) > 100  # 25 MiB buckets over 32 GB of gradients
    capsys.readouterr()


def test_model_options_shrink_a_zoo_model_too():
    job = validate(RunConfig(model="gpt2_tiny", model_options={"layers": 1}, hook="allreduce", nserver=0), gpus=0)
    assert job.model.kwargs["layers"] == 1


@pytest.mark.parametrize("argv, words", [
    (["--model", "hf:missing.json"], "--model hf:missing.json: no config file 'missing.json' and no config of that "
                                     "name shipped in configs/hf"),
    (["--model", "hf:{tmp}/unknown.json"], "model_type 'no-such-architecture' is not an architecture transformers"),
    (["--model", "hf:{tmp}/malformed.json"], "is not valid JSON"),
    (["--model", "hf:{tmp}/no-type.json"], "has no \"model_type\""),
    # transformers 5's own checks of a config's values (a traceback and exit 1 before)
    (["--model", "hf:{tmp}/uneven.json"], "--model hf:{tmp}/uneven.json: '{tmp}/uneven.json': The hidden size (100) is "
                                          "not a multiple of the number of attention heads (32)."),
    (["--model", "hf:llama-tiny", "--model-option", "hidden_size=66"],
     "--model-option: The hidden size (66) is not a multiple of the number of attention heads (4)."),
    (["--model", "hf:llama-tiny", "--model-option", "num_hidden_layer=2"],
     "--model-option num_hidden_layer: the llama config has no such key"),
    (["--model", "gpt2_tiny", "--model-option", "depth=2"], "--model-option: --model gpt2_tiny has no configuration"),
    # the option given, not the file's entry it changed, is named
    (["--model", "DummyModelSmall", "--model-option", "dense_layers_count=0"],
     "--model-option dense_layers_count=0: --model DummyModelSmall: dense_layers_count must be at least 1; got 0"),
    (["--model", "hf:llama-tiny", "--hook", "sparse_ps"], "--hook sparse_ps is made for sparse embedding gradients"),
    (["--model", "hf:llama-tiny", "--data", "tokens1024"], "draws tokens below vocab_size=50257 but the model has 512"),
    (["--model", "hf:llama-tiny", "--model-option", "max_position_embeddings=32", "--data", "tokens64"],
     "has sequences of 64 tokens but the model's context is 32 (leave --data out"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(argv, words, tmp_path, capsys):
    (tmp_path / "unknown.json").write_text(json.dumps({"model_type": "no-such-architecture", "hidden_size": 8}))
    (tmp_path / "malformed.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    (tmp_path / "no-type.json").write_text(json.dumps({"hidden_size": 64}))
    (tmp_path / "uneven.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 100,
                                                      "num_attention_heads": 32}))
    code = main([word.replace("{tmp}", str(tmp_path)) for word in argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1 and words.replace("{tmp}", str(tmp_path)) in captured.err, captured.err


def test_without_transformers_an_hf_model_is_one_line_saying_how_to_install_it():
    probe = ("import sys; sys.modules['transformers'] = None\n"  # as if it were not installed
             "from ps_bench.cli import main; sys.exit(main(['--model', 'hf:llama-tiny', '--dry-run']))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ('ps_bench: error: --model hf:...: Hugging Face models need the transformers package: '
                           'pip install -e ".[hf]"\n')


def test_nothing_of_transformers_is_imported_unless_an_hf_model_is_asked_for():
    probe = ("import sys\nfrom ps_bench.cli import check\ncheck(['--model', 'gpt2_tiny', '--hook', 'fsdp', "
             "'--nserver', '0'])\ncheck(['predict', '--model', 'resnet18', '--batch-size', '8', '--compute-ms', "
             "'forward=1,backward=2,optimizer=1', '--link', '1gbit'])\nprint('transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr


def test_every_shipped_config_is_a_config_json_of_its_architecture():
    for path in SHIPPED.glob("*.json"):
        config = json.loads(path.read_text())
        assert isinstance(config.get("model_type"), str) and config.get("architectures"), path.name
    with pytest.raises(ConfigError, match="no config file"):
        entry("llama-3-8b")
