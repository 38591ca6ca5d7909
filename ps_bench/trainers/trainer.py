"""The trainer: a DDP replica that runs rounds of iterations when the master asks."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ps_bench.failures import fatal_on_error
from ps_bench.faults import Fault, maybe_inject
from ps_bench.metrics.timers import StepTimer
from ps_bench.models import build_model
from ps_bench.registry import Registry
from ps_bench.trainers.hooks import HOOKS, HookContext, ServerHandle, timed

TRAINERS: Registry = Registry("trainer")
TRAINER_METRICS = ("batch", "forward", "backward", "optimizer", "comm")


@TRAINERS.register("ddp", aliases=("DdpTrainer",))
class DdpTrainer:
    """Wraps the model in DDP over the trainer-only process group and registers the hook."""

    @fatal_on_error
    def __init__(
        self,
        trainer_index: int,
        model_class: str,
        model_kwargs: dict,
        seed: int,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        batch_size: int,
        epochs: int,
        lr: float,
        hook: str,
        servers: list[tuple[rpc.RRef, bool]],
        mapping: str,
        group_server: int | None,
        cuda_rpc: bool,
        device: str,
        rpc_timeout: float,
        bucket_cap_mb: float,
        fault: str | None = None,
    ) -> None:
        self.index = trainer_index
        self.fault = Fault.parse(fault) if fault else None
        self.iteration = 0  # training iterations run so far, warmup included
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model = build_model(model_class, model_kwargs, seed).to(self.device)
        self.model = DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=bucket_cap_mb,
        )
        self.hook_context = HookContext(
            process_group=dist.group.WORLD,
            servers=[ServerHandle(rref, is_cuda) for rref, is_cuda in servers],
            mapping=mapping,
            group_server=group_server,
            cuda_rpc=cuda_rpc,
            rpc_timeout=rpc_timeout,
        )
        self.model.register_comm_hook(self.hook_context, timed(HOOKS.get(hook)))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.loss_fn = nn.CrossEntropyLoss()
        self.inputs = inputs.to(self.device)
        self.targets = targets.to(self.device)
        self.batch_size = batch_size
        self.epochs = epochs
        self.iterations_per_epoch = len(targets) // batch_size

    def ready(self) -> int:
        return self.iterations_per_epoch * self.epochs

    @fatal_on_error
    def run_round(self) -> dict:
        """Runs ``epochs`` passes over the shard; returns per-iteration samples in ms."""
        samples: dict[str, list[float]] = defaultdict(list)
        losses = []
        timer = StepTimer(self.device)
        self.hook_context.comm.drain()
        self.hook_context.take_bytes()
        for _ in range(self.epochs):
            for step in range(self.iterations_per_epoch):
                batch = slice(step * self.batch_size, (step + 1) * self.batch_size)
                x, y = self.inputs[batch], self.targets[batch]
                self.iteration += 1
                self.hook_context.iteration = self.iteration
                maybe_inject(self.fault, "trainer", self.index, self.iteration)
                timer.mark("start")
                self.optimizer.zero_grad(set_to_none=True)
                loss = self.loss_fn(self.model(x), y)
                timer.mark("forward")
                loss.backward()
                timer.mark("backward")
                self.optimizer.step()
                timer.mark("optimizer")
                phases = timer.intervals()
                for name, value in phases.items():
                    samples[name].append(value)
                samples["batch"].append(sum(phases.values()))
                samples["comm"].append(self.hook_context.comm.drain())
                losses.append(loss.detach())
        sent, recv = self.hook_context.take_bytes()
        return {
            "samples": {name: samples[name] for name in TRAINER_METRICS},
            "iterations": self.iterations_per_epoch * self.epochs,
            "samples_processed": self.iterations_per_epoch * self.epochs * self.batch_size,
            "bytes_sent": sent,
            "bytes_recv": recv,
            "losses": torch.stack(losses).float().cpu().tolist(),
        }

    def parameters_vector(self) -> torch.Tensor:
        """All parameters, flattened on the CPU, for the replica check."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.model.parameters()])
