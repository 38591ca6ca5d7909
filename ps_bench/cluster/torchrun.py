"""The one torchrun command line every engine runs, one per node, with the static rendezvous.

The static rendezvous is the only one that honours ``--node-rank``, so ranks are dealt in
node order and the roles (trainers first, servers, the master last) land on known nodes:
the master, and so the results file, is on the last node.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from typing import Sequence

from ps_bench.config import ConfigError, RunConfig

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class NodeLayout:
    """How a job's processes are spread: the same number on every node, as torchrun needs."""

    nodes: int
    nproc_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def ranks_of(self, node: int) -> range:
        return range(node * self.nproc_per_node, (node + 1) * self.nproc_per_node)


def layout_for(cfg: RunConfig, nodes: int, hosts: bool = False) -> NodeLayout:
    """Splits the job's world size over ``nodes`` (given as --nodes, or as a list of ``hosts``);
    a ConfigError says how to make it divide."""
    if nodes < 1:
        raise ConfigError(f"--nodes must be at least 1; got {nodes}")
    world = cfg.world_size
    if world % nodes:
        more = -world % nodes
        given = f"{nodes} hosts" if hosts else f"--nodes {nodes}"
        counts = ", ".join(str(n) for n in range(1, world + 1) if world % n == 0)
        raise ConfigError(
            f"{given} do{'' if hosts else 'es'} not divide this job's {world} processes ({cfg.num_trainers} "
            f"trainer(s) + {cfg.num_servers} server(s) + 1 master), and torchrun starts the same number on every "
            f"node: add {more} trainer(s) (--ntrainer {cfg.ntrainer + more}) or use "
            f"{'a number of hosts' if hosts else '--nodes'} among {counts}")
    return NodeLayout(nodes, world // nodes)


def trainers_per_node(cfg: RunConfig, layout: NodeLayout) -> int:
    """The most trainers any node runs (what a GPU count must cover)."""
    return max(sum(rank < cfg.num_trainers for rank in layout.ranks_of(node)) for node in range(layout.nodes))


def torchrun_command(layout: NodeLayout, node_rank: str, master_addr: str, bench_args: Sequence[str], *,
                     port: int = DEFAULT_PORT, max_restarts: int = 0, python: str = sys.executable) -> str:
    """One shell line that starts this node's torchrun agent. ``node_rank`` and ``master_addr``
    are shell words, left as they are so a variable (``"$SLURM_NODEID"``) is expanded where
    the line runs; everything else is quoted."""
    command = [
        shlex.quote(python), "-m", "torch.distributed.run",
        "--nnodes", str(layout.nodes), "--nproc-per-node", str(layout.nproc_per_node),
        "--rdzv-backend", "static", "--node-rank", node_rank,
        "--master-addr", master_addr, "--master-port", str(port),
        "--max-restarts", str(max_restarts),
        "-m", "ps_bench", *(shlex.quote(arg) for arg in bench_args),
    ]
    return " ".join(command)
