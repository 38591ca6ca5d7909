import dataclasses
import json
from pathlib import Path

import pytest

from ps_bench.config import ConfigError, RunConfig
from ps_bench.runfiles import NOT_RERUN, build_config, load_run_file
from ps_bench.job import validate
from ps_bench.registry import Registry

EARLIER = Path(__file__).resolve().parents[1] / "fixtures" / "ps-2t1s-32d8e0b.json"


def write(tmp_path, data, name="run.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_defaults_run_as_they_are():
    cfg = RunConfig()
    job = validate(cfg, gpus=0)
    model, data = job.model, job.data
    assert (cfg.ntrainer, cfg.nserver, cfg.backend, cfg.hook, cfg.server, cfg.mapping) == (
        2, 1, "gloo", "ps", "average", "shard")  # --nserver left out: 1 for ps
    assert model.id == "DummyModelSmall" and data.id == "DummyDataSmall"


def test_command_line_beats_json_beats_defaults(tmp_path):
    path = write(tmp_path, {"ntrainer": 3, "batch-size": 8, "ddp_hook": "allreduce"})
    cfg = build_config({"ntrainer": 4}, path)
    assert cfg.ntrainer == 4  # command line
    assert cfg.batch_size == 8 and cfg.hook == "allreduce"  # JSON, any spelling, aliases
    assert cfg.epochs == 1 and cfg.nserver is None  # defaults (--nserver: as the hook needs)


def test_unknown_json_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match="unknown option 'ntrainers'; did you mean 'ntrainer'[?] valid options: .*ntrainer"):
        load_run_file(write(tmp_path, {"ntrainers": 2}))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"ntrainer": "two"}', "'ntrainer' must be a whole number"),
        ('{"ntrainer": true}', "'ntrainer' must be a whole number"),
        ('{"lr": "fast"}', "'lr' must be a number"),
        ('{"verify": 1}', "'verify' must be true or false, got 1"),
        ('{"model": 50}', "'model' must be a string, got 50"),
        ('{"ntrainer": 2,}', "not valid JSON: .* line 1 column"),
        ('[1, 2]', "must hold a JSON object"),
    ],
)
def test_bad_run_files(tmp_path, content, message):
    with pytest.raises(ConfigError, match=message):
        load_run_file(write(tmp_path, content))


def test_ints_are_accepted_for_floats(tmp_path):
    assert load_run_file(write(tmp_path, {"lr": 1}))["lr"] == 1.0


def test_missing_run_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_file("/nonexistent/run.json")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"ntrainer": 0}, "at least one trainer"),
        ({"ntrainer": -1}, "--ntrainer must be 0 or more"),
        ({"batch_size": 0}, "--batch-size must be at least 1"),
        ({"rounds": 0}, "--rounds must be at least 1"),
        ({"lr": 0.0}, "--lr must be positive"),
        ({"rpc_timeout": -1.0}, "--rpc-timeout must be positive"),
        ({"master_port": 70000}, "--master-port must be in 1..65535"),
        ({"hook": "rpc_hok"}, "unknown hook 'rpc_hok'; did you mean 'rpc_hook'"),
        ({"server": "avg"}, "--server: unknown server 'avg'"),
        ({"nserver": 0}, "--hook ps sends gradients to parameter servers"),
        ({"mapping": "group", "nserver": 3}, "3 servers need 3 trainers; got 2"),
        ({"model": "Nope"}, "--model 'Nope' is not in .*entries: DummyModel"),
        ({"data_config_path": "/nonexistent.json"}, "does not exist"),
        ({"batch_size": 4096}, "fewer than --batch-size 4096"),
        ({"backend": "nccl"}, "CUDA is needed for --backend nccl"),
        ({"ncudatrainer": 1}, "CUDA is needed for --ncudatrainer 1"),
        ({"ncudaserver": 1}, "CUDA is needed for --ncudaserver 1"),
        ({"backend": "mpi"}, "--backend must be one of gloo, nccl, multi"),
    ],
)
def test_validation_rejects_with_a_message_that_says_what_to_change(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(RunConfig(**overrides), gpus=0)


def test_nccl_needs_one_gpu_per_trainer():
    with pytest.raises(ConfigError, match="one GPU per trainer: 2 trainers on this node, 1 GPU;"):
        validate(RunConfig(backend="nccl"), gpus=1)
    validate(RunConfig(backend="nccl", ntrainer=1), gpus=1)


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "powersgd"])
@pytest.mark.parametrize("backend", ["nccl", "multi"])
def test_sparse_model_cannot_all_reduce_over_nccl(hook, backend):
    with pytest.raises(ConfigError, match="sparse gradients, which NCCL cannot all-reduce"):
        validate(RunConfig(backend=backend, ntrainer=1, hook=hook, model="DummyModelSmallSparse"), gpus=1)


def test_sparse_model_combinations_that_work_on_gpus():
    for backend, hook in [("multi", "hybrid"), ("nccl", "sparse_ps"), ("nccl", "ps"), ("multi", "ps")]:
        validate(RunConfig(backend=backend, ntrainer=1, hook=hook, model="DummyModelSmallSparse"), gpus=1)
    with pytest.raises(ConfigError, match="hybrid all-reduces sparse gradients over gloo: use --backend multi"):
        validate(RunConfig(backend="nccl", ntrainer=1, hook="hybrid", model="DummyModelSmallSparse"), gpus=1)


def test_hook_options_from_json_and_command_line(tmp_path):
    path = write(tmp_path, {"hook": "powersgd", "hook_options": {"matrix_approximation_rank": 4, "warm_start": False}})
    cfg = build_config({"hook_options": {"matrix_approximation_rank": 8}}, path)
    validate(cfg, gpus=0)
    assert cfg.hook_options == {"matrix_approximation_rank": 8, "warm_start": False}
    with pytest.raises(ConfigError, match=r"'hook_options' must be an object of KEY: VALUE, got \[1\]$"):
        load_run_file(write(tmp_path, {"hook_options": [1]}))
    with pytest.raises(ConfigError, match="--hook powersgd: hook 'powersgd' has no option 'rank'"):
        validate(RunConfig(hook="powersgd", hook_options={"rank": 2}), gpus=0)
    # from a run file, where no --hook-option was typed: the error names the hook, not the flag
    bad = write(tmp_path, {"hook": "topk", "nserver": 0, "hook_options": {"ratio": 2}})
    with pytest.raises(ConfigError, match=r"^--hook topk: hook option 'ratio' must be above 0"):
        validate(build_config({}, bad), gpus=0)


def test_model_entry_with_unknown_or_bad_configuration(tmp_path):
    models = {"M": {"model_class": "DummyModel", "configurations": {"width": 3}}}
    with pytest.raises(ConfigError, match="unknown configuration 'width'"):
        validate(RunConfig(model="M", model_config_path=write(tmp_path, models, "m.json")), gpus=0)
    models = {"M": {"model_class": "DummyModel", "configurations": {"embedding_dim": 3, "dense_input_size": 4}}}
    with pytest.raises(ConfigError, match="must equal embedding_dim"):
        validate(RunConfig(model="M", model_config_path=write(tmp_path, models, "m.json")), gpus=0)


def test_validation_canonicalises_upstream_names():
    cfg = RunConfig(hook="rpc_hook", server="AverageParameterServer", trainer="DdpTrainer")
    validate(cfg, gpus=0)
    assert (cfg.hook, cfg.server, cfg.trainer) == ("ps", "average", "ddp")


def test_registry_rejects_duplicates_and_suggests_names():
    registry: Registry = Registry("thing")
    registry.register("alpha", aliases=("a",))(object)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a")(object)
    with pytest.raises(KeyError, match="did you mean 'alpha'"):
        registry.get("alpah")
    assert registry.names() == ["alpha"] and registry.aliases("alpha") == ["a"]


UPSTREAM_DATA = {"DummyData": {"data_class": "DummyData", "configurations": {
    "max_val": 1024, "sample_count": 1024, "sample_length": 1024, "sparsity_percentage": 20}}}


def test_upstream_current_data_file_is_accepted(tmp_path):
    cfg = RunConfig(model="DummyModel", data="DummyData", data_config_path=write(tmp_path, UPSTREAM_DATA))
    job = validate(cfg, gpus=0)
    model, data = job.model, job.data
    assert data.kwargs["sample_count"] == 1024
    assert model.size["parameters"] == 1024 * 1024 + 8 * (1024 * 1024 + 1024)  # upstream's DummyModel


def test_both_spellings_of_one_data_setting_are_refused(tmp_path):
    entry = {"DummyData": {"data_class": "DummyData", "configurations": {
        "max_val": 64, "sample_count": 64, "input_samples": 64, "sample_length": 4, "sparsity_percentage": 0}}}
    cfg = RunConfig(data="DummyData", data_config_path=write(tmp_path, entry))
    with pytest.raises(ConfigError, match="entry 'DummyData': gives both 'sample_count' and 'input_samples'"):
        validate(cfg, gpus=0)


@pytest.mark.parametrize("configurations, message", [
    ({"num_embeddings": -4}, "num_embeddings must be at least 1; got -4"),
    ({"num_embeddings": 0}, "num_embeddings must be at least 1; got 0"),
    ({"num_embeddings": "64"}, "num_embeddings must be an integer; got '64'"),
    ({"sparse": "yes"}, "sparse must be true or false"),
    ({"embedding_dim": 8, "dense_input_size": 9}, "dense_input_size (9) must equal embedding_dim (8)"),
])
def test_bad_model_entry_is_one_line_naming_file_and_entry(tmp_path, configurations, message):
    path = write(tmp_path, {"Bad": {"model_class": "DummyModel", "configurations": {
        "num_embeddings": 64, "embedding_dim": 8, "dense_input_size": 8, "dense_output_size": 8, **configurations}}})
    with pytest.raises(ConfigError) as caught:
        validate(RunConfig(model="Bad", model_config_path=path), gpus=0)
    assert str(caught.value).startswith(f"{path}: entry 'Bad': ") and message in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_constructor_that_raises_anything_is_one_line(tmp_path):
    path = write(tmp_path, {"Huge": {"model_class": "GPT", "configurations": {"width": 10, "heads": 3}}})
    with pytest.raises(ConfigError, match=r"entry 'Huge': width \(10\) must be a multiple of heads \(3\)"):
        validate(RunConfig(model="Huge", model_config_path=path), gpus=0)


@pytest.mark.parametrize("overrides, message", [
    ({"model": "resnet18_small", "data": "DummyDataSmall"},
     "--model resnet18_small takes images but --data DummyDataSmall gives bags of embedding indices"),
    ({"model": "gpt2_tiny", "data": "tokens1024"}, "draws tokens below vocab_size=50257 but the model has 512"),
    ({"model": "dlrm_small", "data": "clicks"}, "has 8 tables and 13 dense features but the model takes 4 and 13"),
    ({"model": "resnet18_small", "batch_size": 1}, "--model resnet18_small needs --batch-size 2 or more"),
    ({"model": "resnet81"}, "did you mean 'resnet18'?"),
])
def test_model_and_data_must_fit(overrides, message):
    with pytest.raises(ConfigError) as caught:
        validate(RunConfig(**overrides), gpus=0)
    assert message in str(caught.value)


def test_zoo_model_brings_its_own_data_and_size():
    cfg = RunConfig(model="gpt2_small")
    job = validate(cfg, gpus=0)
    model, data = job.model, job.data
    assert cfg.data == data.id == "tokens1024" and model.source == data.source == "the model zoo"
    assert 124_000_000 < model.size["parameters"] < 125_000_000  # GPT-2 small, output tied to the embedding
    dlrm = validate(RunConfig(model="dlrm"), gpus=0).model
    assert dlrm.size["sparse_gradient_bytes"] == 4 * 8 * 250_000 * 64  # the tables' gradients are sparse



def test_a_results_file_is_a_run_config_of_the_run_it_holds(tmp_path):
    """``--config RESULTS.json`` makes that run again: its options as the run resolved them, but
    where its results went; the command line still changes any of them."""
    results = json.loads(EARLIER.read_text())
    results["config"]["out"] = "/elsewhere/r.json"
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    again = dataclasses.asdict(build_config({}, str(path)))
    options = {key: value for key, value in results["config"].items() if key not in NOT_RERUN}
    assert {key: again[key] for key in options} == options and again["out"] is None
    assert build_config({"rounds": 9}, str(path)).rounds == 9
    results["config"]["warp"] = 9
    path.write_text(json.dumps(results))
    with pytest.raises(ConfigError, match=r"^results file '.*r\.json''s config: unknown option 'warp'"):
        build_config({}, str(path))
