"""What every cluster engine shares: the one torchrun command line it runs on each node (the
static rendezvous), the flags every engine takes (``--iface``, ``--port``), the interface
export, and the check of the bench options for the job as it will run on its nodes.

The static rendezvous is the only one that honours ``--node-rank``, so ranks are dealt in
node order and the roles (trainers first, servers, the master last) land on known nodes:
the master, and so the results file, is on the last node.

An engine is one module of ``ps_bench.cluster`` with ``DESCRIPTION``, ``EPILOG``,
``BENCH_OPTIONS = True``, ``add_arguments(parser)`` and ``main(args, bench_argv)``, and one
line in ``ps_bench.cli.SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ps_bench.config import ConfigError, RunConfig
from ps_bench.runfiles import build_config
from ps_bench.job import check_options, validate
from ps_bench.options import parse_run_options, plural, typed
from ps_bench.places import check_apart, check_port
from ps_bench.runtime.addresses import interface_env

DEFAULT_PORT = 29500
UNKNOWN_GPUS = -1  # hosts of one's own: the GPU count is what the options ask for, each host checks


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
            f"{given} do{'' if hosts else 'es'} not divide this job's {world} processes "
            f"({plural(cfg.num_trainers, 'trainer')} + {plural(cfg.num_servers, 'server')} + 1 "
            f"master), and torchrun starts the same number on every node: add "
            f"{plural(more, 'trainer')} "
            f"(--ntrainer {cfg.ntrainer + more}) or use "
            f"{'a number of hosts' if hosts else '--nodes'} among {counts}")
    return NodeLayout(nodes, world // nodes)


def trainers_per_node(cfg: RunConfig, layout: NodeLayout) -> int:
    """The most trainers any node runs (what a GPU count must cover)."""
    return max(sum(rank < cfg.num_trainers for rank in layout.ranks_of(node))
               for node in range(layout.nodes))


def torchrun_command(layout: NodeLayout, node_rank: str, master_addr: str,
                     bench_args: Sequence[str], *, port: int = DEFAULT_PORT,
                     max_restarts: int = 0, python: str = sys.executable) -> str:
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


# -- what every engine shares ------------------------------------------------------------------
def add_engine_arguments(parser: argparse.ArgumentParser, node: str = "node") -> None:
    """``--iface`` and ``--port``; ``node`` is what the engine calls a machine (node, host)."""
    parser.add_argument("--iface", metavar="NAME",
                        help=f"network interface between the {node}s: exported as "
                             f"TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, checked on each {node}")
    parser.add_argument("--port", type=typed(int, "port"), default=DEFAULT_PORT, metavar="P",
                        help=f"port of torchrun's store on the first {node} "
                             f"(default: {DEFAULT_PORT})")


def export_line(iface: str) -> str:
    """The shell line that exports the interface variables for ``iface``."""
    return "export " + " ".join(f"{key}={shlex.quote(value)}"
                                for key, value in interface_env(iface).items())


def with_iface(bench_args: Sequence[str], iface: str | None) -> list[str]:
    """The bench options, plus ``--iface`` so that each node's ranks check it where they run."""
    return [*bench_args, "--iface", iface] if iface else list(bench_args)


def summary(cfg: RunConfig) -> str:
    return f"{plural(cfg.num_trainers, 'trainer')}, {plural(cfg.num_servers, 'server')}, 1 master"


def cluster_job(args: argparse.Namespace, bench_argv: list[str], nodes: int, gpus_per_node: int,
                hosts: bool = False) -> tuple[RunConfig, NodeLayout]:
    """Checks the engine's ``--port`` and the bench options for a job of ``nodes`` nodes as it will
    run there; returns the config and the layout. The interface is checked by each node when its
    ranks start (it need not exist where the job is written)."""
    check_port("--port", args.port)
    values, config_path = parse_run_options(bench_argv)
    cfg = build_config(values, config_path)
    read = [config_path, cfg.ds_config, cfg.model_config_path, cfg.data_config_path]
    check_apart({"-o": getattr(args, "output", None)},  # slurm's and cloud's script
                {Path(path).resolve() for path in read if path})
    if cfg.emulate_link is not None:
        raise ConfigError("--emulate-link emulates a network of hosts on this one machine: run it "
                          "with bench.py (bench.py emulate), not across real nodes")
    if args.iface and cfg.iface and cfg.iface != args.iface:  # with_iface's would win
        raise ConfigError(f"--iface {args.iface} and, in the run options, --iface {cfg.iface}: "
                          f"give the interface once")
    # each option on its own, before the counts are laid out over the nodes
    check_options(cfg, machine=False)
    layout = layout_for(cfg, nodes, hosts)
    wants_cuda = cfg.backend != "gloo" or cfg.ncudatrainer or cfg.ncudaserver
    if gpus_per_node == UNKNOWN_GPUS:
        gpus_per_node = trainers_per_node(cfg, layout) + cfg.ncudaserver if wants_cuda else 0
    if wants_cuda and gpus_per_node < 1:
        raise ConfigError("the bench options use CUDA (--backend nccl/multi, --ncudatrainer or "
                          "--ncudaserver): set --gpus-per-node")
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be 0 or more; got {gpus_per_node}")
    validate(cfg, gpus=gpus_per_node, trainers_on_node=trainers_per_node(cfg, layout),
             machine=False)  # run on the nodes: their interfaces, not this machine's
    return cfg, layout
