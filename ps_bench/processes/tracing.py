"""``--profile`` and ``--trace`` in the master: which round is traced (the last), where each rank
writes its trace, the servers keeping their spans over that round (``--trace``), and at the end
every rank's trace merged into one file on the master's clock (``metrics.traces``); each rank's
clock against the master's, measured once the job is ready (``env.clocks``)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed.rpc as rpc

from ps_bench.config import RunConfig
from ps_bench.metrics import traces
from ps_bench.metrics.timers import clock_id, clock_offset, clock_reading, now_ms
from ps_bench.runtime.topology import RankInfo, Topology

CLOCK_TRIPS = 5  # round trips to each rank; the shortest bounds its clock's offset best


def measure_clocks(topology: Topology) -> list[dict]:
    """Every trainer's and server's clock against the master's (``timers.clock_offset``), from
    ``CLOCK_TRIPS`` round trips over RPC each: what ``--trace`` and the servers' lane of the
    timeline set a rank of another host by."""
    clocks = []
    for info in [*topology.trainers, *topology.servers]:
        samples = []
        for _ in range(CLOCK_TRIPS):
            sent = now_ms()
            reading = rpc.rpc_sync(info.name, clock_reading)
            samples.append((sent, tuple(reading), now_ms()))
        clocks.append({"rank": info.rank, "role": info.role, "index": info.index,
                       **clock_offset(clock_id(), samples)})
    return clocks


def traced(cfg: RunConfig, round_index: int, total: int, servers: list) -> bool:
    """Whether this round is traced; with ``--trace``, the servers keep their spans from now."""
    chosen = cfg.profile is not None and round_index == total - 1
    if chosen and cfg.trace is not None:
        for server in servers:
            server.rpc_sync().trace(None)
    return chosen


def path(cfg: RunConfig, info: RankInfo) -> str:
    return str(Path(cfg.profile) / f"{info.role}{info.index}-rank{info.rank}.json")


def round_done(cfg: RunConfig, servers: list, topology: Topology) -> None:
    """The traced round is over: each server writes its spans, on its own host."""
    if cfg.trace is not None:
        for server, info in zip(servers, topology.servers):
            server.rpc_sync().trace(path(cfg, info))


def report(cfg: RunConfig, topology: Topology, clocks: list[dict]) -> None:
    """Where the traces are; with ``--trace``, the merged one written first."""
    if cfg.profile is None:
        return
    if cfg.trace is None:
        print(f"traces: {Path(cfg.profile) / 'trainer<index>-rank<rank>.json'}, one a trainer "
              f"(open at https://ui.perfetto.dev), each with its table of operators (.txt)",
              flush=True)
        return
    by_rank = {clock["rank"]: clock for clock in clocks}
    merged, missing = traces.merge(cfg.trace, [(path(cfg, info), info.role, info.index, info.rank,
                                                by_rank.get(info.rank))
                                               for info in [*topology.trainers, *topology.servers]])
    print(f"traces: {Path(cfg.trace) / '<role><index>-rank<rank>.json'}, one a rank (each "
          f"trainer's with its table of operators, .txt), and {merged}, every rank's on one "
          f"clock" + (f" but {', '.join(missing)} (written on their own hosts)" if missing else "")
          + " (open at https://ui.perfetto.dev)", flush=True)
