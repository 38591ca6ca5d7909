"""The engines' set-up without processes: a ds_config resolved against the run's options (its
"auto" values filled, conflicts refused naming both, what cannot run on this machine refused),
torchft's options checked, and a missing package named with its install line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ps_bench.cli import main
from ps_bench.config import ConfigError, RunConfig
from ps_bench.runfiles import build_config
from ps_bench.job import validate
from ps_bench.options import parse_run_options
from ps_bench.strategies.deepspeed_config import (OPTIMIZER_PARAMS, regathered_share, resolve_config,
                                                  zero3_gathers)
from ps_bench.strategies import HOOKS
from ps_bench.strategies.base import HookContext, Synchroniser, optimizer_spec
from ps_bench.strategies.record import expected_bytes

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "configs" / "deepspeed" / "zero2_auto.json"


def job(*argv: str, gpus: int = 0):
    return validate(build_config(*parse_run_options(list(argv))), gpus=gpus)


def written(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_a_seed_style_config_takes_the_runs_batch_and_its_own_optimizer():
    built = job("--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", str(SEED), "--lr", "0.003")
    config, cfg = built.engine_config, built.config
    assert cfg.optimizer == "adamw" and cfg.lr == 0.003 and cfg.weight_decay == 0.01  # AdamW's default decay
    assert config["train_micro_batch_size_per_gpu"] == cfg.batch_size == 16 and config["train_batch_size"] == 32
    assert config["gradient_accumulation_steps"] == 1 and config["gradient_clipping"] == 0.0
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is False
    assert "reduce_bucket_size" not in config["zero_optimization"]  # "auto" there: DeepSpeed's own default
    assert "optimizer" not in config and "scheduler" not in config  # the run's torch optimizer, a constant rate
    assert built.notes == (f"--ds-config {SEED}: its scheduler (WarmupLR) is left out: ps_bench steps a constant "
                           f"learning rate (--lr 0.003)",)


def test_a_configs_activation_checkpointing_section_recomputes_every_unit(tmp_path):
    path = written(tmp_path, {"activation_checkpointing": {"partition_activations": True}})
    built = job("--hook", "deepspeed_zero3", "--nserver", "0", "--ds-config", path)
    assert built.config.activation_checkpointing == "full"
    assert "its activation_checkpointing section recomputes every unit" in built.notes[-1]
    chosen = job("--hook", "deepspeed_zero3", "--nserver", "0", "--ds-config", path,
                 "--activation-checkpointing", "selective")
    assert chosen.config.activation_checkpointing == "selective"  # the option given wins


def test_the_configs_values_become_the_runs_unless_an_option_given_disagrees(tmp_path):
    path = written(tmp_path, {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3},
                              "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}})
    built = job("--hook", "deepspeed_zero3", "--nserver", "0", "--ds-config", path)
    assert (built.config.batch_size, built.config.lr, built.config.momentum) == (8, 0.05, 0.9)
    assert built.engine_config["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    with pytest.raises(ConfigError, match=r"^--batch-size 4 and --ds-config .*'s train_micro_batch_size_per_gpu 8 "
                                          r"disagree: give one$"):
        job("--hook", "deepspeed_zero3", "--nserver", "0", "--ds-config", path, "--batch-size", "4")
    with pytest.raises(ConfigError, match=r"--lr 0.1 and --ds-config .*'s optimizer.params.lr 0.05 disagree"):
        job("--hook", "deepspeed_zero3", "--nserver", "0", "--ds-config", path, "--lr", "0.1")


@pytest.mark.parametrize("config, words", [
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage must be 0, 1, 2 or 3; got 5"),
    ({"zero_optimization": {"stage": 3}}, "asks for ZeRO stage 3, and --hook deepspeed_zero2 for stage 2: use --hook "
                                          "deepspeed_zero3"),
    ({"zero_optimization": {"stage": 0}}, "turns ZeRO off (stage 0): use --hook allreduce"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer needs a GPU"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2}},
     "zero_quantized_gradients, zero_hpz_partition_size need a GPU"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be a whole number of micro-batches; "
                                         "got 0"),
    ({"gradient_accumulation_steps": 2.5}, "got 2.5"),
    # a total the micro-batch was derived from was named as the micro-batch
    ({"train_batch_size": "x"}, "train_batch_size must be a whole number of samples; got 'x'"),
    ({"train_batch_size": 3}, "train_batch_size 3 does not divide into 2 trainers x gradient_accumulation_steps 1"),
    ({"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu must be a whole number; got True"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16}, "train_batch_size 64 is not "
                                                                     "train_micro_batch_size_per_gpu 16 x "
                                                                     "gradient_accumulation_steps 1 x 2 trainers"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer type 'lamb' is not one ps_bench runs"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.5, 0.6], "freeze_step": 10}}},
     "optimizer.params.freeze_step 10: ps_bench's adamw is torch's AdamW, which takes amsgrad, betas, eps, lr, "
     "weight_decay; leave freeze_step out"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "optimizer.params.adam_w_mode false"),
    ({"fp16": {"enabled": True}}, "fp16 enabled: DeepSpeed trains in float16 on a GPU only, and this run trains on "
                                  "the CPU: enable bf16 instead, or leave fp16 out"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16 and fp16 are both enabled"),
    ({"steps_per_print": "auto"}, "ps_bench cannot fill \"auto\" for steps_per_print"),
    ([1, 2], "must hold a JSON object"),
])
def test_what_cannot_run_is_one_line_and_exit_2(config, words, tmp_path, capsys):
    path = written(tmp_path, config)
    assert main(["--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", path, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and words in captured.err, captured.err


def test_the_configs_accumulation_is_the_runs_and_a_different_one_given_is_refused(tmp_path, capsys):
    path = written(tmp_path, {"gradient_accumulation_steps": 4, "train_batch_size": 32})
    built = job("--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", path)
    config = built.engine_config
    assert built.config.grad_accum == 4 and built.config.batch_size == 4
    assert config["gradient_accumulation_steps"] == 4 and config["train_micro_batch_size_per_gpu"] == 4
    assert main(["--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", path, "--grad-accum", "2",
                 "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--grad-accum 2 and" in err and "gradient_accumulation_steps 4 disagree" in err
    # --grad-accum alone reaches the config; --precision bf16 enables its bf16, --reduce-dtype is its
    # communication_data_type, and the record sends in it
    built = job("--hook", "deepspeed_zero2", "--nserver", "0", "--grad-accum", "2", "--precision", "bf16",
                "--reduce-dtype", "fp32")
    assert built.engine_config["gradient_accumulation_steps"] == 2 and built.engine_config["bf16"]["enabled"]
    assert built.engine_config["communication_data_type"] == "fp32" and built.strategy.payload == "float32"
    assert job("--hook", "deepspeed_zero2", "--nserver", "0", "--precision", "bf16").strategy.payload == "bfloat16"


def test_fsdp_sends_in_its_reduce_dtype_and_gathers_for_every_micro_batch():
    fsdp = job("--hook", "fsdp", "--nserver", "0", "--precision", "bf16", "--reduce-dtype", "bf16").strategy
    assert fsdp.payload == "bfloat16"
    assert expected_bytes(fsdp, 3200, 2) == expected_bytes(HOOKS.record("fsdp"), 3200, 2) / 2
    # the parameters gathered twice a micro-batch, the gradients reduce-scattered once a step
    assert expected_bytes(HOOKS.record("fsdp"), 3200, 2, micro_batches=4) == 4 * (1600 + 1600) + 3200


def test_offload_and_zero_plus_plus_are_left_to_deepspeed_where_a_gpu_is(tmp_path):
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "zero_quantized_weights": True}
    cfg = RunConfig(hook="deepspeed_zero3", nserver=0, ds_config=written(tmp_path, {"zero_optimization": zero}))
    config, _ = resolve_config(cfg, 3, gpus=8)
    assert config["zero_optimization"]["zero_quantized_weights"] is True


def test_ds_config_goes_with_a_deepspeed_hook_only(tmp_path):
    with pytest.raises(ConfigError, match="--ds-config configures DeepSpeed: it goes with --hook deepspeed_zero1, 2 "
                                          "or 3 \\(got --hook fsdp\\)"):
        job("--hook", "fsdp", "--nserver", "0", "--ds-config", written(tmp_path, {}))


@pytest.mark.parametrize("options, words", [
    (["period=6", "fragments=4"], "hook option 'fragments' must divide the period (6); got 4"),
    (["period=8", "fragments=2", "fragment_sync_delay=4"], "'fragment_sync_delay' must be in [0, period/fragments = "
                                                           "4); got 4"),
    (["outer_momentum=1.0"], "hook option 'outer_momentum' must be in [0, 1); got 1.0"),
])
def test_torchft_diloco_options_are_checked(options, words):
    flags = [flag for option in options for flag in ("--hook-option", option)]
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        job("--hook", "torchft_diloco", "--nserver", "0", *flags)
    with pytest.raises(ConfigError, match="--hook torchft_local_sgd cannot be combined with --verify"):
        job("--hook", "torchft_local_sgd", "--nserver", "0", "--verify")


@pytest.mark.parametrize("hook, package", [("deepspeed_zero1", "deepspeed"), ("torchft_diloco", "torchft")])
def test_without_its_package_an_engine_is_one_line_saying_how_to_install_it(hook, package):
    probe = (f"import sys; sys.modules[{package!r}] = None\n"  # as if it were not installed
             f"from ps_bench.cli import main; sys.exit(main(['--hook', {hook!r}, '--nserver', '0', '--dry-run']))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (f"ps_bench: error: --hook {hook} runs on {package}, which is not installed: "
                           f"pip install -e \".[{package}]\"\n")


def test_every_parameter_of_the_configs_optimizer_reaches_the_runs(tmp_path):
    """Its learning rate, momentum and decay become the run's options; the rest (betas, eps,
    nesterov) the torch optimizer's own arguments, which the engine's wrap takes; what the torch
    optimizer already does as given (torch_adam, adam_w_mode true) needs nothing."""
    path = written(tmp_path, {"optimizer": {"type": "Adam", "params": {
        "lr": 0.002, "betas": [0.5, 0.6], "eps": 1e-6, "weight_decay": 0.1, "torch_adam": True, "adam_w_mode": True}}})
    built = job("--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", path)
    assert (built.config.optimizer, built.config.lr, built.config.weight_decay) == ("adamw", 0.002, 0.1)
    assert built.engine_config[OPTIMIZER_PARAMS] == {"betas": [0.5, 0.6], "eps": 1e-6}
    sgd = written(tmp_path, {"optimizer": {"type": "SGD", "params": {"momentum": 0.9, "nesterov": True}}})
    assert job("--hook", "deepspeed_zero1", "--nserver", "0", "--ds-config", sgd).engine_config[OPTIMIZER_PARAMS] \
        == {"nesterov": True}


def test_the_optimizer_the_engine_steps_is_the_one_limits_steps_its_compute_only_copy_with(tmp_path):
    """The config's own optimizer parameters (betas, nesterov) join the run's in the strategy's
    optimizer, which the trainer hands both to the engine and to --limits' compute-only copy; a
    strategy without an engine steps the run's as it is."""
    path = written(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.5, 0.6]}}})
    built = job("--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", path)
    cfg = built.config
    ctx = HookContext(None, [], "shard", None, False, 60.0, engine_config=built.engine_config)
    run = optimizer_spec(cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay)
    stepped = HOOKS.get("deepspeed_zero2")(ctx).optimizer_for(ctx, run).build([torch.nn.Parameter(torch.ones(2))])
    assert type(stepped) is torch.optim.AdamW
    assert stepped.param_groups[0]["betas"] == (0.5, 0.6) and stepped.param_groups[0]["lr"] == 0.002
    assert Synchroniser().optimizer_for(ctx, run) is run


def test_bf16_enabled_moves_bf16_and_batchnorm_needs_its_buffers_cast_on_the_cpu(tmp_path):
    """DeepSpeed in bf16 moves its gradients and parameters in bf16: the record says so, and with
    it the bytes expected and the floors. It keeps BatchNorm's statistics in float32 unless told."""
    path = written(tmp_path, {"bf16": {"enabled": True}})
    built = job("--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", path)
    assert built.strategy.payload == "bfloat16" and built.strategy.lossless is True
    assert expected_bytes(built.strategy, 3200, 2) == expected_bytes(job("--hook", "deepspeed_zero2", "--nserver",
                                                                          "0").strategy, 3200, 2) / 2
    with pytest.raises(ConfigError, match='has BatchNorm.*add "data_types": {"buffer_dtype": "bf16"}'):
        job("--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", path, "--model", "resnet18_small")
    cast = written(tmp_path, {"bf16": {"enabled": True}, "data_types": {"buffer_dtype": "bf16"}})
    assert job("--hook", "deepspeed_zero2", "--nserver", "0", "--ds-config", cast, "--model", "resnet18_small")


def test_zero3_gathers_again_what_its_coordinator_released():
    """DeepSpeed's ZeRO-3 as its parameter coordinator fetches, prefetches and releases: a
    parameter used again within the reuse distance (the elements of the modules passed over), or
    prefetched for a later step, stays gathered; the rest are gathered again for backward."""
    calls = [(True, [(0, 10)]), (False, [(0, 10)]), (True, [(1, 20)]), (False, [(1, 20)]),
             (True, [(2, 30)]), (False, [(2, 30)])]

    def again(distance: int, prefetch: int = 0) -> int:
        forward, later = zero3_gathers(calls, {"zero_optimization": {
            "stage3_max_reuse_distance": distance, "stage3_prefetch_bucket_size": prefetch}})
        assert forward == 60
        return later

    # forward 10, 20, 30, backward 30, 20, 10: the last module's backward follows it at once,
    # the middle one's after 30 + 30 elements, the first one's after 30 + 30 + 20 + 20
    assert [again(d) for d in (0, 1, 60, 61, 100, 101)] == [60, 30, 30, 10, 10, 0]
    wrapped = [(True, []), *calls, (False, [])]  # in a model: its backward starts before the last
    prefetched = zero3_gathers(wrapped, {"zero_optimization": {"stage3_max_reuse_distance": 0,
                                                               "stage3_prefetch_bucket_size": 1}})
    assert prefetched[1] < 60  # a prefetch fetched some for backward before their release
    assert zero3_gathers(calls) == (60, 0)  # DeepSpeed's defaults: 1e9 elements keep everything
    assert regathered_share(calls, {"zero_optimization": {"stage3_max_reuse_distance": 61,
                                                          "stage3_prefetch_bucket_size": 0}}) == 10 / 60
    tied = calls + [(True, [(0, 10)]), (False, [(0, 10)])]  # the first module's weight used last
    assert zero3_gathers(tied, {"zero_optimization": {"stage3_max_reuse_distance": 10 ** 9}}) == (60, 0)
