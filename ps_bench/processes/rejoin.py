"""A rank's process from its first line, and a trainer started again after it failed.

``enter`` is what every rank the launcher starts does first: it dies with the launcher, takes its
name, enters its emulated host, and writes where the launcher says. ``start_again`` is the
launcher's answer to a failed trainer of a strategy whose groups heal from a live peer
(``processes.healing``): a new interpreter, as the group's own torchrun would start it, outside
RPC and the trainers' process group, which builds the trainer as the master built it (its shard, the
run's seeds, the strategy's ``beside`` from the store), without the faults it already met, and
trains round after round until the launcher stops it at the end of the job (under ``--mtbf`` it
meets the next failure drawn for it, as every rank does). Its strategy joins the quorum at its
first synchronisation and heals there; that commit goes to the store, and with each later one the
iterations it has committed since."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ps_bench.models.base import build_data
from ps_bench.processes import orphans, rendezvous
from ps_bench.processes.attempts import Attempts
from ps_bench.processes.healing import BESIDE_KEY, healed_key
from ps_bench.processes.master import device_name
from ps_bench.runtime import failures, network, streams
from ps_bench.runtime.faults import TimedFault, arm, drawn_of, role_counts
from ps_bench.trainers.trainer import TRAINERS

LaunchSpec = Any  # processes.launch.LaunchSpec, which imports this module

STORE_TIMEOUT_S = 60.0


def enter(rank: int, spec: LaunchSpec) -> None:
    """The start of every process the launcher makes for a rank."""
    orphans.die_with(spec.launcher_pid)
    # what ps -o comm and /proc/PID/comm show
    orphans.prctl(orphans.PR_SET_NAME, f"ps_bench r{rank}".encode())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides how the job ends
    # one thread yet, no socket: everything from here is on the emulated host
    if rank in spec.namespaces:
        network.enter(spec.namespaces[rank])
    os.environ.update(spec.env)  # the forkserver kept the environment it started with
    if spec.log_path is not None:
        log = os.open(spec.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    streams.outlive_reader()  # the launcher's reader may leave before the job ends


def arm_and_seed(cfg, store: dist.Store, info, device: int | None, started: float) -> None:
    """This rank's next ``--mtbf`` failure, on the job's clock, and its seeds, on its device."""
    drawn = drawn_of(cfg)
    if drawn is not None:
        attempts = Attempts(store, rendezvous.restart_count())
        arm(TimedFault(drawn, role_counts(cfg), info.role, info.index,
                       attempts.job_started(started), started,
                       attempts.released if attempts.attempt else None))
    torch.manual_seed(cfg.torch_seed)
    if device is not None:
        torch.cuda.set_device(device)
        torch.cuda.manual_seed_all(cfg.cuda_seed)


def start_again(rank: int, spec: LaunchSpec) -> Any:
    """Trainer rank ``rank`` in a new process (``rejoined``); returns the process."""
    info = spec.topology().info(rank)
    print(f"ps_bench: {info.describe()} failed: its replica group starts again and heals from a "
          f"live peer at its first synchronisation", flush=True)
    # a new interpreter that imports torch, as the group's own agent would start it (torchft's
    # groups restart under torchrun each), not a fork of the launcher's warm forkserver
    return mp.start_processes(_rejoined, args=(rank, spec), nprocs=1, join=False,
                              start_method="spawn").processes[0]


def _rejoined(_: int, rank: int, spec: LaunchSpec) -> None:
    started = time.time()
    enter(rank, spec)
    try:
        rejoined(rank, spec, started)
    except BaseException as error:  # noqa: BLE001 - the launcher reads the record
        failures.fatal(error)


def rejoined(rank: int, spec: LaunchSpec, started: float) -> None:
    topology, job = spec.topology(), spec.job
    info = topology.info(rank)
    failures.set_identity(failures.Identity(info.role, info.index, rank, info.name, spec.run_dir,
                                            spec.torchrun))
    # torch's reading of the checkpoint it heals from, on every tensor it takes from a buffer
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    store = rendezvous.connect(STORE_TIMEOUT_S)
    beside = json.loads(store.get(BESIDE_KEY))
    # the fault it met is over; under --mtbf it meets its next drawn failure, as every rank does
    cfg = dataclasses.replace(job.config, inject_fault=None)
    device = spec.device_of(rank)
    arm_and_seed(cfg, store, info, device, started)
    # a group of its own: the strategy's code asks torch.distributed who it is; its replica
    # group's traffic goes over the strategy's own process group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=STORE_TIMEOUT_S))
    dataset = build_data(job.data.class_name, job.data.kwargs, cfg.torch_seed, cfg.labels)
    shard = dataset.shard(info.index, topology.num_trainers)
    trainer = TRAINERS.get(cfg.trainer)(
        info.index, cfg, job.strategy, job.model, shard.inputs, shard.targets, [], None, False,
        device_name(device), beside=beside, rejoined=True)
    ready_at = time.time()
    # this start's place among the group's starts: each keeps its own heal
    key = healed_key(info.index, store.add(healed_key(info.index, "count"), 1))
    healed: dict = {}

    def on_commit(entry: dict) -> None:
        """Each commit: the first (its heal) and the iterations committed since, for the
        master's goodput."""
        iteration = trainer.hook_context.iteration
        if not healed:
            healed.update(entry, restarted_at=started, ready_at=ready_at, from_iteration=iteration)
        store.set(key, json.dumps({**healed, "iterations": iteration - healed["from_iteration"]}))

    trainer.synchroniser.on_commit = on_commit
    while True:  # until the launcher stops it, the job done
        trainer.run_round()
