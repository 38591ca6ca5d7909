import json

import pytest

from ps_bench.config import ConfigError, RunConfig, build_config, load_run_file, validate
from ps_bench.registry import Registry


def write(tmp_path, data, name="run.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_defaults_run_as_they_are():
    cfg = RunConfig()
    model, data = validate(cfg, gpus=0)
    assert (cfg.ntrainer, cfg.nserver, cfg.backend, cfg.hook, cfg.server, cfg.mapping) == (
        2, 1, "gloo", "ps", "average", "shard")
    assert model.id == "DummyModelSmall" and data.id == "DummyDataSmall"


def test_command_line_beats_json_beats_defaults(tmp_path):
    path = write(tmp_path, {"ntrainer": 3, "batch-size": 8, "ddp_hook": "allreduce"})
    cfg = build_config({"ntrainer": 4}, path)
    assert cfg.ntrainer == 4  # command line
    assert cfg.batch_size == 8 and cfg.hook == "allreduce"  # JSON, any spelling, aliases
    assert cfg.nserver == 1  # default


def test_unknown_json_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'ntrainers'; valid keys: .*ntrainer"):
        load_run_file(write(tmp_path, {"ntrainers": 2}))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"ntrainer": "two"}', "'ntrainer' must be int"),
        ('{"ntrainer": true}', "'ntrainer' must be int"),
        ('{"lr": "fast"}', "'lr' must be float"),
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
    with pytest.raises(ConfigError, match="one GPU per trainer: 2 trainers on this node, 1 GPUs"):
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
    with pytest.raises(ConfigError, match="'hook_options' must be dict"):
        load_run_file(write(tmp_path, {"hook_options": [1]}))
    with pytest.raises(ConfigError, match="--hook-option: hook 'powersgd' has no option 'rank'"):
        validate(RunConfig(hook="powersgd", hook_options={"rank": 2}), gpus=0)


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
