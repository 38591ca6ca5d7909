"""The trainer: a DDP replica that runs rounds of iterations when the master asks."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn

from ps_bench.config import RunConfig
from ps_bench.runtime import failures
from ps_bench.runtime.checkpoints import Plan
from ps_bench.runtime.failures import fatal_on_error
from ps_bench.runtime.faults import Straggling, faults_of, maybe_inject, take_cuts
from ps_bench.runtime.membership import ELASTIC_DDP, MEMBERSHIP
from ps_bench.runtime.futures import on_default_stream
from ps_bench.metrics import wire
from ps_bench.metrics.memory import NO_COUNT, SavedActivations, held_bytes, trainer_memory
from ps_bench.metrics.messages import DTYPES, PRECISIONS
from ps_bench.metrics.timers import StepTimer
from ps_bench.models.base import Dataset, build_model
from ps_bench.models.entries import Entry
from ps_bench.registry import Registry
from ps_bench.strategies import Strategy, compiled, recompute
from ps_bench.strategies.base import (HookContext, ServerHandle, build_synchroniser, fingerprint,
                                      optimizer_spec)
from ps_bench.trainers.convergence import Convergence
from ps_bench.trainers.probes import FloorProbes, finish_profile, start_profiler
from ps_bench.trainers.saves import Saves
from ps_bench.trainers.rounds import collective_ms, mixed_precision, recorded, verified_steps
from ps_bench.runtime.resident import Resident

TRAINERS: Registry = Registry("trainer")
PROFILED_ITERATIONS = 3  # --profile traces this many iterations, from the second of the round on


@TRAINERS.register("ddp", aliases=("DdpTrainer",))
class DdpTrainer(FloorProbes, Resident):
    """Data parallel over the trainers' process group, the model wrapped and stepped as the
    strategy's ``Synchroniser`` says: a DDP replica whose hook combines the gradients (every
    iteration waits for every bucket before its optimizer step), FSDP2's shards, or local steps
    with the parameters synchronised after some of them (``after_step``)."""

    @fatal_on_error
    @on_default_stream
    def __init__(
        self,
        trainer_index: int,
        config: RunConfig,
        strategy: Strategy,
        model: Entry,
        inputs: tuple[torch.Tensor, ...],
        targets: torch.Tensor,
        servers: list[tuple[rpc.RRef, bool]],
        group_server: int | None,
        cuda_rpc: bool,
        device: str,
        held_out: Dataset | None = None,
        rank_hosts: list[int] | None = None,
        engine_config: dict | None = None,
        checkpoints: Plan | None = None,
        beside: dict | None = None,
        rejoined: bool = False,
    ) -> None:
        """Trainer ``trainer_index`` of a run configured by ``config``, training with ``strategy``
        (the job's resolved record) the model of entry ``model``: its data shard (``inputs``,
        ``targets``), the servers as (reference, takes CUDA tensors), with the ``group`` mapping
        the index of its group's server, with ``--target-loss`` the held-out samples it
        evaluates the averaged model on (trainer 0); ``rank_hosts``, every rank's host index
        (the bytes that cross between hosts counted apart); ``engine_config``, the job's resolved
        config of an engine of its own (DeepSpeed's); ``checkpoints``, where it saves its state
        and what it resumes from (restored here, every trainer at once); ``beside`` and
        ``rejoined``, as ``HookContext``'s."""
        self.index = trainer_index
        self.fault = faults_of(config.inject_fault)
        # --straggler
        self.straggling = Straggling(config.straggler, trainer_index, config.torch_seed)
        self.iteration = 0  # training iterations run so far, warmup included
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        network = build_model(model.class_name, model.kwargs, config.torch_seed).to(self.device)
        recompute.apply(network, config.activation_checkpointing)  # before the strategy wraps it
        self.compiled = compiled.apply(network) if config.compile else 0  # after, as torchtitan
        self.hook_context = HookContext(
            process_group=dist.group.WORLD,
            servers=[ServerHandle(rref, is_cuda) for rref, is_cuda in servers],
            mapping=config.mapping,
            group_server=group_server,
            cuda_rpc=cuda_rpc,
            rpc_timeout=config.rpc_timeout,
            per_host=config.per_host,
            ready_events=[] if self.device.type == "cuda" else None,
            engine_config=engine_config,
            engine_bytes=config.verify,
            reduce_dtype=(DTYPES[PRECISIONS[config.reduce_dtype]] if config.reduce_dtype else None),
            verifying=config.verify,
            trainer=trainer_index,
            replicas=config.server_replicas, beside=beside, rejoined=rejoined)
        # trainers rank first
        self.hook_context.wire.hosts, self.hook_context.wire.rank = rank_hosts, trainer_index
        wire.install(self.hook_context.wire)
        self.synchroniser = build_synchroniser(config.hook, self.hook_context, config.hook_options)
        self.strategy = strategy
        self.loss_fn = nn.CrossEntropyLoss()
        # before the strategy wraps the model (FSDP2 shards it): the averaged model's template
        self.convergence = None if config.target_loss is None else Convergence(
            network, self.loss_fn, dist.group.WORLD, self.hook_context.wire, config.target_loss,
            config.max_iterations,
            None if held_out is None else Dataset(tuple(t.to(self.device) for t in held_out.inputs),
                                                  held_out.targets.to(self.device)),
            parameters=lambda: self.synchroniser.full_parameters(self.model))
        ddp_options = {"device_ids": [self.device.index] if self.device.type == "cuda" else None,
                       "bucket_cap_mb": config.bucket_cap_mb,
                       "gradient_as_bucket_view": config.gradient_as_bucket_view}
        if config.trainer_timeout is not None:  # a broadcast from trainer 0 would wait on the dead
            ddp_options.update(ELASTIC_DDP)
        # the whole model's, before wrap shards it (DeepSpeed's stage 3 leaves each parameter a
        # placeholder)
        self.elements = sum(p.numel() for p in network.parameters())
        # the run's optimizer as the strategy steps it; --limits steps the compute-only copy with
        # one of its own
        self.optimizer_spec = self.synchroniser.optimizer_for(self.hook_context, optimizer_spec(
            config.optimizer, config.lr, config.momentum, config.weight_decay))
        self.model, self.optimizer = self.synchroniser.wrap(
            network, self.hook_context, ddp_options, self.optimizer_spec)
        cast = self.synchroniser.input_dtype  # an engine's model in bf16: float inputs in bf16 too
        self.inputs = tuple(t.to(self.device, dtype=cast if cast and t.is_floating_point()
                                 else t.dtype) for t in inputs)
        self.targets = targets.to(self.device)
        self.batch_size, self.accum = config.batch_size, config.grad_accum
        self.epochs = config.epochs
        self.debug = config.debug  # --profile's logs and warnings kept
        self.iterations_per_epoch = len(targets) // (config.batch_size * config.grad_accum)
        self.micro_step = self.synchroniser.micro_step
        self.autocast, self.scaler = mixed_precision(self.device, config.precision,
                                                     self.synchroniser)
        self.held: dict[str, int] | None = None  # model states, counted once (note_memory)
        self.activations = self.buffers = 0  # bytes, with ``held`` (note_memory)
        self._compute_copy: nn.Module | None = None  # --limits: the model outside DDP, made once
        # --limits builds the compute-only copy from them
        self.entry, self.seed = model, config.torch_seed
        self.saves = Saves(checkpoints, config, self.index, self.device, self.hook_context.wire)
        self.completed = 0  # iterations whose optimizer step is done
        failures.set_progress(lambda: self.completed)
        if checkpoints is not None and checkpoints.resume is not None:
            self.iteration = self.completed = self.saves.restore(self.synchroniser, self.model,
                                                                 self.optimizer)

    def ready(self) -> int:
        return self.iterations_per_epoch * self.epochs

    def round_progress(self) -> tuple[int, int]:
        """The running round's iteration (0 before its first) and its iterations (the master's
        progress line)."""
        return self.hook_context.iteration - self.iteration, self.ready()

    @fatal_on_error
    @on_default_stream
    def run_round(self, verify: bool = False, profile_path: str | None = None,
                  start_step: int = 0) -> dict:
        """Runs ``epochs`` passes over the shard; returns per-iteration samples (ms, bytes).
        ``start_step``: the round's iteration it begins at, where a run resumed from a
        checkpoint taken amid a round (the batches before it were trained on then).

        With ``verify``, a few iterations keep each bucket's local gradient and what the
        strategy returned; they are left out of the timing samples, and compared with the exact
        mean after the round, outside the timed region. With ``profile_path``, a few iterations
        are traced by torch.profiler into that Chrome trace file, also left out of the samples.
        Both are left out of the throughput too: ``untimed_s`` is their wall time (the
        profiler's start and its trace's writing, the gradient check's all-reduces included),
        ``untimed_samples`` their samples.
        With ``--target-loss`` the round ends early once training stops (see ``Convergence``).
        """
        ctx, wire = self.hook_context, self.hook_context.wire
        timer = StepTimer(self.device)
        ctx.comm.drain()
        ctx.held.drain()
        if timer.cuda:  # the round's peak (the last round's is reported)
            torch.cuda.reset_peak_memory_stats(self.device)
        iterations = self.iterations_per_epoch * self.epochs
        checked = verified_steps(iterations) if verify else set()
        traced = (set(range(1, 1 + PROFILED_ITERATIONS)) & set(range(iterations)) if profile_path
                  else set())
        last = iterations - 1
        # iterations that capture, trace or note the bucket sizes (a --target-loss round may end
        # early)
        special = checked | traced | {last} | ({min(1, last)} if self.convergence else set())
        untimed = checked | traced
        profiler, untimed_s, began = None, 0.0, 0.0
        wall = time.perf_counter
        # What every iteration pays on top of training: two clock reads and two more a
        # micro-batch, two byte-counter reads and two appends. Everything else waits for the end
        # of the round (benchmarks/timer_overhead.py measures it).
        # per iteration: four clock readings, bytes sent and received so far
        records: list[tuple] = []
        losses: list[torch.Tensor] = []
        record, append_loss = records.append, losses.append
        sent_before, recv_before = wire.sent, wire.recv
        wire.take_crossing()
        if ctx.ready_events is not None:
            ctx.ready_events.clear()
        clock, stop = timer.clock, timer.stop
        model, loss_fn, optimizer, inputs, targets = (
            self.model, self.loss_fn, self.optimizer, self.inputs, self.targets)
        per_epoch, batch_size, fault, iteration = (
            self.iterations_per_epoch, self.batch_size, self.fault, self.iteration)
        # --grad-accum: an iteration is an optimizer step of ``accum`` micro-batches, the
        # gradients synchronised on the last (each micro-batch's loss a share of the step's)
        accum, step_size, micro_step = self.accum, self.batch_size * self.accum, self.micro_step
        accumulating, autocast, scaler = self.synchroniser.accumulating, self.autocast, self.scaler
        share = self.accum if self.synchroniser.scales_micro_losses else 1
        convergence, straggling, sleep = self.convergence, self.straggling, time.sleep
        after_step, note_synchronised = (
            self.synchroniser.after_step, self.synchroniser.note_synchronised)
        backward = self.synchroniser.backward
        if convergence is not None and convergence.stopped:
            return self.empty_round()
        saves, every = self.saves, self.saves.every
        for step in range(start_step, iterations):
            first = (step % per_epoch) * step_size
            x, y = [t[first:first + step_size] for t in inputs], targets[first:first + step_size]
            if convergence is not None and convergence.check(iteration, x, y):  # outside the clock
                break
            iteration += 1
            ctx.iteration = wire.iteration = iteration
            marked = step in special
            counting = marked and step == last and self.held is None
            saved = SavedActivations() if counting else NO_COUNT
            if marked:
                if step in untimed:
                    began = wall()
                ctx.capturing, ctx.noting = step in checked, step == last
                ctx.batch = (x, y) if ctx.capturing else None
                if step in traced and profiler is None:
                    profiler = start_profiler(self.device, self.debug)
            if fault:
                maybe_inject(fault, "trainer", self.index, iteration)
            capturing, micro_losses = ctx.capturing, []
            readings = [clock()]
            optimizer.zero_grad(set_to_none=True)
            for micro in range(accum):  # one pass without --grad-accum
                last_micro = micro == accum - 1
                ctx.capturing = capturing and last_micro  # what is synchronised: the whole step's
                start = micro * batch_size
                with accumulating(model, last_micro):
                    with autocast(), (saved if last_micro else NO_COUNT):  # backward: cast alike
                        loss = (loss_fn(model(*x), y) if accum == 1 else
                                loss_fn(model(*(t[start:start + batch_size] for t in x)),
                                        y[start:start + batch_size]))
                    if straggling and last_micro:  # --straggler: slower by that much, in the clock
                        sleep(straggling.delay_s(iteration))
                    readings.append(clock())
                    scaled = loss / share if share > 1 else loss
                    backward(scaler.scale(scaled) if scaler else scaled)
                    readings.append(clock())
                if not last_micro:
                    micro_step()
                micro_losses.append(loss.detach())
            if counting:  # once, outside the timed rounds where there are untimed ones
                self.note_memory(saved.nbytes)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            synchronised = after_step is not None and after_step(ctx, model)
            readings.append(stop())
            if synchronised:
                note_synchronised(model)
            record((readings, wire.sent, wire.recv))
            append_loss(micro_losses[0] if accum == 1 else torch.stack(micro_losses).mean())
            self.completed = iteration
            if every and iteration % every == 0:  # between iterations, outside their clocks
                untimed_s += saves.save(self.synchroniser, model, optimizer, iteration)
            if marked:
                ctx.capturing = ctx.noting = False
                ctx.batch = None
                if profiler is not None and step == max(traced):
                    profiler = finish_profile(profiler, profile_path)
                if step in untimed:
                    untimed_s += wall() - began
        else:
            # where the round left the model, on the next round's first batch
            if convergence is not None:
                convergence.check(iteration, [t[:batch_size] for t in inputs], targets[:batch_size])
        if profiler is not None:  # a --target-loss round that stopped amid the traced iterations
            began = wall()
            finish_profile(profiler, profile_path)
            untimed_s += wall() - began
        self.iteration = iteration
        self.synchroniser.end_round(ctx, model)
        if not records:
            return self.empty_round()
        iterations = len(records)  # fewer where a --target-loss round stopped early
        first_iteration = iteration - iterations + 1
        ran = set(range(start_step, start_step + iterations))
        untimed = {step - start_step for step in untimed & ran}  # their places among the records
        timings = [timing for timing in wire.take_timings()
                   if timing[0] - first_iteration not in untimed]
        phases, samples, timeline, backward_began = recorded(
            timer, records, (sent_before, recv_before), ctx.comm.drain(), timings,
            first_iteration, untimed, ctx.ready_events, ctx.held.drain())
        began = wall()
        grad_errors = self.gradient_errors()
        if checked:
            untimed_s += wall() - began
        return {
            "samples": samples,
            "iterations": iterations,
            "samples_processed": iterations * self.batch_size * self.accum,
            "bytes_sent": sum(samples["bytes_sent"]),
            "bytes_recv": sum(samples["bytes_recv"]),
            "losses": torch.stack(losses).float().cpu().tolist(),
            "verified_iterations": len(checked & ran),
            "grad_errors": grad_errors,
            "untimed_s": untimed_s,
            "untimed_samples": len(untimed) * self.batch_size * self.accum,
            **({"engine_counts": self.synchroniser.engine_counts(ctx.process_group.size())}
               if hasattr(self.synchroniser, "engine_counts") else {}),
            "memory": trainer_memory(self.device, self.held, self.activations, self.buffers),
            "checkpoints": saves.take(),
            "link_cuts": take_cuts(trainer=self.index),
            "compile": compiled.BOOKS.round(self.compiled),
            "timeline": timeline, "backward_began": backward_began,
            "collectives": collective_ms(timings),
            "host_traffic": [[source, destination, nbytes] for (source, destination), nbytes
                             in sorted(wire.take_crossing().items())],
            **({"convergence": convergence.take(phases.sum(axis=1).tolist())}
               if convergence is not None else {}),
        }

    def empty_round(self) -> dict:  # training had stopped (--target-loss)
        return {"samples": {}, "iterations": 0, "samples_processed": 0, "bytes_sent": 0,
                "bytes_recv": 0, "losses": [], "verified_iterations": 0, "grad_errors": [],
                "memory": trainer_memory(self.device, self.held, self.activations, self.buffers),
                "timeline": {}, "convergence": self.convergence.take([])}

    def note_memory(self, activations: int) -> None:  # states held, activations, kept buffers
        self.held = held_bytes(self.synchroniser.held_tensors(self.model, self.optimizer))
        self.activations, self.buffers = activations, self.synchroniser.kept_bytes()

    @on_default_stream
    def gradient_errors(self) -> list[float]:
        """Relative error ``|delivered - exact| / |exact|`` per captured bucket, where ``exact``
        is the float64 mean of every trainer's local gradient (an all-reduce among trainers,
        not counted as wire bytes)."""
        ctx = self.hook_context
        captures, ctx.captures = ctx.captures, []
        errors = []
        # the living trainers' own group, where one was dropped (--trainer-timeout)
        group = MEMBERSHIP.group(ctx.process_group.size()) or ctx.process_group
        ctx.wire.paused = True
        try:
            for capture in captures:  # every capture all-reduced: the same on every trainer
                raw = capture.raw.to_dense() if capture.raw.is_sparse else capture.raw
                exact = raw.double()
                dist.all_reduce(exact, group=group)
                exact /= group.size()
                if capture.dropped != frozenset(MEMBERSHIP.dropped):
                    continue  # averaged with a trainer gone since: no exact mean to check it by
                delivered = capture.delivered
                delivered = (delivered.to_dense() if delivered.is_sparse
                             else delivered).double().to(exact.device)
                scale = exact.norm().item()
                difference = (delivered - exact).norm().item()
                errors.append(difference / scale if scale > 0 else difference)
        finally:
            ctx.wire.paused = False
        return errors

    def bucket_layout(self) -> list[dict]:
        """DDP's buckets in index order, as the last whole iteration handed them to the hook:
        payload bytes (a sparse bucket's indices and values, which vary with the batch), whether
        it is sparse, and the shapes of its gradients (dense buckets)."""
        return [{"index": i, "bytes": nbytes, "sparse": sparse, "shapes": shapes}
                for i, (nbytes, sparse, shapes) in sorted(self.hook_context.buckets.items())]

    @on_default_stream
    def parameters_vector(self) -> torch.Tensor:
        """All parameters, flattened on the CPU, for the replica check (as the strategy's record
        says: at the end of the run, at the last synchronisation, or gathered from the shards)."""
        return self.synchroniser.parameters_vector(self.model)

    def parameters_fingerprint(self) -> dict:
        """``parameters_vector``'s digest and norm (``strategies.base.fingerprint``)."""
        return fingerprint(self.parameters_vector())

    def commit_log(self) -> list[dict]:
        return self.synchroniser.commit_log()

    @fatal_on_error
    @on_default_stream
    def close(self) -> None:
        """Training is over (every trainer is asked at once): the strategy stops what it started,
        and the last checkpoint written in the background is committed."""
        self.saves.finish(self.completed)
        self.synchroniser.close()
