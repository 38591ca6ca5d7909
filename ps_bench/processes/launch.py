"""Process start and supervision.

Locally, ``spawn`` hosts the rendezvous store in the parent (on a socket bound to ``--master-addr``,
loopback by default, before any child starts, so no other run can take its port), starts every rank
from the preloaded forkserver (``ps_bench.runtime.preload``) and watches them: the first rank that
fails ends the job, named by role and rank, no process is left running, and the results of the
rounds that finished are kept. A local job's ranks bind RPC and gloo to the loopback interface.
Under torchrun, ``run_torchrun_rank`` runs the one rank torchrun started; torchrun's agent hosts the
store and supervises.

A rank forked by the forkserver is the forkserver's child, not the launcher's: it dies with the
forkserver and with the launcher (``orphans.die_with``), so nothing outlives a launcher killed by
SIGKILL.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from ps_bench.config import ConfigError, RunConfig
from ps_bench.job import Job
from ps_bench.options import plural
from ps_bench.results.files import environment, failed_results, keep_results, read_snapshot
from ps_bench.processes import orphans, rejoin, rendezvous
from ps_bench.runtime import failures, membership, network, preload
from ps_bench.runtime.addresses import interface_env, loopback
from ps_bench.processes.attempts import Attempts
from ps_bench.processes.master import Master
from ps_bench.processes.supervision import (JobFailed, listen_for_stack_requests, supervise,
                                            terminate)
from ps_bench.runtime.topology import MASTER, TRAINER, Topology
from ps_bench.strategies.record import HEAL

PG_BACKENDS = {"gloo": "gloo", "nccl": "nccl", "multi": "cpu:gloo,cuda:nccl"}


@dataclass
class LaunchSpec:
    """Everything a rank needs; pickled to every spawned process."""

    job: Job
    argv: list[str]
    run_dir: str  # failure records, stacks and the master's snapshot of finished rounds
    results_path: str
    local_world_size: int
    gpus_per_node: int
    torchrun: bool = False
    # when the command started: "ready after N s"
    launched_at: float = field(default_factory=time.time)
    # the launcher's start-up (time.time())
    milestones: dict[str, float] = field(default_factory=dict)
    # set by every local rank first: the store, the interface
    env: dict[str, str] = field(default_factory=dict)
    # where local ranks write their output (a sweep point's log), else inherited
    log_path: str | None = None
    launcher_pid: int = field(default_factory=os.getpid)
    # rank -> its emulated host's namespaces
    namespaces: dict[int, dict[str, str]] = field(default_factory=dict)
    emulated: dict | None = None  # the emulated network, for the results (env.emulated)

    @property
    def config(self) -> RunConfig:
        return self.job.config

    def topology(self) -> Topology:
        return self.job.topology()

    def device_of(self, rank: int) -> int | None:
        return self.topology().device_index(rank, self.local_world_size, self.gpus_per_node)

    def interface(self) -> str | None:
        """The interface every rank binds TensorPipe and gloo to: ``--iface``; an emulated host's
        link; loopback when every rank is on this machine (nothing needs more, nothing else may
        reach it); else None, their own choice."""
        if self.config.iface:
            return self.config.iface
        if self.namespaces:
            return network.HOST_IFACE
        return loopback() if self.local_world_size == self.config.world_size else None


def new_run_dir() -> str:
    """A private folder for the job's files (stacks, failure records, the finished rounds). Under
    torchrun, each rank's own, inside the folder torchrun keeps for that rank and attempt: a rank
    its agent stops with SIGTERM (a peer failed) cannot remove its folder, and torchrun leaves its
    own folders in place, so what such a rank leaves is with them, not loose in /tmp."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    parent = Path(error_file).parent if error_file else None
    return tempfile.mkdtemp(prefix="ps_bench-",
                            dir=parent if parent is not None and parent.is_dir() else None)


def rpc_options(spec: LaunchSpec, rank: int) -> rpc.TensorPipeRpcBackendOptions:
    topology, cfg = spec.topology(), spec.config
    maps = topology.device_maps(rank, spec.local_world_size, spec.gpus_per_node)
    tcp = {}
    # TCP sockets only; CUDA tensors staged through the host, over the same
    if cfg.rpc_transport == "tcp":
        tcp = {"_transports": ["uv"], "_channels": ["basic", "cuda_basic"] if maps else ["basic"]}
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=cfg.rpc_threads or topology.rpc_worker_threads(rank),
        rpc_timeout=cfg.rpc_timeout,
        init_method=rendezvous.INIT_METHOD,  # this attempt's keys only (elastic restarts)
        **tcp,
    )
    for peer, device_map in maps.items():
        options.set_device_map(peer, device_map)
    if maps:
        options.set_devices([spec.device_of(rank)])
    return options


def worker(rank: int, spec: LaunchSpec, started: float | None = None) -> None:
    """One rank from start to shutdown. Any exception ends the process with status 1 after
    recording its role, rank and traceback for the launcher. ``started``: when this rank's
    process began (start-up phases)."""
    started = time.time() if started is None else started
    topology, cfg = spec.topology(), spec.config
    info = topology.info(rank)
    failures.set_identity(failures.Identity(info.role, info.index, rank, info.name, spec.run_dir,
                                            spec.torchrun))
    # init_rpc's internal gloo group trips a deprecation warning in torch itself, once per rank
    warnings.filterwarnings("ignore", message="You are using a Backend")
    listen_for_stack_requests(spec.run_dir, rank)
    if spec.torchrun and cfg.timeout:  # no launcher of ours to enforce --timeout: each rank does
        faulthandler.dump_traceback_later(cfg.timeout, exit=True)
    master = None
    iface = spec.interface()
    if iface:  # read by TensorPipe and gloo when they open their sockets
        os.environ.update(interface_env(iface))
    try:
        store_timeout = max(cfg.rpc_timeout, 60.0)
        store, view = rendezvous.join(rank, int(os.environ.get("LOCAL_RANK", rank)), store_timeout)
        times = {"started": started, "joined": time.time()}
        if any(spec.job.goes_on().values()):
            membership.keep_failures(store, rank)
        rejoin.arm_and_seed(cfg, store, info, spec.device_of(rank), started)
        if info.role == TRAINER:  # before RPC, so the group exists when the master builds DDP
            dist.init_process_group(
                PG_BACKENDS[cfg.backend],
                store=dist.PrefixStore("trainers/", rendezvous.attempt_view(store_timeout)),
                rank=info.index, world_size=topology.num_trainers,
                timeout=timedelta(seconds=store_timeout),
            )
        times["grouped"] = time.time()
        rpc.init_rpc(info.name, rank=rank, world_size=topology.world_size,
                     rpc_backend_options=rpc_options(spec, rank))
        times["connected"] = time.time()
        rendezvous.publish_startup(view, rank, times)
        if info.role == MASTER:
            recovered = rendezvous.recovered_failures(store, topology.world_size)
            if recovered:
                print(f"ps_bench: torchrun restart {len(recovered)} of "
                      f"{rendezvous.max_restarts()}: starting the job over after "
                      f"{recovered[-1]['failure']}", flush=True)
            master = Master(spec.job, topology, spec.device_of, spec.argv,
                            spec.run_dir, spec.results_path, spec.launched_at,
                            hosts=rendezvous.gather_hosts(view, topology.world_size),
                            recovered=recovered,
                            startup=lambda: {
                                "launcher": {"launched": spec.launched_at, **spec.milestones},
                                "ranks": rendezvous.gather_startup(view, topology.world_size)},
                            emulated=spec.emulated,
                            on_stop=(lambda name: keep_torchrun_rounds(
                                master, spec, f"{info.describe()} stopped by {name} before the "
                                f"job finished (torchrun stops every rank when one fails or "
                                f"when it is stopped)", quietly=True))
                            if spec.torchrun else None,
                            attempts=Attempts(store, rendezvous.restart_count(),
                                              restartable=rendezvous.restarts_left()))
            master.run()
        if not any(spec.job.goes_on().values()):
            rpc.shutdown()
        else:
            membership.leave(rendezvous.attempt_view(store_timeout), info.role == MASTER)
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - every failure must reach the launcher
        if master is not None and spec.torchrun:
            keep_torchrun_rounds(master, spec, f"{info.describe()} failed: {error}")
        failures.fatal(error)


def keep_torchrun_rounds(master: Master, spec: LaunchSpec, error: str,
                         quietly: bool = False) -> None:
    """Under torchrun, no launcher of ours keeps the finished rounds: the master writes the
    failed run's results file itself (a job torchrun restarts writes its file later).
    ``quietly``: from a signal handler, whose line must not go through ``print`` (the stream
    it interrupted may be inside its own write)."""
    if rendezvous.restarts_left():
        return
    path = keep_results(master.record.results("failed", error=error), spec.results_path)
    if path is None:
        return
    line = f"results (failed run): {path}\n"
    if quietly:
        os.write(sys.stdout.fileno(), line.encode())
    else:
        print(line, end="", flush=True)


def _spawned(rank: int, spec: LaunchSpec) -> None:
    started = time.time()
    rejoin.enter(rank, spec)
    worker(rank, spec, started)
    # The rank's work is done and RPC and its process group are shut down: end here rather than
    # in the interpreter's teardown of torch, which took 1.3 s per rank on the development machine,
    # the launcher waiting on it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def host_store(cfg: RunConfig) -> tuple[dist.TCPStore, int]:
    """The job's store and its port, listening on a socket bound to ``--master-addr`` (loopback
    by default) at ``--master-port`` (else a free port). torch's own TCPStore server would
    listen on every interface; handed a bound socket, it listens only there (and closes it)."""
    port = f" port {cfg.master_port}" if cfg.master_port else ""
    listener = socket.socket(socket.AF_INET6 if ":" in cfg.master_addr else socket.AF_INET)
    try:
        listener.bind((cfg.master_addr, cfg.master_port or 0))
        listener.listen(socket.SOMAXCONN)
        store = dist.TCPStore(cfg.master_addr, listener.getsockname()[1], is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=60),
                              master_listen_fd=listener.fileno())
        bound = listener.getsockname()[1]
        listener.detach()  # the store owns the socket now
        return store, bound
    except (RuntimeError, OSError) as error:
        listener.close()
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if isinstance(error, OSError) and error.strerror:
            reason = error.strerror
        if cfg.master_port and "address already in use" in reason.lower():
            reason = ("it is already in use; pick another --master-port "
                      "or leave it out for a free one")
        raise ConfigError(f"cannot listen on --master-addr {cfg.master_addr}{port}: "
                          f"{reason}") from None


def keep_finished_rounds(spec: LaunchSpec, error: str) -> Path | None:
    """Writes the failed run's results file from the master's last snapshot (or, if the master
    never got going, what was asked), as ``keep_results`` does."""
    results = failed_results(read_snapshot(spec.run_dir), error, config=spec.config.to_dict(),
                             argv=spec.argv, env=environment(spec.config.backend))
    return keep_results(results, spec.results_path)


def spawn(spec: LaunchSpec, watchdog: tuple[float, str] | None = None) -> int:
    """Runs every rank on this machine (on an emulated network when the options ask for one);
    returns 0 or raises (JobFailed, KeyboardInterrupt, ...) after every process is gone, the
    emulated network with them, and the finished rounds are written. ``watchdog`` (seconds,
    option) ends a job that runs longer, as --timeout does (the shorter wins)."""
    cfg = spec.config
    if cfg.timeout and (watchdog is None or cfg.timeout < watchdog[0]):
        watchdog = (cfg.timeout, "--timeout")
    for path in orphans.recover():
        print(f"results (an earlier run on this machine, its launcher killed): {path}", flush=True)
    spec.run_dir = new_run_dir()
    owner = orphans.claim(spec.run_dir, spec.results_path)
    emulated = store = None
    processes = []
    try:
        if cfg.emulate_link is not None:
            try:
                emulated = network.build(cfg)
            except RuntimeError as error:
                raise JobFailed(str(error)) from None
            emulated_env(spec, emulated)
            print(emulated.describe(lambda rank: spec.topology().info(rank).name), flush=True)
        else:
            store, port = host_store(cfg)
            spec.env = {
                "MASTER_ADDR": cfg.master_addr,
                "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank is a client of the store above
            }
        preload.start(cfg.debug, models=[cfg.model])  # running already when bench.py started it
        try:
            context = mp.start_processes(_spawned, args=(spec,), nprocs=cfg.world_size, join=False,
                                         start_method=preload.START_METHOD)
            processes = context.processes
            goes_on = spec.job.goes_on()
            heals = spec.job.strategy.recovery == HEAL
            supervise(spec, processes, watchdog, tolerated={
                info.rank for info in spec.topology().ranks if goes_on.get(info.role)},
                restart=(lambda rank: rejoin.start_again(rank, spec)) if heals else None)
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
        if emulated is not None:
            emulated.close()
            if emulated.keep:
                print(emulated.kept(), flush=True)
        shutil.rmtree(spec.run_dir, ignore_errors=True)
        owner.close()


def emulated_env(spec: LaunchSpec, emulated: network.EmulatedNetwork) -> None:
    """What the ranks of an emulated network need: their hosts' namespaces, the store as a file
    in the private run folder (no network is shared with the launcher), and NCCL kept off the
    shortcuts that would bypass the links."""
    spec.namespaces = {rank: emulated.namespaces_of(rank) for rank in range(spec.config.world_size)}
    spec.emulated = emulated.record()
    spec.env = {rendezvous.STORE_FILE: str(Path(spec.run_dir) / "store"),
                "MASTER_ADDR": emulated.address(0), "NCCL_SOCKET_IFNAME": network.HOST_IFACE,
                "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


def interruption(error: BaseException) -> str:
    if isinstance(error, KeyboardInterrupt):
        return "interrupted by SIGINT"
    if isinstance(error, failures.Terminated):
        return "terminated by SIGTERM"
    return f"launcher failed: {type(error).__name__}: {error}"


def run_torchrun_rank(spec: LaunchSpec) -> int:
    """Runs the rank torchrun started (RANK, WORLD_SIZE and the store come from torchrun)."""
    world, cfg = int(os.environ["WORLD_SIZE"]), spec.config
    if world != cfg.world_size:
        why_none = ("" if cfg.num_servers or not spec.job.strategy.takes_servers else
                    f": --hook {cfg.hook} sends nothing to parameter servers, so none start "
                    f"unless --nserver asks")
        raise ConfigError(
            f"torchrun started {world} processes but this run needs {cfg.world_size} "
            f"({plural(cfg.num_trainers, 'trainer')} + {plural(cfg.num_servers, 'server')} + 1 "
            f"master{why_none}); set --nproc-per-node x --nnodes to {cfg.world_size}")
    if any(spec.job.goes_on().values()):
        raise ConfigError("--trainer-timeout, --server-replicas and torchft's groups under "
                          "failures keep a job going without a rank, where torchrun stops every "
                          "rank when one fails: run without torchrun")
    spec.run_dir = new_run_dir()  # this rank's own: torchrun's agent does the supervising
    worker(int(os.environ["RANK"]), spec)
    shutil.rmtree(spec.run_dir, ignore_errors=True)
    return 0


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ
