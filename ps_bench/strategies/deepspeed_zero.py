"""DeepSpeed's ZeRO, stages 1, 2 and 3 (``--hook deepspeed_zero1|deepspeed_zero2|deepspeed_zero3``),
from the run's options or from the user's own ds_config.json (``--ds-config FILE``).

Stage 1 partitions the optimizer state, stage 2 the gradients too, stage 3 the parameters too
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020). The trainers' process group is DeepSpeed's data-parallel group (its CPU accelerator
runs collectives on gloo, no oneCCL needed; on a GPU, NCCL). What DeepSpeed 0.19 issues per
iteration, measured on ps_bench's models (``--verify`` shows it): stages 1 and 2 all-reduce the
gradients in buckets (as DDP does) and all-gather the parameters each rank stepped; stage 3
reduce-scatters the gradients and all-gathers the parameters once (its coalesced fetch holds them
from forward through backward). Each also all-reduces a gradient norm of a few bytes. The byte
counter counts all of it from the collectives themselves; with ``--verify`` the run also records
what DeepSpeed's own comms logger saw, to hold one against the other.

A ds_config gives the run its batch size, optimizer and precision (and ``"auto"`` takes the
run's, as the Hugging Face Trainer fills it); a value that conflicts with an option given on the
command line is refused naming both. ps_bench times one optimizer step per micro-batch, steps a
constant learning rate and does not clip (a config's scheduler is left out, saying so). What
cannot run here is refused before anything starts: an unknown stage, ZeRO++'s quantized weights
and gradients and its hierarchical partitions, and offload, without a GPU.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import warnings
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ps_bench.config import ConfigError, RunConfig, read_json
from ps_bench.strategies.base import (OPTIMIZERS, HookContext, OptimizerSpec, Synchroniser,
                                      flat_parameters)
from ps_bench.strategies.record import (COLLECTIVE, ENGINE, EVERY_ITERATION, GATHERED, HOOKS,
                                        SHARDED, Strategy)

# DeepSpeed's optimizer parameters that ps_bench's torch optimizer already does as given (its
# Adam is torch's, bias-corrected, with decoupled weight decay); the torch arguments that choose an
# implementation, not the mathematics, are not the config's to set.
IMPLEMENTED = {"torch_adam": True, "adam_w_mode": True, "bias_correction": True}
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable", "maximize")
# Where the resolved config keeps what ps_bench's optimizer takes besides the run's options; taken
# out before DeepSpeed reads the config.
OPTIMIZER_PARAMS = "ps_bench_optimizer_params"
DEFAULTS = {name: RunConfig.__dataclass_fields__[name].default
            for name in ("batch_size", "lr", "optimizer", "momentum", "weight_decay")}
# DeepSpeed's Adam is AdamW (adam_w_mode)
OPTIMIZER_TYPES = {"sgd": "sgd", "adamw": "adamw", "adam": "adamw"}
ZERO_PLUS_PLUS = ("zero_quantized_weights", "zero_quantized_gradients",
                  "zero_quantized_nontrainable_weights")
OFFLOAD = ("offload_optimizer", "offload_param")


def resolve_config(cfg: RunConfig, stage: int, gpus: int) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed config a run of ``--hook deepspeed_zero{stage}`` trains with: the user's
    ``--ds-config`` (its ``"auto"`` values filled from the run) or a minimal one; the run's batch
    size, optimizer and learning rate are set from it (``cfg`` is updated); and what of the
    user's config the run leaves out, in a line each. ConfigError names the input for anything
    that cannot run here."""
    source = f"--ds-config {cfg.ds_config}" if cfg.ds_config else f"--hook deepspeed_zero{stage}"
    given = read_json(cfg.ds_config, "--ds-config") if cfg.ds_config else {}
    if not isinstance(given, dict):
        raise ConfigError(f"{source} must hold a JSON object (a DeepSpeed config)")
    config = {key: value for key, value in given.items()
              if key not in ("optimizer", "scheduler", "comms_logger")}
    zero = dict(config.get("zero_optimization") or {})
    asked = zero.get("stage", stage)
    if asked == "auto":
        asked = stage
    if asked not in (0, 1, 2, 3) or isinstance(asked, bool):
        raise ConfigError(f"{source}: zero_optimization.stage must be 0, 1, 2 or 3; got {asked!r}")
    if asked != stage:
        raise ConfigError(f"{source} asks for ZeRO stage {asked}, and --hook deepspeed_zero{stage} "
                          f"for stage {stage}: use --hook deepspeed_zero{asked}" if asked else
                          f"{source} turns ZeRO off (stage 0): use --hook allreduce")
    if not gpus:
        cannot = [key for key in ZERO_PLUS_PLUS if zero.get(key)]
        cannot += (["zero_hpz_partition_size"] if (zero.get("zero_hpz_partition_size") or 1) > 1
                   else [])
        cannot += [key for key in OFFLOAD
                   if (zero.get(key) or {}).get("device", "none") not in ("none", None)]
        if cannot:
            raise ConfigError(f"{source}: {', '.join(cannot)} "
                              f"{'needs' if len(cannot) == 1 else 'need'} a GPU (ZeRO++ has no CPU "
                              f"kernels; offload moves state off the GPU), and this run trains on "
                              f"the CPU: leave {'it' if len(cannot) == 1 else 'them'} out")
    # DeepSpeed's own default, as it drops them
    zero = {key: value for key, value in zero.items() if value != "auto"}
    zero["stage"] = stage
    if stage == 3:  # keep no small parameters whole: every parameter partitioned
        zero.setdefault("stage3_param_persistence_threshold", 0)
    config["zero_optimization"] = zero
    take_batch(cfg, config, source)
    params = take_optimizer(cfg, given.get("optimizer"), source)
    if params:
        config[OPTIMIZER_PARAMS] = params
    for precision in ("fp16", "bf16"):
        section = config.get(precision)
        if isinstance(section, dict) and section.get("enabled") == "auto":
            # ps_bench trains in float32 unless told
            config[precision] = {**section, "enabled": False}
    check_precision(config, source, gpus)
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = 0.0
    left = auto_keys(config)
    if left:
        raise ConfigError(f"{source}: ps_bench cannot fill \"auto\" for {', '.join(left)}: "
                          f"give a value")
    # the run's torch optimizer, which DeepSpeed has not vetted
    config["zero_allow_untested_optimizer"] = True
    notes = ([f"{source}: its scheduler ({given['scheduler'].get('type', '?')}) is left out: "
              f"ps_bench steps a constant learning rate (--lr {cfg.lr:g})"]
             if isinstance(given.get("scheduler"), dict) else [])
    return config, notes


def take_batch(cfg: RunConfig, config: dict, source: str) -> None:
    """The micro-batch is the run's ``--batch-size``; one optimizer step per micro-batch."""
    world = cfg.num_trainers
    micro = config.get("train_micro_batch_size_per_gpu", "auto")
    steps = config.get("gradient_accumulation_steps", "auto")
    steps = 1 if steps == "auto" else steps
    if steps != 1:
        raise ConfigError(f"{source}: gradient_accumulation_steps {steps}: ps_bench times one "
                          f"optimizer step per micro-batch; set it to 1 or \"auto\"")
    total = config.get("train_batch_size", "auto")
    if micro == "auto" and total != "auto":
        micro = total // world if isinstance(total, int) and total % world == 0 else total
    if micro != "auto":
        if not isinstance(micro, int) or micro < 1:
            raise ConfigError(f"{source}: train_micro_batch_size_per_gpu must be a whole number; "
                              f"got {micro!r}")
        conflict(cfg, "batch_size", micro, source, "train_micro_batch_size_per_gpu")
        cfg.batch_size = micro
    if total not in ("auto", cfg.batch_size * world):
        raise ConfigError(f"{source}: train_batch_size {total} is not "
                          f"train_micro_batch_size_per_gpu {cfg.batch_size} x {world} trainers")
    config.update(train_micro_batch_size_per_gpu=cfg.batch_size, gradient_accumulation_steps=1,
                  train_batch_size=cfg.batch_size * world)


def take_optimizer(cfg: RunConfig, optimizer: Any, source: str) -> dict[str, Any]:
    """The config's optimizer becomes the run's (a torch optimizer ps_bench builds: nothing to
    compile): its learning rate, momentum and weight decay the run's options, its other
    parameters (betas, eps, nesterov, ...) the optimizer's own keyword arguments, returned;
    "auto" keeps the run's (torch's defaults). A parameter the torch optimizer has no
    counterpart for is refused, naming it."""
    if optimizer is None:
        return {}
    kind = str(optimizer.get("type", "")).lower() if isinstance(optimizer, dict) else ""
    if kind not in OPTIMIZER_TYPES:
        raise ConfigError(f"{source}: optimizer type {kind or optimizer!r} is not one ps_bench "
                          f"runs (SGD, Adam, AdamW)")
    conflict(cfg, "optimizer", OPTIMIZER_TYPES[kind], source, "optimizer.type")
    cfg.optimizer = OPTIMIZER_TYPES[kind]
    params = optimizer.get("params") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{source}: optimizer.params must be an object; got {params!r}")
    torch_class = OPTIMIZERS[cfg.optimizer]
    accepted = set(inspect.signature(torch_class).parameters) - {"params", *IMPLEMENTATION}
    extra = {}
    for name, value in params.items():
        if value == "auto" or IMPLEMENTED.get(name, object()) == value:
            continue
        if name in ("lr", "momentum", "weight_decay"):
            conflict(cfg, name, value, source, f"optimizer.params.{name}")
            setattr(cfg, name, float(value))
        elif name in accepted:
            extra[name] = list(value) if isinstance(value, (list, tuple)) else value
        else:
            raise ConfigError(f"{source}: optimizer.params.{name} {json.dumps(value)}: ps_bench's "
                              f"{kind} is torch's {torch_class.__name__}, which takes "
                              f"{', '.join(sorted(accepted))}; leave {name} out")
    return extra


def check_precision(config: dict, source: str, gpus: int) -> None:
    """bf16 or fp16 enabled: DeepSpeed casts the model, and ps_bench the inputs, to that type;
    fp16 only where DeepSpeed runs it (a GPU), and not both."""
    enabled = [name for name in ("bf16", "fp16") if (config.get(name) or {}).get("enabled") is True]
    if len(enabled) > 1:
        raise ConfigError(f"{source}: bf16 and fp16 are both enabled: DeepSpeed trains in one of "
                          f"them; enable one")
    if enabled == ["fp16"] and not gpus:
        raise ConfigError(f"{source}: fp16 enabled: DeepSpeed trains in float16 on a GPU only, and "
                          f"this run trains on the CPU: enable bf16 instead, or leave fp16 out")


def precision_of(config: dict | None) -> str | None:
    """The dtype a resolved config trains in (``bfloat16``, ``float16``), None for float32."""
    for name, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        if ((config or {}).get(name) or {}).get("enabled") is True:
            return dtype
    return None


def conflict(cfg: RunConfig, name: str, value: Any, source: str, key: str) -> None:
    """A ConfigError if the run's option ``name`` was set (is not its default) to something else."""
    mine = getattr(cfg, name)
    if name in DEFAULTS and mine != DEFAULTS[name] and mine != value:
        raise ConfigError(f"--{name.replace('_', '-')} {mine} and {source}'s {key} {value} "
                          f"disagree: give one")


def auto_keys(config: Any, prefix: str = "") -> list[str]:
    if isinstance(config, dict):
        return [key for name, value in config.items()
                for key in auto_keys(value, f"{prefix}{name}.")]
    return [prefix.rstrip(".")] if config == "auto" else []


def deepspeed_record(stage: int) -> Strategy:
    # the gradients; then the parameters gathered once
    second = "all_reduce" if stage < 3 else "reduce_scatter"
    sends = ((second, "iteration"), ("all_gather", "iteration"))
    return Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=None, family=SHARDED,
                    wrap=ENGINE, identical=GATHERED if stage == 3 else EVERY_ITERATION, sends=sends,
                    engine="deepspeed")


class EngineStep:
    """The optimizer the trainer's loop steps: DeepSpeed's engine, which zeroes the gradients
    itself."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine's step zeroed them."""

    def step(self) -> None:
        self.engine.step()


class DeepSpeedZero(Synchroniser):
    """The model trained by a DeepSpeed engine over the trainers' process group."""

    stage = 1

    def __init__(self, ctx: HookContext) -> None:
        self.engine: Any = None
        self.gathered: torch.Tensor | None = None
        self.comms = None
        self.counted: dict[str, list[int]] = {}

    @classmethod
    def configure(cls, cfg: RunConfig, gpus: int) -> tuple[dict[str, Any], list[str]]:
        """The engine's config, resolved when the job is validated, and notes for the user (see
        ``resolve_config``)."""
        return resolve_config(cfg, cls.stage, gpus)

    @staticmethod
    def check_network(cfg: RunConfig, config: dict[str, Any], network: nn.Module,
                      gpus: int) -> None:
        """What of the model DeepSpeed cannot train here as configured: in bf16 or fp16 it casts
        the parameters and keeps the buffers in float32 unless ``data_types.buffer_dtype`` says
        otherwise, and torch's batch norm on the CPU refuses weights and running statistics of
        two types."""
        precision = precision_of(config)
        buffers = (config.get("data_types") or {}).get("buffer_dtype")
        norms = any(isinstance(module, nn.modules.batchnorm._BatchNorm)
                    for module in network.modules())
        if precision and norms and not gpus and buffers is None:
            short = "bf16" if precision == "bfloat16" else "fp16"
            raise ConfigError(f"--ds-config {cfg.ds_config}: --model {cfg.model} has BatchNorm, "
                              f"whose running statistics DeepSpeed keeps in float32 while it casts "
                              f"the weights to {short}, which torch's batch norm on the CPU "
                              f"refuses: add \"data_types\": {{\"buffer_dtype\": \"{short}\"}} to "
                              f"cast them too, or leave {short} out")

    @staticmethod
    def configured_record(record: Strategy, config: dict[str, Any]) -> Strategy:
        """The record as the resolved config trains: with bf16 or fp16 enabled, the gradients and
        parameters it moves are in that type."""
        return replace(record, payload=precision_of(config) or record.payload)

    def wrap(self, network: nn.Module, ctx: HookContext, ddp_options: dict[str, Any],
             optimizer: OptimizerSpec) -> tuple[nn.Module, EngineStep]:
        device = next(network.parameters()).device
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
        # read by the engine, not used on the CPU
        os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=".*(all_gather_into_tensor|reduce_scatter_tensor)")
        import deepspeed
        import deepspeed.comm.comm as comm

        # an inference all-reduce that DeepSpeed compiles with g++ at start: not needed (the
        # module, not the package's attribute of that name, which is torch)
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        deepspeed.utils.logger.setLevel(logging.ERROR)
        config = {**ctx.engine_config,
                  **({"comms_logger": {"prof_all": True}} if ctx.engine_bytes else {})}
        optimizer = OptimizerSpec(optimizer.kind,
                                  {**optimizer.options, **config.pop(OPTIMIZER_PARAMS, {})})
        precision = precision_of(config)
        # the engine casts the model
        self.input_dtype = getattr(torch, precision) if precision else None
        # the engine's first broadcasts of the parameters are set-up, not training
        ctx.wire.paused = True
        try:
            self.engine, _, _, _ = deepspeed.initialize(
                model=network, optimizer=optimizer.build(network.parameters()), config=config)
        finally:
            ctx.wire.paused = False
        self.comms = comm.comms_logger if ctx.engine_bytes else None
        if self.comms is not None:
            comm.reset_log()
        return self.engine, EngineStep(self.engine)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def engine_counts(self, world: int) -> dict[str, list[int]]:
        """What DeepSpeed's comms logger saw in the round's training (``--verify``): collective ->
        [calls, bytes of the whole tensor] (it records an all-gather's input shard: times the
        world)."""
        counted, self.counted = self.counted, {}
        return counted

    def take_logged(self, world: int) -> dict[str, list[int]]:
        if self.comms is None:
            return {}
        seen: dict[str, list[int]] = {}
        for name, sizes in self.comms.comms_dict.items():
            for size, record in sizes.items():
                whole = size * world if name.startswith("all_gather") else size
                calls, nbytes = seen.setdefault(name, [0, 0])
                seen[name] = [calls + record[0], nbytes + record[0] * whole]
        self.comms.comms_dict.clear()
        return seen

    def end_round(self, ctx: HookContext, model: nn.Module) -> None:
        """The logger's counts of the round's training; stage 3: the full parameters, gathered
        from every trainer's partitions (counted by neither)."""
        self.counted = self.take_logged(ctx.process_group.size())
        if self.stage == 3:
            ctx.wire.paused = True
            try:
                self.gathered = self.full_parameters(model).cpu()
            finally:
                ctx.wire.paused = False
                self.take_logged(ctx.process_group.size())

    def parameters_vector(self, model: nn.Module) -> torch.Tensor:
        if self.stage == 3:
            return self.gathered if self.gathered is not None else torch.empty(0)
        return super().parameters_vector(model)

    def full_parameters(self, model: nn.Module) -> torch.Tensor:
        parameters = list(self.engine.module.parameters())
        if self.stage < 3:
            return flat_parameters(parameters)
        import deepspeed

        with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
            return flat_parameters(parameters)  # cat copies, before the partitions are freed again


@HOOKS.register("deepspeed_zero1", aliases=("ds_zero1",), record=deepspeed_record(1))
class DeepSpeedZero1(DeepSpeedZero):
    """DeepSpeed ZeRO stage 1: the optimizer state partitioned; gradients all-reduced, the
    stepped parameters all-gathered; lossless."""

    stage = 1


@HOOKS.register("deepspeed_zero2", aliases=("ds_zero2",), record=deepspeed_record(2))
class DeepSpeedZero2(DeepSpeedZero):
    """DeepSpeed ZeRO stage 2: the optimizer state and the gradients partitioned; lossless."""

    stage = 2


@HOOKS.register("deepspeed_zero3", aliases=("ds_zero3",), record=deepspeed_record(3))
class DeepSpeedZero3(DeepSpeedZero):
    """DeepSpeed ZeRO stage 3: the parameters partitioned too, all-gathered for forward and
    backward, gradients reduce-scattered; lossless."""

    stage = 3
