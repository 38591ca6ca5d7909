"""``--activation-checkpointing none|full|selective``: a unit's activations freed after its
forward and recomputed inside backward, as the language-model trainers users run do it
(torchtitan's ``activation_checkpoint.mode``, llm-foundry's ``activation_checkpointing``).

The units are those FSDP2 shards one by one (``sharded.shard_units``: a Hugging Face model's
transformer blocks, else every module that holds parameters of its own); ``full`` wraps every
unit, ``selective`` every other one (torchtitan's layer-selective form, ``selective_ac_option =
"2"``; its operator-selective form, which keeps the matrix products' outputs, is not built).
Each is wrapped with torch's own ``checkpoint_wrapper``, non-reentrant, before the strategy wraps
the model (FSDP2, DDP or DeepSpeed's engine then sees the wrapped units), on every strategy
alike; a recomputed unit's forward runs again inside backward and gives the same gradients.

What a recomputed unit keeps for backward is its input alone: ``inputs_kept`` counts it where
the activations are counted (``metrics.memory.SavedActivations``), on a trainer and in predict's
count on the meta device alike (the tensors a unit's forward saves go to the wrapper's own
saved-tensor hooks, which the count does not see)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper)

from ps_bench.metrics.memory import keep_saved
from ps_bench.strategies.sharded import shard_units

MODES = ("none", "full", "selective")
__all__ = ["CheckpointWrapper", "MODES", "apply", "recomputed_units"]


def recomputed_units(network: nn.Module, mode: str) -> list[nn.Module]:
    """The units ``mode`` recomputes: every unit (``full``), every other one from the first
    (``selective``), none (``none``)."""
    units = shard_units(network) if mode != "none" else []
    return units if mode == "full" else units[::2]


def apply(network: nn.Module, mode: str) -> int:
    """Wraps ``network``'s units for ``mode`` in place; returns how many. Each wrapper tells the
    activations' count what it keeps: its inputs (``metrics.memory.keep_saved``)."""
    chosen = {id(unit) for unit in recomputed_units(network, mode)}
    if not chosen:
        return 0
    apply_activation_checkpointing(
        network, check_fn=lambda module: id(module) in chosen,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper,
                                      checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    for module in network.modules():
        if isinstance(module, CheckpointWrapper):
            module.register_forward_pre_hook(inputs_kept, with_kwargs=True)
    return len(chosen)


def inputs_kept(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A recomputed unit keeps its inputs alive for its recomputation, in place of everything
    its forward would save."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            keep_saved(value)
