"""Time to a target loss: the trainers' averaged model, measured between iterations.

What a lossy strategy costs is slower training, and a strategy whose replicas drift apart
(``noop``) can lower every replica's own loss while the model the job would keep does not
learn. So the loss that decides is the averaged model's: after every iteration, outside the
clock, the trainers all-reduce their parameters into a scratch copy and each computes its loss
on the batch it trains on next, before training on it. The mean over trainers is the training
loss of the averaged model as every iteration's loss is usually reported (a batch, the
parameters before the step on it); for replicas that stay identical it equals the mean of their
own losses. The target is met once its mean over the last ``SMOOTHING`` iterations is at or
below it. Trainer 0 also evaluates the averaged model on a held-out set at a few points.

Every trainer reaches each decision from the same all-reduced numbers, so all of them stop
after the same iteration without asking anyone. A check costs one all-reduce of the
parameters, one of the loss and a forward pass, none of it on the clock or the byte counters.

Without a process group (``--staleness``: the servers hold the one model, and trainers run at
their own pace) one trainer checks the parameters it last read, on its own next batch.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ps_bench.config import DEFAULT_MAX_ITERATIONS
from ps_bench.metrics.stats import smoothed_loss
from ps_bench.metrics.wire import ByteCounter
from ps_bench.models.base import Dataset

HELD_OUT_SAMPLES = 256  # at most; the data's own sample count if smaller
# held-out evaluations spread over --max-iterations, besides the first and the last
HELD_OUT_POINTS = 10


class Convergence:
    """One trainer's side of a ``--target-loss`` run: the averaged model's loss after each
    iteration, whether to stop, and the held-out losses (trainer 0)."""

    def __init__(self, network: nn.Module, loss_fn: nn.Module,
                 process_group: dist.ProcessGroup | None, wire: ByteCounter | None, target: float,
                 max_iterations: int | None, held_out: Dataset | None,
                 parameters: Callable[[], torch.Tensor] | None = None) -> None:
        """``network`` as it is before a strategy wraps it (the scratch copy's template);
        ``parameters``: this trainer's whole parameters, flattened (default: ``network``'s)."""
        self.network, self.loss_fn, self.group, self.wire = network, loss_fn, process_group, wire
        self.parameters = parameters or (
            lambda: torch.cat([p.detach().reshape(-1) for p in network.parameters()]))
        self.averaged = copy.deepcopy(network)
        self.averaged.requires_grad_(False)
        self.target = target
        self.max_iterations = max_iterations or DEFAULT_MAX_ITERATIONS
        self.held_out = held_out
        self.held_out_every = max(1, self.max_iterations // HELD_OUT_POINTS)
        self.next_held_out = 0  # the iteration count at which the next held-out point is due
        # (iterations done, the averaged model's training loss[, seconds of training, where the
        # trainer keeps them])
        self.curve: list[tuple] = []
        # (iterations done, its held-out loss): trainer 0
        self.held_out_curve: list[tuple[int, float]] = []
        # iterations done when the smoothed loss first met the target
        self.reached_at: int | None = None
        self.diverged = False
        self.stopped = False
        self.taken = (0, 0)  # points of each curve already handed to the master

    @torch.no_grad()
    def check(self, iterations: int, inputs: list[torch.Tensor], targets: torch.Tensor,
              seconds: float | None = None, held_out_at_stop: bool = True) -> bool:
        """After ``iterations`` training iterations, before training on (``inputs``, ``targets``):
        records the averaged model's loss on them (with ``seconds`` of training, where the
        caller keeps the clock); True when training stops here (the target is met, the loss is
        no longer finite, or --max-iterations is done). Checked once per ``iterations``: asked
        again (the end of one round, then the start of the next), it answers as before. With
        ``held_out_at_stop`` false the caller evaluates the held-out set at the stop itself."""
        if self.curve and self.curve[-1][0] == iterations:
            return self.stopped
        if self.group is None:  # the model already is the one to judge
            self.averaged.load_state_dict(self.network.state_dict())
            value = self.loss_fn(self.averaged(*inputs), targets).item()
        else:
            self.wire.paused = True
            try:
                self.average()
                loss = self.loss_fn(self.averaged(*inputs), targets).detach().reshape(1).double()
                dist.all_reduce(loss, group=self.group)
                value = loss.item() / self.group.size()
            finally:
                self.wire.paused = False
        self.curve.append((iterations, value) if seconds is None else (iterations, value, seconds))
        smoothed = smoothed_loss(self.curve)
        if self.reached_at is None and smoothed is not None and smoothed <= self.target:
            self.reached_at = iterations
        self.diverged = not math.isfinite(value)
        self.stopped = (self.reached_at is not None or self.diverged or
                        iterations >= self.max_iterations)
        if ((self.stopped and held_out_at_stop) or
                (not self.stopped and iterations >= self.next_held_out)):
            self.evaluate_held_out(iterations, seconds)
        return self.stopped

    def evaluate_held_out(self, iterations: int, seconds: float | None = None,
                          network: nn.Module | None = None) -> None:
        """A held-out point: the averaged model's loss on the held-out set (or ``network``'s)."""
        if self.held_out is None:
            return
        if network is not None:
            self.averaged.load_state_dict(network.state_dict())
        loss = self.held_out_loss()
        self.next_held_out = (iterations // self.held_out_every + 1) * self.held_out_every
        self.held_out_curve.append((iterations, loss) if seconds is None
                                   else (iterations, loss, seconds))

    def average(self) -> None:
        """The trainers' mean parameters into the scratch model, with this trainer's buffers
        (DDP broadcasts them from trainer 0 before every forward, so they agree)."""
        flat = self.parameters()
        dist.all_reduce(flat, group=self.group)
        flat /= self.group.size()
        torch.nn.utils.vector_to_parameters(flat, self.averaged.parameters())
        for mine, theirs in zip(self.averaged.buffers(), self.network.buffers()):
            mine.copy_(theirs)

    def held_out_loss(self) -> float:
        """The averaged model's loss on the held-out set, in evaluation mode (BatchNorm's running
        statistics), in slices of at most 64 samples."""
        self.averaged.eval()
        try:
            total, count = 0.0, len(self.held_out)
            for first in range(0, count, 64):
                part = slice(first, first + 64)
                inputs = [t[part] for t in self.held_out.inputs]
                total += self.loss_fn(self.averaged(*inputs),
                                      self.held_out.targets[part]).item() * len(inputs[0])
            return total / count
        finally:
            self.averaged.train()

    def take(self, batch_ms: list[float]) -> dict:
        """What a round adds, for the master: the points of both curves since the last round,
        ``batch_ms`` (the ms of every iteration the round ran: warmup, verified and traced
        ones too, since training time to the target is all of it) and where training stands."""
        curve, held_out = self.curve[self.taken[0]:], self.held_out_curve[self.taken[1]:]
        self.taken = (len(self.curve), len(self.held_out_curve))
        return {"curve": curve, "held_out": held_out, "batch_ms": batch_ms,
                "reached_at": self.reached_at, "diverged": self.diverged, "stopped": self.stopped}
