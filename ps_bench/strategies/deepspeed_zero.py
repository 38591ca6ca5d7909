"""DeepSpeed's ZeRO, stages 1, 2 and 3 (``--hook deepspeed_zero1|deepspeed_zero2|deepspeed_zero3``),
from the run's options or from the user's own ds_config.json (``--ds-config FILE``).

Stage 1 partitions the optimizer state, stage 2 the gradients too, stage 3 the parameters too
(Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020). The trainers' process group is DeepSpeed's data-parallel group (its CPU accelerator
runs collectives on gloo, no oneCCL needed; on a GPU, NCCL). What DeepSpeed 0.19 issues per
iteration, measured on ps_bench's models (``--verify`` shows it): stages 1 and 2 all-reduce the
gradients in buckets (as DDP does) and all-gather the parameters each rank stepped; stage 3
reduce-scatters the gradients and all-gathers the parameters once (its coalesced fetch holds them
from forward through backward; a model past its prefetch and reuse distance has some gathered
again for backward: ``deepspeed_config.zero3_gathers``). Each also all-reduces a gradient norm
of a few bytes. The byte counter counts all of it from the collectives themselves; with
``--verify`` the run also records what DeepSpeed's own comms logger saw, to hold one against
the other.

A ds_config gives the run its batch size, optimizer and precision (and ``"auto"`` takes the
run's, as the Hugging Face Trainer fills it); a value that conflicts with an option given on the
command line is refused naming both (``strategies.deepspeed_config``). Its micro-batches an
optimizer step are the run's ``--grad-accum`` or the config's ``gradient_accumulation_steps``:
DeepSpeed accumulates them itself, reducing as its stage does. ps_bench steps a constant
learning rate and does not clip (a config's scheduler is left out, saying so). What
cannot run here is refused before anything starts: an unknown stage, ZeRO++'s quantized weights
and gradients and its hierarchical partitions, and offload, without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ps_bench.config import ConfigError, RunConfig
from ps_bench.metrics.memory import state_tensors
from ps_bench.strategies.base import HookContext, OptimizerSpec, Synchroniser, flat_parameters
from ps_bench.strategies.checkpoints import own_entry
from ps_bench.metrics import costs
from ps_bench.strategies.deepspeed_config import (OPTIMIZER_PARAMS, overlap_comm, precision_of,
                                                  reduce_bucket_elements, regathered_share,
                                                  resolve_config, takes_config, wire_dtypes,
                                                  wire_of)
from ps_bench.strategies.record import (COLLECTIVE, COLLECTIVE_BUCKETS, ENGINE, EVERY_ITERATION,
                                        GATHERED, GRADIENTS, HOOKS, OPTIMIZER, PARAMETERS, SHARDED,
                                        Cost, Holds, Strategy)

CHECKPOINT_TAG = "deepspeed"  # the tag of the engine's checkpoint, in each step's folder

def deepspeed_record(stage: int) -> Strategy:
    # the gradients, then the stepped parameters gathered once; with micro-batches (--grad-accum),
    # stage 1 reduces at the step's last, stages 2 and 3 at every one, and stage 3 gathers the
    # parameters for every one
    sends = {1: (("all_reduce", "iteration"), ("all_gather", "iteration")),
             2: (("all_reduce", "micro-batch"), ("all_gather", "iteration")),
             3: (("reduce_scatter", "micro-batch"), ("all_gather", "micro-batch"))}[stage]
    # stage 1 partitions the optimizer state, 2 the gradients too, 3 the parameters too
    sharded = (OPTIMIZER, GRADIENTS, PARAMETERS)[:stage]
    # with overlap_comm (DeepSpeed's default at stage 3 only), the gradients reduced in buckets
    # of reduce_bucket_size as backward fills them, on a stream of their own (stage 1 on the
    # step's last micro-batch); without, after backward. Stage 3 gathers the parameters for
    # forward, and again for backward those it released after forward (zero3_gathers).
    cost = Cost(COLLECTIVE_BUCKETS, bucket_ms=costs.sharded_reduce_ms if stage == 3 else None,
                overlapped=(sends[0][0],), bucket_elements=reduce_bucket_elements,
                overlaps=partial(overlap_comm, stage),
                regathered=regathered_share if stage == 3 else None, wire=wire_dtypes,
                takes_config=partial(takes_config, stage))
    return Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=None, family=SHARDED,
                    wrap=ENGINE, identical=GATHERED if stage == 3 else EVERY_ITERATION, sends=sends,
                    engine="deepspeed", reduce_dtype=True, cost=cost, not_compiled=NOT_COMPILED,
                    holds=Holds(sharded, gathers="layer" if stage == 3 else "", master_copy=True,
                                half_gradients=stage < 3))


NOT_COMPILED = ("DeepSpeed's engine wraps the model's modules (stage 3 swaps each parameter for a "
                "placeholder it gathers around the module's forward) and compiles them through its "
                "own engine.compile()")


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

    casts_itself = True  # its config's bf16 or fp16: the model cast, no torch.autocast
    scales_micro_losses = False  # it divides each micro-batch's loss by its accumulation steps

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
        """The record as the resolved config trains: the gradients it moves in its
        ``communication_data_type``, else in the type it trains in (bf16 or fp16 enabled)."""
        return replace(record, payload=wire_of(config) or record.payload)

    def held_tensors(self, model: nn.Module, optimizer: Any) -> dict[str, list[torch.Tensor]]:
        """What the engine's ZeRO optimizer holds: the parameters (stage 3: this trainer's
        partition of them), the gradients (the 16-bit ones and their reduced partitions), and
        as optimizer state the float32 master partition, its float32 gradient and the inner
        optimizer's moments, as DeepSpeed's estimators count them."""
        zero = self.engine.optimizer

        def tensors(name: str) -> list[torch.Tensor]:
            found = getattr(zero, name, None)
            values = ([found] if isinstance(found, torch.Tensor) else
                      found.values() if isinstance(found, dict) else found or [])
            flat = [v for value in values
                    for v in (value if isinstance(value, (list, tuple)) else [value])]
            return [v for v in flat if isinstance(v, torch.Tensor)]

        if self.stage == 3:
            parameters, master = (tensors("fp16_partitioned_groups_flat"),
                                  tensors("fp32_partitioned_groups_flat"))
            gradients = tensors("grad_partitions_flat_buffer")
        else:
            parameters, master = (tensors("bit16_groups_flat"),
                                  tensors("single_partition_of_fp32_groups"))
            gradients = [p.grad for p in model.parameters() if p.grad is not None]
            gradients += tensors("averaged_gradients")
        return {"parameters": parameters, "gradients": gradients,
                "optimizer": master + [t.grad for t in master if t.grad is not None]
                + state_tensors(zero.optimizer.state)}

    def optimizer_for(self, ctx: HookContext, optimizer: OptimizerSpec) -> OptimizerSpec:
        """The run's optimizer with the ds_config's own parameters of it (betas, eps, nesterov)."""
        return OptimizerSpec(optimizer.kind,
                             {**optimizer.options, **ctx.engine_config.get(OPTIMIZER_PARAMS, {})})

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
        config.pop(OPTIMIZER_PARAMS, None)  # ps_bench's, in optimizer already (optimizer_for)
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

    def save_checkpoint(self, model: nn.Module, optimizer: Any, folder: str, own: dict) -> None:
        """``--checkpoint-every``: the engine's own checkpoint (DeepSpeed's ``save_checkpoint``:
        the module, and each rank's partition of the optimizer states), and this trainer's own
        entry beside it; every trainer at once."""
        self.engine.save_checkpoint(folder, tag=CHECKPOINT_TAG)
        torch.save(own, Path(folder) / f"{own_entry(dist.get_rank())}.pt")
        dist.barrier()

    def load_checkpoint(self, model: nn.Module, optimizer: Any, folder: str, own: dict) -> dict:
        """The engine's checkpoint read back (``load_checkpoint``); this trainer's own entry."""
        self.engine.load_checkpoint(folder, tag=CHECKPOINT_TAG)
        return torch.load(Path(folder) / f"{own_entry(dist.get_rank())}.pt", weights_only=True)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def accumulating(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """DeepSpeed accumulates by its own ``gradient_accumulation_steps``, reducing as its stage
        does (ZeRO-2 and 3 at every micro-batch): nothing to skip."""
        return contextlib.nullcontext()

    def micro_step(self) -> None:
        """DeepSpeed counts the micro-batches in its ``step``: it steps the optimizer on the
        step's last."""
        self.engine.step()

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
