"""A trainer's state written to a checkpoint and read back, as each strategy's engine does it:
``torch.distributed.checkpoint`` (DCP) for the model and the optimizer (``get_state_dict``
gives DDP's replica and FSDP2's shards alike, each rank writing its own part), beside each
trainer's own entry (``own``: its RNG state and iteration); a ``Synchroniser`` with a way of its
own (``save_checkpoint``/``load_checkpoint``: ZeroRedundancyOptimizer's consolidated optimizer,
DeepSpeed's engine) takes its place. Every trainer calls both at once: they are collective.

What a DDP communication hook keeps between iterations (error feedback's residuals, PowerSGD's
error and factor memory) is no part of a checkpoint, as it is no part of DDP's ``state_dict``:
after a restart it starts empty, as it does for the systems that use them."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn


def own_entry(rank: int) -> str:
    return f"trainer{rank}"


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's random number generators: the CPU's, and the GPU's it trains on."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(synchroniser: Any, model: nn.Module, optimizer: Any, folder: str, rank: int,
         own: dict, background: bool, group: Any = None) -> tuple[float, Future | None]:
    """Writes this trainer's part of the checkpoint into ``folder``: the seconds it held training
    (all of the save, or with ``background`` the copy of the state before DCP writes it on a
    thread of its own, coordinating over ``group``), and the write still going on (None: done)."""
    started = time.perf_counter()
    custom = getattr(synchroniser, "save_checkpoint", None)
    if custom is not None:
        custom(model, optimizer, folder, own)
        return time.perf_counter() - started, None
    # imported where a checkpoint is written or read: DCP brings DTensor and sympy (0.7 s on
    # every command's path otherwise)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, own_entry(rank): own}
    if background:
        writing = dcp.async_save(state, checkpoint_id=folder, process_group=group)
        return time.perf_counter() - started, writing
    dcp.save(state, checkpoint_id=folder)
    return time.perf_counter() - started, None


def load(synchroniser: Any, model: nn.Module, optimizer: Any, folder: str, rank: int,
         own: dict) -> dict:
    """Reads the checkpoint in ``folder`` into the model and the optimizer; returns this
    trainer's own entry (``own``: a template of it, the tensors it holds of the same shapes)."""
    custom = getattr(synchroniser, "load_checkpoint", None)
    if custom is not None:
        return custom(model, optimizer, folder, own)
    import torch.distributed.checkpoint as dcp  # as in save
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, own_entry(rank): own}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    return state[own_entry(rank)]
