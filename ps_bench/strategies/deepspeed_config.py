"""A user's ds_config.json (``--ds-config FILE``) or the run's options, resolved into the config
DeepSpeed's engine is built from (``strategies.deepspeed_zero``): the batch, the micro-batches
an optimizer step (``gradient_accumulation_steps``, ``--grad-accum``), the optimizer and the
precision, ``"auto"`` taking the run's as the Hugging Face Trainer fills it, a value that
conflicts with an option given on the command line refused naming both, and what cannot run
here (an unknown stage, ZeRO++'s quantized weights and gradients and its hierarchical
partitions, offload without a GPU) refused before anything starts. And what ZeRO-3 gathers at
a config's settings, its parameter coordinator replayed over a model's module calls
(``zero3_gathers``), for predict.
"""

from __future__ import annotations

import inspect
import json
from collections import defaultdict, deque
from typing import Any

from ps_bench.config import ConfigError, RunConfig, read_json
from ps_bench.strategies.base import OPTIMIZERS

# DeepSpeed's optimizer parameters that ps_bench's torch optimizer already does as given (its
# Adam is torch's, bias-corrected, with decoupled weight decay); the torch arguments that choose an
# implementation, not the mathematics, are not the config's to set.
IMPLEMENTED = {"torch_adam": True, "adam_w_mode": True, "bias_correction": True}
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable", "maximize")
# Where the resolved config keeps what ps_bench's optimizer takes besides the run's options; taken
# out before DeepSpeed reads the config.
OPTIMIZER_PARAMS = "ps_bench_optimizer_params"
DEFAULTS = {name: RunConfig.__dataclass_fields__[name].default
            for name in ("batch_size", "lr", "optimizer", "momentum", "weight_decay", "grad_accum",
                         "precision")}
# --precision and --reduce-dtype in DeepSpeed's words
PRECISIONS = {"bf16": "bfloat16", "fp16": "float16"}
COMMUNICATION_TYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}
# DeepSpeed's Adam is AdamW (adam_w_mode)
OPTIMIZER_TYPES = {"sgd": "sgd", "adamw": "adamw", "adam": "adamw"}
ZERO_PLUS_PLUS = ("zero_quantized_weights", "zero_quantized_gradients",
                  "zero_quantized_nontrainable_weights")
OFFLOAD = ("offload_optimizer", "offload_param")


def resolve_config(cfg: RunConfig, stage: int, gpus: int) -> tuple[dict[str, Any], list[str]]:
    """The DeepSpeed config a run of ``--hook deepspeed_zero{stage}`` trains with: the user's
    ``--ds-config`` (its ``"auto"`` values filled from the run) or a minimal one; the run's batch
    size, optimizer, learning rate and activation checkpointing are set from it (``cfg`` is
    updated); and what of the user's config the run leaves out, in a line each. ConfigError names
    the input for anything that cannot run here."""
    source = f"--ds-config {cfg.ds_config}" if cfg.ds_config else f"--hook deepspeed_zero{stage}"
    given = read_json(cfg.ds_config, "--ds-config", own_format=False) if cfg.ds_config else {}
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
    check_precision(cfg, config, source, gpus)
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
    if isinstance(given.get("activation_checkpointing"), dict) and (
            cfg.activation_checkpointing == "none"):  # the engine calls no checkpoint itself
        cfg.activation_checkpointing = "full"
        notes.append(f"{source}: its activation_checkpointing section recomputes every unit "
                     f"(--activation-checkpointing full, with torch's checkpoint_wrapper; what "
                     f"it says of partitioning or offloading activations is not modelled)")
    return config, notes


def take_batch(cfg: RunConfig, config: dict, source: str) -> None:
    """The micro-batch is the run's ``--batch-size``, the micro-batches an optimizer step its
    ``--grad-accum`` (DeepSpeed accumulates them, reducing as its stage does)."""
    world = cfg.num_trainers
    micro = config.get("train_micro_batch_size_per_gpu", "auto")
    steps = config.get("gradient_accumulation_steps", "auto")
    if steps != "auto":
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"{source}: gradient_accumulation_steps must be a whole number of "
                              f"micro-batches; got {steps!r}")
        conflict(cfg, "grad_accum", steps, source, "gradient_accumulation_steps")
        cfg.grad_accum = steps
    total = config.get("train_batch_size", "auto")
    if total != "auto" and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise ConfigError(f"{source}: train_batch_size must be a whole number of samples; "
                          f"got {total!r}")
    if micro == "auto" and total != "auto":
        per = world * cfg.grad_accum
        if total % per:
            raise ConfigError(f"{source}: train_batch_size {total} does not divide into {world} "
                              f"trainers x gradient_accumulation_steps {cfg.grad_accum}")
        micro = total // per
    if micro != "auto":
        if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
            raise ConfigError(f"{source}: train_micro_batch_size_per_gpu must be a whole number; "
                              f"got {micro!r}")
        conflict(cfg, "batch_size", micro, source, "train_micro_batch_size_per_gpu")
        cfg.batch_size = micro
    if total not in ("auto", cfg.batch_size * cfg.grad_accum * world):
        raise ConfigError(f"{source}: train_batch_size {total} is not "
                          f"train_micro_batch_size_per_gpu {cfg.batch_size} x "
                          f"gradient_accumulation_steps {cfg.grad_accum} x {world} trainers")
    config.update(train_micro_batch_size_per_gpu=cfg.batch_size,
                  gradient_accumulation_steps=cfg.grad_accum,
                  train_batch_size=cfg.batch_size * cfg.grad_accum * world)


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


def check_precision(cfg: RunConfig, config: dict, source: str, gpus: int) -> None:
    """bf16 or fp16 enabled: DeepSpeed casts the model, and ps_bench the inputs, to that type;
    fp16 only where DeepSpeed runs it (a GPU), and not both. The config's precision is the run's
    (``--precision``; a different one given is refused naming both), and ``--precision`` bf16 or
    fp16 enables it in the config; ``--reduce-dtype`` is its ``communication_data_type``."""
    enabled = [name for name in ("bf16", "fp16") if (config.get(name) or {}).get("enabled") is True]
    if len(enabled) > 1:
        raise ConfigError(f"{source}: bf16 and fp16 are both enabled: DeepSpeed trains in one of "
                          f"them; enable one")
    if enabled:
        conflict(cfg, "precision", enabled[0], source, f"{enabled[0]}.enabled")
        cfg.precision = enabled[0]
    elif cfg.precision != "fp32":
        config[cfg.precision] = {**(config.get(cfg.precision) or {}), "enabled": True}
        enabled = [cfg.precision]
    if cfg.reduce_dtype is not None:
        given = config.get("communication_data_type")
        if given not in (None, "auto", COMMUNICATION_TYPES[cfg.reduce_dtype]):
            raise ConfigError(f"--reduce-dtype {cfg.reduce_dtype} and {source}'s "
                              f"communication_data_type {given} disagree: give one")
        config["communication_data_type"] = COMMUNICATION_TYPES[cfg.reduce_dtype]
    if enabled == ["fp16"] and not gpus:
        raise ConfigError(f"{source}: fp16 enabled: DeepSpeed trains in float16 on a GPU only, and "
                          f"this run trains on the CPU: enable bf16 instead, or leave fp16 out")


def wire_of(config: dict | None) -> str | None:
    """The dtype a resolved config communicates the gradients in: its
    ``communication_data_type``, else the one it trains in; None for float32."""
    given = {"bf16": "bfloat16", "fp16": "float16", "fp32": None}.get(
        (config or {}).get("communication_data_type"), "")
    return given if given != "" else precision_of(config)


def wire_dtypes(config: dict | None, precision: str = "fp32") -> tuple[str, str]:
    """What ZeRO moves the gradients and the parameters in at a resolved config (a run's): its
    ``communication_data_type``, else the dtype it trains in, and the dtype it trains in (its
    parameters' own); with no config, DeepSpeed's defaults with ``precision`` (a run's
    ``--precision``: bf16 or fp16 enabled, as ``check_precision`` enables it)."""
    if config is None:
        config = {} if precision == "fp32" else {precision: {"enabled": True}}
    return wire_of(config) or "float32", precision_of(config) or "float32"


def predicted_config(path: str, precision: str | None) -> tuple[dict, int | None, str | None]:
    """A user's ds_config as predict costs DeepSpeed at it: its ``zero_optimization`` (its
    ``"auto"`` values left to DeepSpeed's defaults, as a run leaves them), the precision it
    enables (``"auto"`` or none: ``precision``, a run's ``--precision``, as a run enables it)
    and its ``communication_data_type``; with the stage it names (None: every stage) and the
    precision it trains in. ConfigError names the file for what no run of it could take."""
    source = f"--ds-config {path}"
    given = read_json(path, "--ds-config", own_format=False)
    if not isinstance(given, dict):
        raise ConfigError(f"{source} must hold a JSON object (a DeepSpeed config)")
    zero = {key: value for key, value in (given.get("zero_optimization") or {}).items()
            if value != "auto"}
    stage = zero.get("stage")
    if stage is not None and (stage not in (1, 2, 3) or isinstance(stage, bool)):
        raise ConfigError(f"{source}: zero_optimization.stage must be 1, 2 or 3 (a deepspeed_zero "
                          f"hook's); got {stage!r}")
    enabled = [name for name in ("bf16", "fp16") if (given.get(name) or {}).get("enabled") is True]
    if len(enabled) > 1:
        raise ConfigError(f"{source}: bf16 and fp16 are both enabled: DeepSpeed trains in one of "
                          f"them; enable one")
    if enabled and precision not in (None, enabled[0]):
        raise ConfigError(f"--precision {precision} and {source}'s {enabled[0]}.enabled disagree: "
                          f"give one")
    precision = enabled[0] if enabled else precision
    config: dict[str, Any] = {"zero_optimization": zero}
    if precision in ("bf16", "fp16"):
        config[precision] = {"enabled": True}
    wire = given.get("communication_data_type")
    if wire not in (None, "auto", *COMMUNICATION_TYPES.values()):
        raise ConfigError(f"{source}: communication_data_type must be one of "
                          f"{', '.join(COMMUNICATION_TYPES.values())}; got {wire!r}")
    if wire not in (None, "auto"):
        config["communication_data_type"] = wire
    return config, stage, precision


def takes_config(stage: int, named: int | None) -> bool:
    """Whether a ds_config naming ZeRO stage ``named`` (None: none) is one for ``stage``."""
    return named in (None, stage)


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


# DeepSpeed's own defaults for ZeRO-3's communication (its runtime/zero/config.py): a parameter
# gathered for a module stays gathered while a module within stage3_max_reuse_distance elements of
# the trace ahead uses it again, or while a prefetch has fetched it for a later use; a prefetch
# gathers the parameters of the trace ahead up to stage3_prefetch_bucket_size elements not yet
# gathered, while fewer than stage3_max_live_parameters are; the gradients are reduce-scattered
# in buckets of reduce_bucket_size elements as backward fills them, on a stream of their own
# (overlap_comm, on by default at stage 3 only).
ZERO3_DEFAULTS = {"stage3_max_reuse_distance": 10 ** 9, "stage3_prefetch_bucket_size": 5 * 10 ** 7,
                  "stage3_max_live_parameters": 10 ** 9}
REDUCE_BUCKET = 5 * 10 ** 8  # reduce_bucket_size


def zero_section(config: dict | None) -> dict:
    """A resolved config's ``zero_optimization`` (None: DeepSpeed's defaults, nothing set)."""
    return (config or {}).get("zero_optimization") or {}


def zero3_gathers(calls: list[tuple[bool, list[tuple[int, int]]]], config: dict | None = None
                  ) -> tuple[int, int]:
    """The elements ZeRO-3 all-gathers in one micro-batch: each parameter's first gather, and
    those after it (gathered again, having been released), as DeepSpeed 0.19's parameter
    coordinator fetches, prefetches and releases them (``PartitionedParameterCoordinator``) at
    the config's ``zero_optimization`` settings (its defaults, ``ZERO3_DEFAULTS``).
    ``calls``: forward's module calls in order, each ``(True, parameters)`` as a module starts
    and ``(False, parameters)`` as it ends, with the ``(parameter, elements)`` it holds itself;
    backward calls the modules in reverse, each starting where forward ended it. A module's
    start gathers its parameters (a step of the trace), takes its uses off the prefetch queue
    and prefetches those of the trace ahead; its end releases each parameter that no prefetch
    fetched for a later step and no module within the reuse distance (the elements of the
    modules passed over) uses again; the step's end releases all."""
    zero = {**ZERO3_DEFAULTS, **zero_section(config)}
    distance, window = zero["stage3_max_reuse_distance"], zero["stage3_prefetch_bucket_size"]
    events = calls + [(not starts, own) for starts, own in reversed(calls)]
    trace = [sorted(own) for starts, own in events if starts]  # the modules, as fetched
    elements = {parameter: size for module in trace for parameter, size in module}
    sizes = [sum(size for _, size in module) for module in trace]
    used = [{parameter for parameter, _ in module} for module in trace]
    queue = deque((parameter, step) for step, module in enumerate(trace) for parameter, _ in module)
    fetched_for: dict[int, int] = defaultdict(lambda: -1)  # the latest use a fetch was for
    held: set[int] = set()
    seen: set[int] = set()  # gathered once already
    gathered = [0, 0]

    def gather(parameters: set[int]) -> None:
        for parameter in parameters - held:
            gathered[parameter in seen] += elements[parameter]
            seen.add(parameter)
        held.update(parameters)

    step = 0
    for starts, module in events:
        mine = {parameter for parameter, _ in module}
        if not starts:  # released, unless fetched for a later step or used again soon enough
            for parameter in mine - {p for p in mine if fetched_for[p] > step}:
                passed, ahead = 0, step
                while ahead < len(trace) and passed < distance and parameter not in used[ahead]:
                    passed += sizes[ahead]
                    ahead += 1
                if ahead == len(trace) or passed >= distance:
                    held.discard(parameter)
            continue
        gather(mine)
        pending = {parameter for parameter in mine if fetched_for[parameter] < step}
        popped: set[int] = set()  # this module's uses, off the queue: not prefetched later
        while queue and len(popped) < len(pending):
            parameter, at = queue.popleft()
            fetched_for[parameter] = at
            popped.add(parameter)
        budget = min(zero["stage3_max_live_parameters"] - sum(elements[p] for p in held), window)
        prefetch: set[int] = set()
        counted = 0
        while queue and counted < budget:
            parameter, at = queue.popleft()
            fetched_for[parameter] = max(fetched_for[parameter], at)
            if parameter not in held and parameter not in prefetch:
                prefetch.add(parameter)
                counted += elements[parameter]
        gather(prefetch)
        step += 1
    return gathered[0], gathered[1]


def reduce_bucket_elements(model: Any, config: dict | None = None) -> int:
    """The elements of the buckets ZeRO reduces the gradients in as backward fills them, whatever
    the model: the config's ``reduce_bucket_size``, else its default."""
    return int(zero_section(config).get("reduce_bucket_size", REDUCE_BUCKET))


def overlap_comm(stage: int, config: dict | None = None) -> bool:
    """Whether ZeRO at ``stage`` reduces the gradients on a stream of their own as backward fills
    its buckets, at a config (None: DeepSpeed's defaults): its ``overlap_comm``, on by default
    at stage 3 only. Where it is off, its reductions wait on backward's stream."""
    given = zero_section(config).get("overlap_comm")
    return stage == 3 if given is None else bool(given)


def regathered_share(calls: list[tuple[bool, list[tuple[int, int]]]],
                     config: dict | None = None) -> float:
    """The share of the parameters' elements ZeRO-3 gathers again, having released them
    (``zero3_gathers``)."""
    forward, backward = zero3_gathers(calls, config)
    return backward / forward if forward else 0.0
