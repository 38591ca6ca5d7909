"""The store every rank of a job shares, seen one attempt at a time.

Both launch paths give every rank a store at ``MASTER_ADDR:MASTER_PORT`` (ours under
``spawn``, torchrun's agent store under torchrun). torchrun keeps that store across elastic
restarts (``--max-restarts``), so the keys a failed attempt wrote are still there when the
group starts again, and RPC's and gloo's start-up would read the dead attempt's addresses.
Each attempt therefore works under its own prefix, named by ``TORCHELASTIC_RESTART_COUNT``.
Only failure records live outside it, on purpose: they are how a restarted attempt learns
what it recovered from. Each rank also leaves a description of its host in its attempt's
view, which the master gathers into the results' ``env.hosts``.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

from ps_bench.options import plural
from ps_bench.runtime import failures
from ps_bench.runtime.addresses import own_address
from ps_bench.runtime.faults import restart_count

SCHEME = "ps-bench-attempt"
INIT_METHOD = f"{SCHEME}://"  # what RPC is given: the store of this attempt, see _rendezvous
FAILURES_PREFIX = "ps_bench/failures"
STORE_FILE = "PS_BENCH_STORE_FILE"

_timeout_s: float | None = None  # set by join(): how long store operations may wait


def max_restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def restarts_left() -> bool:
    """True when torchrun will start the job again if this attempt fails."""
    return restart_count() < max_restarts()


def attempt_prefix(attempt: int) -> str:
    return f"ps_bench/attempt{attempt}/"


def failure_key(attempt: int, rank: int) -> str:
    return f"{FAILURES_PREFIX}/attempt{attempt}/rank{rank}"


def connect(timeout_s: float) -> dist.Store:
    """A client of the job's store (never its host: the launcher or torchrun's agent is): a file
    in the job's private run folder where the launcher says so (``STORE_FILE``: ranks in the
    namespaces of an emulated network share no network with the launcher), else TCP at
    ``MASTER_ADDR:MASTER_PORT``."""
    if STORE_FILE in os.environ:
        store = dist.FileStore(os.environ[STORE_FILE], -1)
        store.set_timeout(timedelta(seconds=timeout_s))
        return store
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def attempt_view(timeout_s: float) -> dist.Store:
    """A client of its own, seen through this attempt's prefix. RPC and the trainers' group each
    get one, as ``env://`` gave them: RPC sets its own timeout on the store it is handed."""
    return dist.PrefixStore(attempt_prefix(restart_count()), connect(timeout_s))


def join(rank: int, local_rank: int, timeout_s: float) -> tuple[dist.Store, dist.Store]:
    """Connects to the store, publishes this rank's host, and, under torchrun, keeps failure
    records where the next attempt finds them. Returns (whole store, this attempt's view).
    From here on RPC started with ``INIT_METHOD`` rendezvouses in this attempt."""
    global _timeout_s
    store = connect(timeout_s)
    attempt = restart_count()
    if max_restarts() > 0:
        failures.add_sink(lambda entry: store.set(failure_key(attempt, rank), json.dumps(
            {**entry, "host": socket.gethostname()})))
    view = dist.PrefixStore(attempt_prefix(attempt), store)
    view.set(f"host/rank{rank}", json.dumps(describe_host(rank, local_rank)))
    _timeout_s = timeout_s
    return store, view


def _rendezvous(url: str, **kwargs):
    """``torch.distributed.rendezvous`` handler: a store of this attempt, and the rank and world
    size from the query RPC adds."""
    if _timeout_s is None:
        raise RuntimeError(f"{INIT_METHOD} needs ps_bench.processes.rendezvous.join() first")
    query = parse_qs(urlparse(url).query)
    yield attempt_view(_timeout_s), int(query["rank"][0]), int(query["world_size"][0])
    raise RuntimeError(f"{INIT_METHOD} cannot rendezvous twice")


try:
    dist.register_rendezvous_handler(SCHEME, _rendezvous)
except RuntimeError:  # already registered (module reloaded)
    pass


# -- hosts ------------------------------------------------------------------------------------
def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def describe_host(rank: int, local_rank: int) -> dict:
    """This rank's host: its name, and its address on the interface the ranks bind to (else the
    one that reaches the store)."""
    return {
        "hostname": socket.gethostname(),
        "address": own_address(),
        "rank": rank,
        "local_rank": local_rank,
        "cpus": os.cpu_count() or 0,
        "gpus": gpu_count(),
        "machine": machine_id(),
    }


def machine_id() -> str:
    """What TensorPipe compares to decide that two processes share a machine (its shared-memory
    transport and CMA channel): the kernel's boot id and the PID namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return socket.gethostname()


def rpc_paths(hosts: list[dict], rpc_transport: str) -> dict:
    """How RPC payloads travel between the job's hosts: with ``tcp``, TensorPipe's uv transport
    and basic channel, over the network; with ``auto``, TensorPipe's own choice, which is shared
    memory (shm transport, CMA channel) between processes it finds on one machine, even hosts
    made of network namespaces, and TCP (uv, basic) between machines."""
    machines = {host.get("machine") for host in hosts}
    if rpc_transport == "tcp":
        return {"option": "tcp", "transport": "uv", "channel": "basic", "over": "TCP sockets"}
    if len(machines) <= 1:
        return {"option": "auto", "transport": "shm", "channel": "cma",
                "over": "shared memory (one machine)"}
    return {"option": "auto", "transport": "uv", "channel": "basic",
            "over": "TCP sockets between machines, "
                    "shared memory between processes of one machine"}


def one_machine_warning(hosts: list[dict], rpc_transport: str) -> str | None:
    """A line for a job whose hosts are one machine (network namespaces) while RPC may go
    through shared memory: it would compare an RPC through memory with collectives through the
    network."""
    names = [host["hostname"] for host in hosts]
    if (rpc_transport != "auto" or len(set(names)) < 2 or
            len({host.get("machine") for host in hosts}) != 1):
        return None
    return (f"ps_bench: warning: hosts {', '.join(dict.fromkeys(names))} are one machine (one boot "
            "id and PID namespace): RPC between them goes through shared memory, not the network; "
            "--rpc-transport tcp makes it cross the network")


def crowded_warning(hosts: list[dict], cpu_trainers: set[int]) -> str | None:
    """A line for a job with more trainers computing on a machine's CPUs than it has: their batch
    times then include waiting for a CPU, which is neither compute nor communication. Hosts that
    are one machine (emulated hosts, namespaces) count together."""
    machines: dict[str, dict] = {}
    for host in hosts:
        machine = machines.setdefault(host.get("machine") or host["hostname"],
                                      {"names": [], "cpus": host["cpus"], "trainers": 0})
        machine["names"].append(host["hostname"])
        machine["trainers"] += len(cpu_trainers.intersection(host["ranks"]))
    crowded = [f"{m['trainers']} CPU trainers on {plural(m['cpus'], 'CPU')} "
               f"({', '.join(dict.fromkeys(m['names']))})"
               for m in machines.values() if 0 < m["cpus"] < m["trainers"]]
    if not crowded:
        return None
    return (f"ps_bench: warning: {'; '.join(crowded)}: batch times include waiting for a CPU, "
            f"beside compute and communication; give each trainer a CPU of its own for times "
            f"that hold elsewhere")


def gather_hosts(view: dist.Store, world_size: int) -> list[dict]:
    """One entry per host (hostname and address), with the ranks it runs, in rank order."""
    hosts: dict[tuple[str, str], dict] = {}
    for rank in range(world_size):
        rank_host = json.loads(view.get(f"host/rank{rank}"))
        key = (rank_host["hostname"], rank_host["address"])
        entry = hosts.setdefault(key, {"hostname": key[0], "address": key[1], "ranks": [],
                                       "cpus": rank_host["cpus"], "gpus": rank_host["gpus"],
                                       "machine": rank_host.get("machine")})
        entry["ranks"].append(rank)
    return list(hosts.values())


def publish_startup(view: dist.Store, rank: int, times: dict[str, float]) -> None:
    """This rank's start-up milestones (time.time()): process start, store joined, process
    group ready, RPC up."""
    view.set(f"startup/rank{rank}", json.dumps(times))


def gather_startup(view: dist.Store, world_size: int) -> list[dict[str, float]]:
    """Every rank's start-up milestones, in rank order (waits for the ones not written yet)."""
    return [json.loads(view.get(f"startup/rank{rank}")) for rank in range(world_size)]


# -- restarts ---------------------------------------------------------------------------------
def recovered_failures(store: dist.Store, world_size: int) -> list[dict]:
    """What ended each earlier attempt: the first failure any rank recorded in it."""
    recovered = []
    for attempt in range(restart_count()):
        keys = [failure_key(attempt, rank) for rank in range(world_size)]
        records = [json.loads(store.get(key)) for key in keys if store.check([key])]
        if not records:
            recovered.append({"attempt": attempt,
                              "failure": "no rank recorded a cause (killed by a signal, "
                                         "or stopped by torchrun)"})
            continue
        first = min(records, key=lambda record: record["time"])
        who = (f"{first['role']} {first['index']} (rank {first['rank']}, {first['name']}) "
               f"on {first['host']}")
        recovered.append({"attempt": attempt, "role": first["role"], "rank": first["rank"],
                          "host": first["host"], "time": first["time"],
                          # a trainer's iterations done when it failed
                          **({"iteration": first["iteration"]} if "iteration" in first else {}),
                          "failure": f"{who} failed: {first['error'].splitlines()[0]}"})
    return recovered
