"""The low-communication family: local SGD (torch's ``post_localSGD_hook`` and
``PeriodicModelAverager``: local steps, the parameters averaged every ``period`` iterations)
and DiLoCo (Douillard et al., 2023: ``period`` inner steps of the run's optimizer, then the mean
over trainers of each one's parameter change is the outer gradient, applied from the start
point by an outer SGD with Nesterov momentum; defaults as in the paper and torchft's example).

Between synchronisations the replicas differ by design: "identical" is checked at the last
synchronisation, whose parameters each trainer keeps (copied outside the clock).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (PostLocalSGDState,
                                                                            post_localSGD_hook)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from ps_bench.metrics.memory import state_tensors
from ps_bench.strategies.base import (HookContext, OptimizerSpec, Synchroniser, flat_parameters,
                                      timed_collective)
from ps_bench.strategies.record import (AT_SYNC, AT_SYNCHRONISATION, COLLECTIVE, HOOKS, LOCAL,
                                        Holds, Strategy)


def check_period(period: int) -> None:
    if period < 1:
        raise ValueError(f"hook option 'period' must be at least 1 (iterations between "
                         f"synchronisations); got {period}")


def check_outer(period: int, outer_lr: float, outer_momentum: float) -> None:
    """DiLoCo's options, as every DiLoCo here takes them: the period and the outer SGD's."""
    check_period(period)
    if not outer_lr > 0:
        raise ValueError(f"hook option 'outer_lr' must be positive; got {outer_lr}")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"hook option 'outer_momentum' must be in [0, 1); "
                         f"got {outer_momentum}")


class Periodic(Synchroniser):
    """A strategy that synchronises every ``period`` iterations and keeps the parameters it
    synchronised to, for the replica check."""

    synced: torch.Tensor | None = None

    def note_synchronised(self, model: nn.Module) -> None:
        self.synced = flat_parameters(model.parameters()).cpu()  # a new tensor: cat copies

    def parameters_vector(self, model: nn.Module) -> torch.Tensor:
        return self.synced if self.synced is not None else super().parameters_vector(model)


@HOOKS.register("local_sgd", aliases=("post_localSGD_hook", "localsgd"),
                record=Strategy(COLLECTIVE, "float32", lossless=False, sparse_buckets=None,
                                uncompressed="allreduce", family=LOCAL, recovery=AT_SYNC,
                                identical=AT_SYNCHRONISATION, sends=(("all_reduce", "period"),)))
class LocalSGD(Periodic):
    """Local SGD: after ``warmup_steps`` iterations of all-reduce, each trainer steps on its own
    gradients and the parameters are averaged every ``period`` iterations (torch's
    post_localSGD_hook and PeriodicModelAverager)."""

    def __init__(self, ctx: HookContext, period: int = 4, warmup_steps: int = 0) -> None:
        # no gradient all-reduce after the warmup, so no subgroup (dist.new_subgroups needs CUDA)
        self.state = PostLocalSGDState(process_group=ctx.process_group, subgroup=None,
                                       start_localSGD_iter=warmup_steps,
                                       post_local_gradient_allreduce=False)
        self.averager = PeriodicModelAverager(period=period, warmup_steps=warmup_steps,
                                              process_group=ctx.process_group)

        def hook(ctx, bucket):  # unannotated: DDP rejects string annotations
            return post_localSGD_hook(self.state, bucket)

        self.hook = hook

    @staticmethod
    def check(period: int, warmup_steps: int) -> None:
        check_period(period)
        if warmup_steps < 0:
            raise ValueError(f"hook option 'warmup_steps' must be 0 or more; got {warmup_steps}")

    def after_step(self, ctx: HookContext, model: nn.Module) -> bool:
        """Averages the parameters on this step of the period; True where the replicas are now
        the same model (every warmup step too: its gradients were all-reduced)."""
        averager = self.averager
        step, warmup = averager.step, averager.warmup_steps
        if step >= warmup and (step - warmup) % averager.period == 0:
            timed_collective(ctx, lambda: averager.average_parameters(model.parameters()))
            return True
        averager.step += 1
        return step < warmup


@HOOKS.register("diloco", aliases=("DiLoCo",),
                record=Strategy(COLLECTIVE, "float32", lossless=False, sparse_buckets=None,
                                uncompressed="allreduce", family=LOCAL, holds=Holds(copies=2),
                                identical=AT_SYNCHRONISATION, sends=(("all_reduce", "period"),),
                                recovery=AT_SYNC))
class DiLoCo(Periodic):
    """DiLoCo: ``period`` inner steps of the run's optimizer on local gradients, then the mean
    parameter change (start - local) is the outer gradient of an SGD step from the start point
    (Nesterov momentum ``outer_momentum``, learning rate ``outer_lr``)."""

    def __init__(self, ctx: HookContext, period: int = 16, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9) -> None:
        self.period, self.outer_lr, self.outer_momentum = period, outer_lr, outer_momentum
        self.steps = 0
        self.start: list[torch.Tensor] = []
        self.outer: torch.optim.Optimizer | None = None

        def hook(ctx, bucket):  # the local gradient, untouched
            return debugging_hooks.noop_hook(None, bucket)

        self.hook = hook

    @staticmethod
    def check(period: int, outer_lr: float, outer_momentum: float) -> None:
        check_outer(period, outer_lr, outer_momentum)

    def wrap(self, network: nn.Module, ctx: HookContext, ddp_options: dict[str, Any],
             optimizer: OptimizerSpec) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, inner = super().wrap(network, ctx, ddp_options, optimizer)
        parameters = list(model.parameters())
        self.start = [p.detach().clone() for p in parameters]
        self.outer = torch.optim.SGD(parameters, lr=self.outer_lr, momentum=self.outer_momentum,
                                     nesterov=self.outer_momentum > 0)
        return model, inner

    def held_tensors(self, model: nn.Module,
                     optimizer: torch.optim.Optimizer | None) -> dict[str, list[torch.Tensor]]:
        """Besides the inner optimizer's: the start point and the outer optimizer's momentum."""
        held = super().held_tensors(model, optimizer)
        held["parameters"] += self.start
        held["optimizer"] += state_tensors(self.outer.state) if self.outer else []
        return held

    @torch.no_grad()
    def after_step(self, ctx: HookContext, model: nn.Module) -> bool:
        self.steps += 1
        if self.steps % self.period:
            return False
        parameters = list(model.parameters())
        change = flat_parameters(self.start) - flat_parameters(parameters)
        timed_collective(ctx, lambda: dist.all_reduce(change, group=ctx.process_group))
        change /= ctx.process_group.size()
        offset = 0
        for parameter, start in zip(parameters, self.start):
            parameter.copy_(start)
            parameter.grad = change[offset:offset + parameter.numel()].view_as(parameter)
            offset += parameter.numel()
        self.outer.step()
        for parameter, start in zip(parameters, self.start):
            start.copy_(parameter)
            parameter.grad = None
        return True
