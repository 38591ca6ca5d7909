"""Process start and supervision.

Locally, ``spawn`` hosts the rendezvous store in the parent (bound before any child starts,
so no other run can take its port), starts every rank with ``torch.multiprocessing`` and
watches them: the first rank that fails ends the job, named by role and rank, no process is
left running, and the results of the rounds that finished are kept. Under torchrun,
``run_torchrun_rank`` runs the one rank torchrun started; torchrun's agent hosts the store
and supervises.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from ps_bench import failures, rendezvous
from ps_bench.config import ConfigError, RunConfig
from ps_bench.master import Master
from ps_bench.metrics.record import failed_results, read_snapshot
from ps_bench.metrics.results import environment, write_results
from ps_bench.models.entries import Entry
from ps_bench.topology import MASTER, TRAINER, Topology

PG_BACKENDS = {"gloo": "gloo", "nccl": "nccl", "multi": "cpu:gloo,cuda:nccl"}
GRACE_S = 2.0  # SIGTERM, then this long, then SIGKILL
SETTLE_S = 0.3  # after a failure, how long the ranks it took down get to report theirs
STACKS_WAIT_S = 5.0  # how long a rank asked for its stacks gets to write them
PR_SET_PDEATHSIG = 1


@dataclass
class LaunchSpec:
    """Everything a rank needs; pickled to every spawned process."""

    config: RunConfig
    model: Entry
    data: Entry
    argv: list[str]
    run_dir: str  # failure records, stacks and the master's snapshot of finished rounds
    results_path: str
    local_world_size: int
    gpus_per_node: int
    torchrun: bool = False
    launched_at: float = field(default_factory=time.time)  # when the command started: "ready after N s"

    def topology(self) -> Topology:
        cfg = self.config
        return Topology(cfg.ntrainer, cfg.ncudatrainer, cfg.nserver, cfg.ncudaserver, cfg.mapping,
                        cuda_collectives=cfg.backend != "gloo")

    def device_of(self, rank: int) -> int | None:
        return self.topology().device_index(rank, self.local_world_size, self.gpus_per_node)


def new_run_dir() -> str:
    return tempfile.mkdtemp(prefix="ps_bench-")


def stacks_file(run_dir: str, rank: int) -> Path:
    """Where a rank writes its Python stacks on SIGUSR1; it exists once the rank can do so."""
    return Path(run_dir) / f"stacks-rank{rank}.txt"


def listen_for_stack_requests(run_dir: str, rank: int) -> None:
    """From here on SIGUSR1 makes this rank write every thread's Python stack. The file gets
    its final name only once the handler is in place: until then SIGUSR1 would kill the rank,
    so the launcher asks only ranks whose file exists."""
    final = stacks_file(run_dir, rank)
    pending = final.with_suffix(".pending")
    stream = open(pending, "w")
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    os.replace(pending, final)


def rpc_options(spec: LaunchSpec, rank: int) -> rpc.TensorPipeRpcBackendOptions:
    topology, cfg = spec.topology(), spec.config
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=cfg.rpc_threads or topology.rpc_worker_threads(rank),
        rpc_timeout=cfg.rpc_timeout,
        init_method=rendezvous.INIT_METHOD,  # this attempt's keys only (elastic restarts)
    )
    maps = topology.device_maps(rank, spec.local_world_size, spec.gpus_per_node)
    for peer, device_map in maps.items():
        options.set_device_map(peer, device_map)
    if maps:
        options.set_devices([spec.device_of(rank)])
    return options


def die_with_parent() -> None:
    """Linux: the kernel kills this process if the launcher dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def worker(rank: int, spec: LaunchSpec) -> None:
    """One rank from start to shutdown. Any exception ends the process with status 1 after
    recording its role, rank and traceback for the launcher."""
    topology, cfg = spec.topology(), spec.config
    info = topology.info(rank)
    failures.set_identity(failures.Identity(info.role, info.index, rank, info.name, spec.run_dir, spec.torchrun))
    # init_rpc's internal gloo group trips a deprecation warning in torch itself, once per rank
    warnings.filterwarnings("ignore", message="You are using a Backend")
    listen_for_stack_requests(spec.run_dir, rank)
    if spec.torchrun and cfg.timeout:  # no launcher of ours to enforce --timeout: each rank does
        faulthandler.dump_traceback_later(cfg.timeout, exit=True)
    master = None
    if cfg.iface:  # read by TensorPipe and gloo when they open their sockets
        os.environ.update(rendezvous.interface_env(cfg.iface))
    try:
        store_timeout = max(cfg.rpc_timeout, 60.0)
        store, view = rendezvous.join(rank, int(os.environ.get("LOCAL_RANK", rank)), store_timeout)
        torch.manual_seed(cfg.torch_seed)
        device = spec.device_of(rank)
        if device is not None:
            torch.cuda.set_device(device)
            torch.cuda.manual_seed_all(cfg.cuda_seed)
        if info.role == TRAINER:  # before RPC, so the group exists when the master builds DDP
            dist.init_process_group(
                PG_BACKENDS[cfg.backend], store=dist.PrefixStore("trainers/", rendezvous.attempt_view(store_timeout)),
                rank=info.index, world_size=topology.num_trainers, timeout=timedelta(seconds=store_timeout),
            )
        rpc.init_rpc(info.name, rank=rank, world_size=topology.world_size,
                     rpc_backend_options=rpc_options(spec, rank))
        if info.role == MASTER:
            recovered = rendezvous.recovered_failures(store, topology.world_size)
            if recovered:
                print(f"ps_bench: torchrun restart {len(recovered)} of {rendezvous.max_restarts()}: starting the job "
                      f"over after {recovered[-1]['failure']}", flush=True)
            master = Master(cfg, topology, spec.model, spec.data, spec.device_of, spec.argv,
                            spec.run_dir, spec.results_path, spec.launched_at,
                            hosts=rendezvous.gather_hosts(view, topology.world_size), recovered=recovered)
            master.run()
        rpc.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - every failure must reach the launcher
        # no launcher of ours to keep the finished rounds; a job torchrun restarts writes its file later
        if master is not None and spec.torchrun and not rendezvous.restarts_left():
            path = write_results(master.record.results("failed", error=f"{info.describe()} failed: {error}"),
                                 spec.results_path)
            print(f"results (failed run): {path}", flush=True)
        failures.fatal(error)


def _spawned(rank: int, spec: LaunchSpec) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides how the job ends
    worker(rank, spec)
    # The rank's work is done and RPC and its process group are shut down: end here rather than
    # in the interpreter's teardown of torch, which took 1.3 s per rank on the development machine,
    # the launcher waiting on it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class JobFailed(Exception):
    """The job ended badly; ``str()`` is one line, ``detail`` the traceback or stacks behind it."""

    def __init__(self, summary: str, detail: str = "") -> None:
        super().__init__(summary)
        self.detail = detail


def describe_failures(spec: LaunchSpec, exit_codes: dict[int, int]) -> JobFailed:
    """Names the first failure: a process killed by a signal, else the earliest exception."""
    topology = spec.topology()
    records = failures.read_records(spec.run_dir)
    causes = []  # (order, rank, one line, detail)
    for rank, exitcode in exit_codes.items():
        who = topology.info(rank).describe()
        record = records.get(rank)
        # a death with no record of its own (a signal, an abrupt exit) comes before the errors
        # it caused in its peers
        if exitcode < 0:
            causes.append((0.0, rank, f"{who} was {ended_how(exitcode)}", ""))
        elif record is not None:
            error = record["error"].strip().splitlines()[0]
            causes.append((record["time"], rank, f"{who} failed: {error}", record["traceback"]))
        else:
            causes.append((0.0, rank, f"{who} exited with status {exitcode} without an error of its own", ""))
    causes.sort(key=lambda cause: (cause[0], cause[1]))
    _, first_rank, summary, detail = causes[0]
    others = [topology.info(rank).name for _, rank, _, _ in causes[1:]]
    if others:
        summary += f"; then {', '.join(others)} ended too"
    return JobFailed(summary, detail)


def ended_how(exitcode: int) -> str:
    return f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit status {exitcode}"


@dataclass
class Stacks:
    """What the ranks could tell when the watchdog fired: stacks, or why there are none."""

    text: str  # one block per rank: its stacks, or a line saying why it has none
    given: int
    total: int

    def summary(self) -> str:
        if self.given == self.total:
            return "every rank's Python stacks are above"
        if self.given == 0:
            return "no rank could give its Python stacks; a line above says why for each"
        return (f"the Python stacks of {self.given} of {self.total} ranks are above; a line says why "
                f"each of the others has none")


def dump_stacks(spec: LaunchSpec, processes: list) -> Stacks:
    """Asks every rank that can answer for its Python stacks (faulthandler) and collects them;
    a rank that cannot (gone, or not yet past start-up) gets a line saying why."""
    topology = spec.topology()
    reasons: dict[int, str] = {}
    asked: list[int] = []
    for rank, process in enumerate(processes):
        if process.exitcode is not None:
            reasons[rank] = f"it had already ended ({ended_how(process.exitcode)})"
        elif not stacks_file(spec.run_dir, rank).exists():
            reasons[rank] = "it was still starting (importing torch and ps_bench), before it can give stacks"
        else:
            try:
                os.kill(process.pid, signal.SIGUSR1)
                asked.append(rank)
            except ProcessLookupError:
                reasons[rank] = "it ended as it was asked for them"
    deadline = time.monotonic() + STACKS_WAIT_S
    texts: dict[int, str] = {}
    while asked:
        for rank in list(asked):
            text = stacks_file(spec.run_dir, rank).read_text()
            if text.strip():
                texts[rank] = text
                asked.remove(rank)
        if not asked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    time.sleep(0.2)  # let the last writer finish its dump
    for rank in texts:
        texts[rank] = stacks_file(spec.run_dir, rank).read_text()
    for rank in asked:
        reasons[rank] = f"it was asked but wrote none within {STACKS_WAIT_S:g} s"
    parts = []
    for rank in range(len(processes)):
        who = topology.info(rank).describe()
        if rank in texts:
            parts.append(f"---- Python stacks of {who} ----\n{texts[rank].rstrip()}")
        else:
            parts.append(f"---- no Python stacks from {who}: {reasons[rank]}")
    return Stacks("\n".join(parts), len(texts), len(processes))


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
        port = f"port {cfg.master_port}" if cfg.master_port else "a free port"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if cfg.master_port and "address already in use" in reason.lower():
            reason = "it is already in use; pick another --master-port or leave it out for a free one"
        raise ConfigError(f"cannot listen on --master-addr {cfg.master_addr} {port}: {reason}") from None


def keep_finished_rounds(spec: LaunchSpec, error: str) -> Path | None:
    """Writes the failed run's results file from the master's last snapshot (or, if the master
    never got going, what was asked)."""
    results = failed_results(read_snapshot(spec.run_dir), error, config=spec.config.to_dict(), argv=spec.argv,
                             env=environment(spec.config.backend))
    try:
        return write_results(results, spec.results_path)
    except OSError:
        return None


def supervise(spec: LaunchSpec, processes: list) -> None:
    """Returns when every rank exited 0; raises JobFailed otherwise."""
    cfg = spec.config
    deadline = time.monotonic() + cfg.timeout if cfg.timeout else None
    while True:
        codes = {rank: p.exitcode for rank, p in enumerate(processes)}
        if any(code not in (None, 0) for code in codes.values()):
            time.sleep(SETTLE_S)
            codes = {rank: p.exitcode for rank, p in enumerate(processes)}
            terminate(processes)
            raise describe_failures(spec, {r: c for r, c in codes.items() if c not in (None, 0)})
        if all(code == 0 for code in codes.values()):
            return
        if deadline is not None and time.monotonic() > deadline:
            stacks = dump_stacks(spec, processes)
            terminate(processes)
            raise JobFailed(f"the job did not finish within --timeout {cfg.timeout:g} s; {stacks.summary()}",
                            stacks.text)
        time.sleep(0.1)


def spawn(spec: LaunchSpec) -> int:
    """Runs every rank on this machine; returns 0 or raises (JobFailed, KeyboardInterrupt,
    ...) after every process is gone and the finished rounds are written."""
    cfg = spec.config
    store = host_store(cfg)
    spec.run_dir = new_run_dir()
    os.environ.update(
        MASTER_ADDR=cfg.master_addr,
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank is a client of the store above
    )
    if not cfg.debug:  # once a rank is gone, every peer's RPC agent logs each broken pipe
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    processes = []
    try:
        context = mp.start_processes(_spawned, args=(spec,), nprocs=cfg.world_size, join=False,
                                     start_method="spawn")
        processes = context.processes
        supervise(spec, processes)
        return 0
    except BaseException as error:
        terminate(processes)
        reason = str(error) if isinstance(error, JobFailed) else interruption(error)
        path = keep_finished_rounds(spec, reason)
        if path is not None:
            print(f"results (failed run): {path}", flush=True)
        raise
    finally:
        del store
        shutil.rmtree(spec.run_dir, ignore_errors=True)


def interruption(error: BaseException) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted by SIGINT"
    if isinstance(error, failures.Terminated):
        return "terminated by SIGTERM"
    return f"launcher failed: {type(error).__name__}: {error}"


def run_torchrun_rank(spec: LaunchSpec) -> int:
    """Runs the rank torchrun started (RANK, WORLD_SIZE and the store come from torchrun)."""
    world = int(os.environ["WORLD_SIZE"])
    if world != spec.config.world_size:
        raise ConfigError(
            f"torchrun started {world} processes but this run needs {spec.config.world_size} "
            f"(trainers + servers + 1 master); set --nproc-per-node x --nnodes to {spec.config.world_size}"
        )
    spec.run_dir = new_run_dir()  # this rank's own: torchrun's agent does the supervising
    worker(int(os.environ["RANK"]), spec)
    shutil.rmtree(spec.run_dir, ignore_errors=True)
    return 0


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ
