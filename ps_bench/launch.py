"""Process start and supervision.

Locally, ``spawn`` hosts the rendezvous store in the parent (bound before any child starts,
so no other run can take its port), starts every rank with ``torch.multiprocessing`` and
watches them: the first rank that fails ends the job, named by role and rank, and no
process is left running. Under torchrun, ``run_torchrun_rank`` runs the one rank torchrun
started; torchrun's own agent hosts the store and supervises.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from ps_bench.config import ConfigError, Entry, RunConfig
from ps_bench.topology import MASTER, TRAINER, Topology

PG_BACKENDS = {"gloo": "gloo", "nccl": "nccl", "multi": "cpu:gloo,cuda:nccl"}
GRACE_S = 2.0


@dataclass
class LaunchSpec:
    """Everything a rank needs; pickled to every spawned process."""

    config: RunConfig
    model: Entry
    data: Entry
    argv: list[str]
    error_dir: str
    local_world_size: int
    gpus_per_node: int

    def topology(self) -> Topology:
        cfg = self.config
        return Topology(cfg.ntrainer, cfg.ncudatrainer, cfg.nserver, cfg.ncudaserver, cfg.mapping,
                        cuda_collectives=cfg.backend != "gloo")

    def device_of(self, rank: int) -> int | None:
        return self.topology().device_index(rank, self.local_world_size, self.gpus_per_node)


def rpc_options(spec: LaunchSpec, rank: int) -> rpc.TensorPipeRpcBackendOptions:
    topology, cfg = spec.topology(), spec.config
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=cfg.rpc_threads,
        rpc_timeout=cfg.rpc_timeout,
        init_method="env://",
    )
    maps = topology.device_maps(rank, spec.local_world_size, spec.gpus_per_node)
    for peer, device_map in maps.items():
        options.set_device_map(peer, device_map)
    if maps:
        options.set_devices([spec.device_of(rank)])
    return options


def error_file(error_dir: str, rank: int) -> Path:
    return Path(error_dir) / f"rank{rank}.json"


def worker(rank: int, spec: LaunchSpec) -> None:
    """One rank from start to shutdown; any exception ends the process with status 1 after
    recording its role, rank and traceback for the supervisor."""
    topology = spec.topology()
    info = topology.info(rank)
    cfg = spec.config
    # init_rpc's internal gloo group trips a deprecation warning in torch itself, once per rank
    warnings.filterwarnings("ignore", message="You are using a Backend")
    try:
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
        torch.manual_seed(cfg.torch_seed)
        device = spec.device_of(rank)
        if device is not None:
            torch.cuda.set_device(device)
            torch.cuda.manual_seed_all(cfg.cuda_seed)
        timeout = timedelta(seconds=max(cfg.rpc_timeout, 60.0))
        if info.role == TRAINER:  # before RPC, so the group exists when the master builds DDP
            dist.init_process_group(
                PG_BACKENDS[cfg.backend], init_method="env://", rank=info.index,
                world_size=topology.num_trainers, timeout=timeout,
            )
        rpc.init_rpc(info.name, rank=rank, world_size=topology.world_size,
                     rpc_backend_options=rpc_options(spec, rank))
        if info.role == MASTER:
            from ps_bench.master import Master

            Master(cfg, topology, spec.model, spec.data, spec.device_of, spec.argv).run()
        rpc.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - every failure must reach the supervisor
        text = traceback.format_exc()
        record = {"role": info.role, "index": info.index, "rank": rank, "name": info.name,
                  "error": f"{type(error).__name__}: {error}".strip(), "traceback": text, "time": time.time()}
        try:
            error_file(spec.error_dir, rank).write_text(json.dumps(record))
        except OSError:
            pass
        sys.stderr.write(f"[{info.name}] {text}")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)  # skip interpreter teardown: RPC threads can block it when a peer is gone


def _spawned(local_rank: int, spec: LaunchSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides how the job ends
    worker(local_rank, spec)


class JobFailed(Exception):
    """A rank failed; ``str()`` names it by role and rank, with the cause."""


def failure_message(spec: LaunchSpec, failed: dict[int, int]) -> str:
    """One line naming the first failure (a killed process, else the earliest exception)."""
    topology = spec.topology()
    causes = []
    for rank, exitcode in failed.items():
        info = topology.info(rank)
        path = error_file(spec.error_dir, rank)
        if exitcode < 0:
            name = signal.Signals(-exitcode).name
            causes.append((0.0, f"{info.describe()} was killed by {name}"))
        elif path.exists():
            record = json.loads(path.read_text())
            causes.append((record["time"], f"{info.describe()} failed: {record['error']}"))
        else:
            causes.append((float("inf"), f"{info.describe()} exited with status {exitcode}"))
    causes.sort(key=lambda c: c[0])
    message = causes[0][1]
    if len(causes) > 1:
        message += f" (then {len(causes) - 1} more rank(s) failed)"
    return message


def terminate(processes: list) -> None:
    """SIGTERM, then SIGKILL after a grace period, for every process still alive."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def host_store(cfg: RunConfig) -> dist.TCPStore:
    try:
        return dist.TCPStore(cfg.master_addr, cfg.master_port or 0, is_master=True,
                             wait_for_workers=False, timeout=timedelta(seconds=60))
    except (RuntimeError, OSError) as error:
        port = cfg.master_port or "a free port"
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"cannot listen on --master-addr {cfg.master_addr} port {port}: {first_line}") from None


def spawn(spec: LaunchSpec) -> int:
    """Runs every rank on this machine; returns the job's exit status."""
    cfg = spec.config
    store = host_store(cfg)
    os.environ.update(
        MASTER_ADDR=cfg.master_addr,
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank is a client of the store above
    )
    context = mp.start_processes(_spawned, args=(spec,), nprocs=cfg.world_size, join=False, start_method="spawn")
    processes = context.processes
    try:
        while True:
            codes = {rank: p.exitcode for rank, p in enumerate(processes)}
            failed = {rank: code for rank, code in codes.items() if code not in (None, 0)}
            if failed:
                time.sleep(0.3)  # let the ranks it took down report too, to find the first cause
                failed = {r: p.exitcode for r, p in enumerate(processes) if p.exitcode not in (None, 0)}
                terminate(processes)
                raise JobFailed(failure_message(spec, failed))
            if all(code == 0 for code in codes.values()):
                return 0
            time.sleep(0.1)
    except BaseException:
        terminate(processes)
        raise
    finally:
        del store


def run_torchrun_rank(spec: LaunchSpec) -> int:
    """Runs the rank torchrun started (RANK, WORLD_SIZE and the store come from torchrun)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != spec.config.world_size:
        raise ConfigError(
            f"torchrun started {world} processes but this run needs {spec.config.world_size} "
            f"(trainers + servers + 1 master); set --nproc-per-node x --nnodes to {spec.config.world_size}"
        )
    worker(int(os.environ["RANK"]), spec)
    return 0


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def new_error_dir() -> str:
    return tempfile.mkdtemp(prefix="ps_bench-")
