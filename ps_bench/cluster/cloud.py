"""``bench.py cloud``: a SkyPilot task YAML that runs this benchmark on rented machines.

SkyPilot provisions the nodes, copies this checkout to each (``workdir``), runs ``setup``
once per node and ``run`` on every node with ``SKYPILOT_NODE_RANK`` and ``SKYPILOT_NODE_IPS``
(one address per line, the head first) set. ``run`` starts torchrun with the static
rendezvous from them. ps_bench does not depend on SkyPilot: the YAML is plain text.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision

import ps_bench
from ps_bench.cluster.torchrun import (DEFAULT_PORT, NodeLayout, add_engine_arguments, cluster_job,
                                       export_line, summary, torchrun_command, with_iface)
from ps_bench.config import PROJECT_ROOT, ConfigError, RunConfig
from ps_bench.options import EXIT_OK, plural, typed
from ps_bench.places import check_output_file, write_output

ACCELERATORS = re.compile(r"[A-Za-z0-9_-]+(:\d+)?")
# SkyPilot's rule for a cluster name (sky launch -c NAME); tests/unit/test_cluster_commands.py
# holds it to SkyPilot's own check
CLUSTER_NAME = re.compile(r"[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?")
BENCH_OPTIONS = True
DESCRIPTION = ("Write a SkyPilot task YAML that runs this benchmark on N cloud machines, and print "
               "the sky launch command that runs it.")
EPILOG = ("""\
examples:
  python bench.py cloud --nodes 2 --accelerators H100:8 -- --ntrainer 14 --nserver 1 --backend nccl
  python bench.py cloud --nodes 2 --cloud aws --use-spot --name ps-cpu -o cpu.yaml """
          """-- --ntrainer 6 --nserver 1
  sky launch -c ps-bench ps_bench-sky.yaml    # what it prints: run it where SkyPilot is installed

The YAML copies this checkout to every node (workdir), installs torch pinned to this
machine's version and ps_bench from the checkout (setup), and starts torchrun on every node
with the static rendezvous from SKYPILOT_NODE_RANK and the first line of SKYPILOT_NODE_IPS
(run). The master runs on the last node, which writes the results file under ~/sky_workdir.
ps_bench does not need SkyPilot installed to write it.
""")


@dataclass
class CloudJob:
    layout: NodeLayout
    bench_args: list[str]
    name: str = "ps-bench"
    accelerators: str | None = None
    cloud: str | None = None
    use_spot: bool = False
    iface: str | None = None
    port: int = DEFAULT_PORT
    summary: str = ""


def gpus_of(accelerators: str | None) -> int:
    """``H100:8`` -> 8, ``H100`` -> 1, none -> 0; a ConfigError for anything else."""
    if accelerators is None:
        return 0
    if ACCELERATORS.fullmatch(accelerators) is None:
        raise ConfigError(f"--accelerators: expected NAME or NAME:COUNT, e.g. H100:8; "
                          f"got {accelerators!r}")
    name, _, count = accelerators.partition(":")
    if count and int(count) < 1:
        raise ConfigError(f"--accelerators {accelerators}: COUNT must be at least 1 (leave "
                          f"--accelerators out for machines without GPUs)")
    return int(count) if count else 1


def torch_pins() -> str:
    """torch and torchvision at this machine's releases: torchvision's compiled operators work
    only with the torch they were built for."""
    # the local build tag (+cpu, +cu130) is not on PyPI's index
    return " ".join(f"{module.__name__}=={module.__version__.split('+')[0]}"
                    for module in (torch, torchvision))


def run_script(job: CloudJob) -> str:
    """What every node runs, from SkyPilot's variables."""
    line = torchrun_command(job.layout, '"$SKYPILOT_NODE_RANK"', '"$PS_BENCH_HEAD"', job.bench_args,
                            port=job.port, python="python")
    lines = ["set -euo pipefail",
             "# the static rendezvous: the first address of SKYPILOT_NODE_IPS hosts the store",
             'PS_BENCH_HEAD=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)']
    if job.iface:
        lines.append(export_line(job.iface))
    return "\n".join([*lines, f"exec {line}"]) + "\n"


def setup_script() -> str:
    version = ps_bench.__version__
    return "\n".join([
        "set -euo pipefail",
        f"pip install {torch_pins()}  # first, pinned: an open range would pull another build",
        "pip install -e .",
        f"python -c 'import ps_bench; assert ps_bench.__version__ == \"{version}\", "
        f"ps_bench.__version__'",
    ]) + "\n"


def block(text: str, indent: str = "  ") -> str:
    """A YAML literal block (``|``), so the scripts stay readable."""
    return "|\n" + "".join(f"{indent}{line}\n" if line else "\n" for line in text.splitlines())


def task_yaml(job: CloudJob) -> str:
    resources = []
    if job.accelerators:
        resources.append(f"  accelerators: {job.accelerators}")
    if job.cloud:
        resources.append(f"  cloud: {json.dumps(job.cloud)}")
    if job.use_spot:
        resources.append("  use_spot: true")
    layout = job.layout
    lines = [
        f"# bench.py cloud: {plural(layout.nodes, 'node')} x "
        f"{plural(layout.nproc_per_node, 'process')} = "
        f"{layout.world_size} ranks"
        + (f" ({job.summary})" if job.summary else ""),
        "# The master (last rank) runs on the last node: the results file is written there, under",
        f"# ~/sky_workdir; fetch it with: rsync -Pavz {last_node(job)}:~/sky_workdir/results/ "
        f"results/",
        f"name: {json.dumps(job.name)}",
        f"num_nodes: {layout.nodes}",
        *(["resources:", *resources] if resources else []),
        f"workdir: {json.dumps(str(PROJECT_ROOT))}  # this checkout, copied to every node",
        f"setup: {block(setup_script())}".rstrip("\n"),
        f"run: {block(run_script(job))}".rstrip("\n"),
    ]
    return "\n".join(lines) + "\n"


def last_node(job: CloudJob) -> str:
    """SkyPilot's ssh name for the last node: the cluster's name, then -worker1, -worker2, ..."""
    nodes = job.layout.nodes
    return job.name if nodes == 1 else f"{job.name}-worker{nodes - 1}"


def launch_hint(job: CloudJob, path: str) -> str:
    return f"sky launch -c {shlex.quote(job.name)} {shlex.quote(path)}"


# -- the command line --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", required=True, type=typed(int, "nodes"), metavar="N",
                        help="machines to use")
    parser.add_argument("--accelerators", metavar="NAME[:COUNT]",
                        help="GPUs per machine, e.g. H100:8 (default: none)")
    parser.add_argument("--cloud", metavar="C",
                        help="aws, gcp, azure, ... (default: SkyPilot's choice)")
    parser.add_argument("--use-spot", action="store_true", help="spot instances")
    parser.add_argument("--name", default="ps-bench", metavar="J",
                        help="task and cluster name (default: ps-bench)")
    add_engine_arguments(parser, node="machine")
    parser.add_argument("-o", "--output", default="ps_bench-sky.yaml", metavar="FILE",
                        help="where to write the YAML (default: ps_bench-sky.yaml)")


def check(args: argparse.Namespace, bench_argv: list[str]) -> tuple[RunConfig, NodeLayout]:
    """The engine's options and the bench options, for the job as it will run on the nodes."""
    check_output_file(args.output, "-o")
    if CLUSTER_NAME.fullmatch(args.name) is None:
        raise ConfigError(f"--name {args.name!r}: SkyPilot names a cluster with a letter, then "
                          f"letters, digits, '-', '_' or '.', ending with a letter or digit")
    return cluster_job(args, bench_argv, args.nodes, gpus_of(args.accelerators))


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    cfg, layout = check(args, bench_argv)
    job = CloudJob(layout, with_iface(bench_argv, args.iface), name=args.name,
                   accelerators=args.accelerators, cloud=args.cloud, use_spot=args.use_spot,
                   iface=args.iface, port=args.port, summary=summary(cfg))
    write_output(args.output, "-o", lambda path: Path(path).write_text(task_yaml(job)))
    print(f"ps_bench: wrote {args.output}; run it with: {launch_hint(job, args.output)}")
    return EXIT_OK
