"""The trainer of ``--staleness S``: no DDP and no optimizer of its own; the servers own the
parameters (see ``ps_bench.servers.ssp``).

Each iteration computes the gradients of its batch on the parameters it last read, pushes each
server's shard of them and waits for the answers: the shards' new parameters, once the
staleness bound allows. A round ends when the servers' budget of updates is spent (a fast
trainer may do more than its share of it) or training stops.

With ``--target-loss``, trainer 0 judges the servers' model: after each of its iterations,
outside the clock, it computes the loss of the parameters it has just read on its next batch
(no collective: the trainers run at their own pace) and, when training should stop, tells
the servers, which tell every trainer. Its iterations are counted as the servers' updates
divided by the number of trainers, its seconds as its own training time.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch
import torch.distributed.rpc as rpc
from torch import nn

from ps_bench.config import RunConfig
from ps_bench.runtime.failures import fatal_on_error
from ps_bench.runtime.faults import Straggling, faults_of, maybe_inject
from ps_bench.metrics.memory import held_bytes, peak_memory
from ps_bench.metrics.timers import folded, tensor_bytes
from ps_bench.models.base import Dataset, build_model
from ps_bench.models.entries import Entry
from ps_bench.servers.ssp import GO, STOPPED, StaleSynchronousServer, shard_owners
from ps_bench.strategies import Strategy, compiled, recompute
from ps_bench.trainers.convergence import Convergence
from ps_bench.trainers.trainer import TRAINERS
from ps_bench.runtime.resident import Resident


@TRAINERS.register("ssp", aliases=("stale_synchronous",))
class StaleSynchronousTrainer(Resident):
    """A replica that computes gradients and reads parameters from the servers that own them."""

    @fatal_on_error
    def __init__(self, trainer_index: int, config: RunConfig, strategy: Strategy, model: Entry,
                 inputs: tuple[torch.Tensor, ...], targets: torch.Tensor,
                 servers: list[tuple[rpc.RRef, bool]], group_server: int | None, cuda_rpc: bool,
                 device: str, held_out: Dataset | None = None, rank_hosts: list[int] | None = None,
                 engine_config: dict | None = None, checkpoints: None = None) -> None:
        """As ``DdpTrainer``'s; ``checkpoints`` is always None (validation refuses
        ``--checkpoint-every`` here: the servers own the parameters)."""
        self.index = trainer_index
        self.fault = faults_of(config.inject_fault)
        self.straggling = Straggling(config.straggler, trainer_index, config.torch_seed)
        self.network = build_model(model.class_name, model.kwargs, config.torch_seed)
        recompute.apply(self.network, config.activation_checkpointing)
        self.compiled = compiled.apply(self.network) if config.compile else 0  # as the trainer
        self.parameters = list(self.network.parameters())
        self.servers = [rref for rref, _ in servers]
        owners = shard_owners(self.network, len(self.servers))
        self.shards = [[i for i in range(len(self.parameters)) if owners[i] == s]
                       for s in range(len(self.servers))]
        self.loss_fn = nn.CrossEntropyLoss()
        self.inputs, self.targets = inputs, targets
        self.batch_size, self.accum = config.batch_size, config.grad_accum
        self.per_epoch = len(targets) // (config.batch_size * config.grad_accum)
        self.autocast = (contextlib.nullcontext if config.precision == "fp32" else
                         lambda: torch.autocast("cpu", dtype=torch.bfloat16))  # on the CPU: bf16
        self.iterations_per_round = self.per_epoch * config.epochs
        self.num_trainers = config.num_trainers
        self.clock = 0  # iterations pushed so far
        self.round_began = 0  # the clock when the running round began
        self.updates = 0  # updates the servers had applied at the last read, every trainer's
        self.fresh = True  # parameters read for the current clock (False at the start of a round)
        self.trained_s = 0.0  # this trainer's training time so far (its iterations' clocks)
        self.converging = config.target_loss is not None
        self.convergence = None
        if self.converging and trainer_index == 0:
            self.convergence = Convergence(self.network, self.loss_fn, None, None,
                                           config.target_loss, config.max_iterations, held_out)

    def ready(self) -> int:
        return self.iterations_per_round

    def round_progress(self) -> tuple[int, int]:
        """The iteration the running round is at and its budget, as ``Trainer.round_progress``."""
        budget = self.iterations_per_round
        return min(self.clock - self.round_began + 1, budget), budget

    @fatal_on_error
    def run_round(self, verify: bool = False, profile_path: str | None = None,
                  start_step: int = 0) -> dict:
        """Iterations until the round's budget is spent or training stops: per-iteration samples
        (ms: forward, backward, the push and its answer as ``comm``, loading the answer as
        ``optimizer``) and bytes. ``start_step`` is always 0 (no checkpoint to resume from)."""
        readings, moved, losses = [], [], []
        clock = time.perf_counter
        status, self.round_began, pulled = GO, self.clock, 0
        if not self.fresh:  # the last round's last push was answered without parameters
            answers = self.ask("pull", self.clock)
            pulled = parameter_bytes(answers)  # counted with the first iteration's, as it feeds it
            status = self.read(answers)
        accum, size = self.accum, self.batch_size
        while status == GO:
            first = (self.clock % self.per_epoch) * size * accum
            x = [t[first:first + size * accum] for t in self.inputs]
            y = self.targets[first:first + size * accum]
            if self.convergence is not None and self.check(x, y):
                status = STOPPED
                break
            maybe_inject(self.fault, "trainer", self.index, self.clock + 1)
            times = [clock()]
            for p in self.parameters:
                p.grad = None
            step_loss = 0.0
            for micro in range(accum):  # --grad-accum: the gradients of every micro-batch, summed
                with self.autocast():
                    part = slice(micro * size, (micro + 1) * size)
                    loss = self.loss_fn(self.network(*(t[part] for t in x)), y[part])
                # --straggler: this trainer is slower in this iteration by that much
                if self.straggling and micro == accum - 1:
                    time.sleep(self.straggling.delay_s(self.clock + 1))
                times.append(clock())
                (loss / accum if accum > 1 else loss).backward()
                times.append(clock())
                step_loss += loss.item() / accum
            gradients = [[self.gradient(i) for i in shard] for shard in self.shards]
            answers = self.ask("push", self.clock, gradients)
            t3 = clock()
            self.clock += 1
            status = self.read(answers)
            t4 = clock()
            readings.append((*times, t3, t4))
            moved.append((sum(tensor_bytes(g) for shard in gradients for g in shard),
                          parameter_bytes(answers) + pulled))
            pulled = 0
            losses.append(step_loss)
            self.trained_s += t4 - times[0]
        return self.round_result(readings, moved, losses, status)

    def gradient(self, index: int) -> torch.Tensor:
        grad = self.parameters[index].grad
        return torch.zeros_like(self.parameters[index]) if grad is None else grad

    def ask(self, method: str, clock: int,
            gradients: list[list[torch.Tensor]] | None = None) -> list[tuple]:
        """Every server at once: its push (with its shard's gradients) or pull; their answers."""
        function = getattr(StaleSynchronousServer, method)
        futures = [rpc.rpc_async(server.owner(), function,
                                 args=((server, self.index, clock) +
                                       ((gradients[s],) if gradients else ())),
                                 timeout=0)
                   for s, server in enumerate(self.servers)]
        return [future.wait() for future in futures]

    def read(self, answers: list[tuple]) -> str:
        """Loads the servers' parameters when every server said go; else what ended the round."""
        statuses = {reply[2] for reply in answers}
        if statuses != {GO}:
            self.fresh = False
            return STOPPED if STOPPED in statuses else statuses.difference({GO}).pop()
        self.load([reply[0] for reply in answers])
        self.fresh = True
        self.updates = answers[0][1]
        return GO

    def check(self, x: list[torch.Tensor], y: torch.Tensor) -> bool:
        """Trainer 0, with --target-loss: the servers' model as it last read it, on its next
        batch. When training stops it tells the servers, and evaluates the held-out set on the
        parameters the servers ended with."""
        iterations = self.updates // self.num_trainers
        if not self.convergence.check(iterations, x, y, seconds=self.trained_s,
                                      held_out_at_stop=False):
            return False
        for server in self.servers:
            server.rpc_sync().stop_training()
        self.load([server.rpc_sync().parameters_now() for server in self.servers])
        self.convergence.evaluate_held_out(iterations, self.trained_s, self.network)
        return True

    def load(self, shards: list[list[torch.Tensor]]) -> None:
        """Each server's shard of the parameters into the model."""
        with torch.no_grad():
            for shard, values in zip(self.shards, shards):
                for index, value in zip(shard, values):
                    self.parameters[index].copy_(value)

    def round_result(self, readings: list[tuple], moved: list[tuple], losses: list[float],
                     status: str) -> dict:
        phases = (folded(np.diff(np.asarray(readings, dtype=np.float64), axis=1) * 1000.0, 2)
                  if readings else np.zeros((0, 4)))
        moved_array = np.asarray(moved, dtype=np.int64).reshape(-1, 2)
        samples = {"batch": phases.sum(axis=1).tolist(), "forward": phases[:, 0].tolist(),
                   "backward": phases[:, 1].tolist(), "comm": phases[:, 2].tolist(),
                   "optimizer": phases[:, 3].tolist(), "bytes_sent": moved_array[:, 0].tolist(),
                   "bytes_recv": moved_array[:, 1].tolist()}
        result = {"samples": samples, "iterations": len(readings),
                  "samples_processed": len(readings) * self.batch_size * self.accum,
                  "bytes_sent": int(moved_array[:, 0].sum()),
                  "bytes_recv": int(moved_array[:, 1].sum()),
                  "losses": losses, "verified_iterations": 0, "grad_errors": [],
                  "memory": {**peak_memory(), "model_states": held_bytes({
                      "parameters": self.parameters, "optimizer": [],  # the servers step
                      "gradients": [p.grad for p in self.parameters if p.grad is not None]})},
                  "timeline": {}, "compile": compiled.BOOKS.round(self.compiled)}
        if self.convergence is not None:
            result["convergence"] = self.convergence.take(samples["batch"])
        elif self.converging:
            result["convergence"] = {"curve": [], "held_out": [], "batch_ms": samples["batch"],
                                     "reached_at": None, "diverged": False,
                                     "stopped": status == STOPPED}
        return result

    def bucket_layout(self) -> list[dict]:
        """What crosses the wire per server, in the shape of DDP's bucket rows: each server's
        shard of the parameters (its gradients one way, its parameters the other)."""
        return [{"index": s, "bytes": sum(tensor_bytes(self.parameters[i]) for i in shard),
                 "sparse": False, "shapes": [list(self.parameters[i].shape) for i in shard]}
                for s, shard in enumerate(self.shards)]

    def parameters_vector(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.parameters])

    def close(self) -> None:
        """Training is over: nothing of its own to stop."""


def parameter_bytes(answers: list[tuple]) -> int:
    """The bytes of the parameters the servers' ``answers`` carry (none where a server answered
    that the round or training is over)."""
    return sum(tensor_bytes(p) for reply in answers if reply[0] is not None for p in reply[0])
