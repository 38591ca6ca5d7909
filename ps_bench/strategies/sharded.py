"""The sharded family: FSDP2 (``fully_shard``: gradients reduce-scattered, parameters
all-gathered, each trainer keeping a shard of parameters, gradients and optimizer state) and
ZeRO stage 1 (DDP's all-reduce, then ``ZeroRedundancyOptimizer``: each trainer steps the shard
of the optimizer state it owns and broadcasts the parameters it updated).

Both are torch's own; their bytes are counted from the collectives they issue
(``ps_bench.metrics.wire``). gloo has no reduce-scatter of its own (it all-reduces the whole
input and keeps a chunk), so on gloo FSDP2 moves what an all-reduce moves, and more than NCCL
would.
"""

from __future__ import annotations

from typing import Any

import contextlib
import copy
import os
import warnings
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from ps_bench.metrics import costs
from ps_bench.strategies.allreduce import allreduce
from ps_bench.strategies.checkpoints import own_entry
from ps_bench.strategies.base import (Capture, HookContext, OptimizerSpec, Synchroniser,
                                      flat_parameters)
from ps_bench.strategies.record import (COLLECTIVE, COLLECTIVE_BUCKETS, FSDP, GATHERED, HOOKS,
                                        MODEL_STATES, OPTIMIZER, SHARDED, Cost, Holds, Strategy)

MESH_NAMES = ("replicate", "shard")  # a 2-D mesh replicates across its rows and shards within each
# torch.distributed.fsdp and torch.distributed.optim import DTensor's operators, over a second of
# CPU: only the trainers of a run that shards pay for them, where they wrap the model.


def shard_units(network: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 wraps one by one before the root: those the model names
    (``shard_units()``: a Hugging Face model's transformer blocks, as torchtitan and accelerate
    wrap them), else every module with parameters of its own inside no other such module (one
    unit gathers what its forward reads: ``nn.MultiheadAttention`` reads its ``out_proj``'s
    weight without calling it) and sharing none with another module (a tied embedding and
    output projection: a parameter is sharded by one unit only, so the root holds it)."""
    if hasattr(network, "shard_units"):
        return network.shard_units()
    owning = {name: module for name, module in network.named_modules()
              if name and any(True for _ in module.parameters(recurse=False))}
    holders = Counter(id(parameter) for module in network.modules()
                      for parameter in module.parameters(recurse=False))

    def inside_another(name: str) -> bool:
        parts = name.split(".")
        return any(".".join(parts[:end]) in owning for end in range(1, len(parts)))

    return [module for name, module in owning.items() if not inside_another(name)
            and all(holders[id(parameter)] == 1 for parameter in module.parameters(recurse=False))]


def unit_elements(model: Any, config: dict | None = None) -> int:
    """The elements FSDP2 reduce-scatters at once: a unit's, taken as its largest besides the root
    (a transformer's block; the root's, where it wraps no other) for the model
    (``predict.memory.ModelFacts``)."""
    return model.largest_unit or model.root_unit


@HOOKS.register("fsdp", aliases=("fully_shard", "fsdp2"),
                record=Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=None,
                                family=SHARDED, wrap=FSDP, identical=GATHERED, reduce_dtype=True,
                                holds=Holds(MODEL_STATES, gathers="unit"),
                                # --grad-accum: the parameters gathered for every micro-batch's
                                # forward and backward, the gradients reduced on the step's last
                                sends=(("all_gather", "micro-batch"), ("all_gather", "micro-batch"),
                                       ("reduce_scatter", "iteration")),
                                # each unit's gradients reduce-scattered as backward finishes it,
                                # the rest of backward going on: predicted unit by unit
                                cost=Cost(COLLECTIVE_BUCKETS, bucket_ms=costs.sharded_reduce_ms,
                                          bucket_elements=unit_elements,
                                          overlapped=("reduce_scatter",))))
class FullyShard(Synchroniser):
    """FSDP2 over the trainers: the model's units (``shard_units``), each with its parameters
    all-gathered before its forward and again before its backward, having been freed in between,
    and its gradients reduce-scattered after, then the root; lossless. No DDP buckets and no hook:
    its communication runs inside forward and backward."""

    def __init__(self, ctx: HookContext) -> None:
        self.gathered: torch.Tensor | None = None
        self.ctx, self.model = ctx, None
        # --verify: the model whole, for each trainer's own gradient
        self.local: nn.Module | None = None
        self.loss_fn = nn.CrossEntropyLoss()

    def wrap(self, network: nn.Module, ctx: HookContext, ddp_options: dict[str, Any],
             optimizer: OptimizerSpec) -> tuple[nn.Module, torch.optim.Optimizer]:
        if ctx.verifying:
            self.local = copy.deepcopy(network)
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch releases before FSDP2 was public
            from torch.distributed._composable.fsdp import fully_shard
        device = next(network.parameters()).device
        shape = self.mesh_shape(ctx)
        mesh = self.mesh = init_device_mesh(device.type, shape,
                                            mesh_dim_names=MESH_NAMES[-len(shape):])
        options = {"mesh": mesh}
        # torch's own modules return views (nn.Linear on 3-D input, nn.MultiheadAttention):
        # harmless here, where every output is used out of place, as --verify checks
        warnings.filterwarnings("ignore", category=UserWarning,
                                message="FSDP2-wrapped module .* returned a view tensor")
        if ctx.reduce_dtype is not None:  # --reduce-dtype: gathered and reduced in it
            options["mp_policy"] = mixed_precision_policy(ctx.reduce_dtype)
        # innermost first: a unit wrapped before one inside it would take that one's parameters
        for module in reversed(shard_units(network)):
            fully_shard(module, **options)
        fully_shard(network, **options)
        self.model = network
        return network, optimizer.build(network.parameters())

    def accumulating(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """--grad-accum: FSDP2 reduce-scatters the gradients on the step's last micro-batch only
        (``set_requires_gradient_sync``); it gathers the parameters for every one."""
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``--verify``, on a captured iteration: after FSDP2's backward, the gradients it delivered
        (gathered whole) and this trainer's own, from the whole model at the same parameters on
        the same batch; the trainer holds the first to the mean of the second (not counted)."""
        loss.backward()
        ctx = self.ctx
        if not (ctx.capturing and ctx.batch is not None and self.local is not None):
            return
        corrupt(ctx, self.model)
        ctx.wire.paused = True
        try:
            parameters = list(self.model.parameters())
            delivered = flat_parameters(whole(p.grad) for p in parameters)
            with torch.no_grad():
                for mine, parameter in zip(self.local.parameters(), parameters):
                    mine.copy_(whole(parameter))
            self.local.zero_grad(set_to_none=True)
            inputs, targets = ctx.batch
            self.loss_fn(self.local(*inputs), targets).backward()
            own = flat_parameters(p.grad for p in self.local.parameters())
            ctx.captures.append(Capture(ctx.iteration, 0, own, delivered))
        finally:
            ctx.wire.paused = False

    @staticmethod
    def mesh_shape(ctx: HookContext) -> tuple[int, ...]:
        """One dimension: every trainer holds a shard."""
        return (ctx.process_group.size(),)

    def end_round(self, ctx: HookContext, model: nn.Module) -> None:
        """The full parameters, gathered from every trainer's shards (not counted as wire bytes)."""
        ctx.wire.paused = True
        try:
            self.gathered = self.full_parameters(model).cpu()
        finally:
            ctx.wire.paused = False

    def parameters_vector(self, model: nn.Module) -> torch.Tensor:
        return self.gathered if self.gathered is not None else torch.empty(0)

    def full_parameters(self, model: nn.Module) -> torch.Tensor:
        """Every parameter whole, flattened: an all-gather of each sharded one."""
        return flat_parameters(whole(p) for p in model.parameters())


def mixed_precision_policy(dtype: torch.dtype):
    """FSDP2's policy that gathers the parameters and reduces the gradients in ``dtype``."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    except ImportError:  # torch releases before FSDP2 was public
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (a DTensor) gathered whole; any other as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def corrupt(ctx: HookContext, model: nn.Module) -> None:
    """For the tests only: ``PS_BENCH_CORRUPT_GRADIENT=TRAINER:ITERATION`` doubles that trainer's
    share of the delivered gradients at that iteration, a wrong gradient ``--verify`` must catch."""
    trainer, _, iteration = os.environ.get("PS_BENCH_CORRUPT_GRADIENT", "").partition(":")
    if (trainer and int(trainer) == dist.get_rank(ctx.process_group) and
            int(iteration) == ctx.iteration):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.grad.mul_(2)


# its collectives run over a host's trainers and over each shard's hosts, which ``sends``
# (collectives over all trainers) does not describe: its test counts them by hand
@HOOKS.register("hsdp", aliases=("HSDP",),
                record=Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=None,
                                family=SHARDED, wrap=FSDP, identical=GATHERED, per_host=True,
                                reduce_dtype=True,
                                holds=Holds(MODEL_STATES, over="host", gathers="unit"),
                                cost=Cost(COLLECTIVE_BUCKETS, bucket_ms=costs.hsdp_reduce_ms,
                                          bucket_elements=unit_elements,
                                          micro_batch_ms=costs.hsdp_gather_ms)))
class HybridShard(FullyShard):
    """FSDP2 on a 2-D mesh (HSDP): parameters sharded among the trainers of a host (--per-host)
    and replicated across hosts; gradients reduce-scattered within the host, then each shard
    all-reduced across hosts; lossless."""

    @staticmethod
    def mesh_shape(ctx: HookContext) -> tuple[int, ...]:
        """Hosts x trainers per host: host k is trainers [kG, (k+1)G), a row of the mesh."""
        return (ctx.process_group.size() // ctx.per_host, ctx.per_host)

    def floor_steps(self, ctx: HookContext, sends: tuple[tuple[str, str], ...], elements: int,
                    buckets: list[int]) -> list[tuple[str, dist.ProcessGroup, int]]:
        """``--limits``: the parameters gathered twice and the gradients reduce-scattered among a
        host's trainers, each host's shard all-reduced across the hosts."""
        within, across = self.mesh.get_group("shard"), self.mesh.get_group("replicate")
        return [("all_gather", within, elements), ("all_gather", within, elements),
                ("reduce_scatter", within, elements),
                ("all_reduce", across, -(-elements // ctx.per_host))]


ZERO_OPTIMIZER = "zero1-optimizer.pt"  # zero1's consolidated optimizer, in a checkpoint

@HOOKS.register("zero1", aliases=("zero", "ZeroRedundancyOptimizer"),
                record=Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=None,
                                family=SHARDED, sends=(("broadcast", "iteration"),),
                                hook_sends=True, holds=Holds((OPTIMIZER,))))
class ZeroOne(Synchroniser):
    """DDP's all-reduce, then torch's ZeroRedundancyOptimizer: each trainer keeps and steps the
    optimizer state of its shard of the parameters and broadcasts them; lossless."""

    def __init__(self, ctx: HookContext) -> None:
        self.hook = allreduce

    def wrap(self, network: nn.Module, ctx: HookContext, ddp_options: dict[str, Any],
             optimizer: OptimizerSpec) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        model, _ = super().wrap(network, ctx, ddp_options, None)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer.kind,
                                              process_group=ctx.process_group, **optimizer.options)

    def save_checkpoint(self, model: nn.Module, optimizer: Any, folder: str, own: dict) -> None:
        """``--checkpoint-every``: the model with DCP, and the optimizer as
        ZeroRedundancyOptimizer saves it: its shards consolidated on trainer 0, written there;
        every trainer at once."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        rank = dist.get_rank()
        dcp.save({"model": get_model_state_dict(model), own_entry(rank): own}, checkpoint_id=folder)
        optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save(optimizer.state_dict(), os.path.join(folder, ZERO_OPTIMIZER))
        dist.barrier()

    def load_checkpoint(self, model: nn.Module, optimizer: Any, folder: str, own: dict) -> dict:
        """The model read with DCP; the optimizer's consolidated state, each trainer taking its
        shard of it (``load_state_dict``)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             set_model_state_dict)

        rank = dist.get_rank()
        state = {"model": get_model_state_dict(model), own_entry(rank): own}
        dcp.load(state, checkpoint_id=folder)
        set_model_state_dict(model, state["model"])
        optimizer.load_state_dict(torch.load(os.path.join(folder, ZERO_OPTIMIZER),
                                             weights_only=False))
        return state[own_entry(rank)]
