"""``bench.py cloud``: a SkyPilot task YAML that runs this benchmark on rented machines.

SkyPilot provisions the nodes, copies this checkout to each (``workdir``), runs ``setup``
once per node and ``run`` on every node with ``SKYPILOT_NODE_RANK`` and ``SKYPILOT_NODE_IPS``
(one address per line, the head first) set. ``run`` starts torchrun with the static
rendezvous from them. ps_bench does not depend on SkyPilot: the YAML is plain text.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

import ps_bench
from ps_bench.cluster.torchrun import DEFAULT_PORT, NodeLayout, torchrun_command
from ps_bench.config import PROJECT_ROOT, ConfigError

ACCELERATORS = re.compile(r"[A-Za-z0-9_-]+(:\d+)?")


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
        raise ConfigError(f"--accelerators: expected NAME or NAME:COUNT, e.g. H100:8; got {accelerators!r}")
    name, _, count = accelerators.partition(":")
    return int(count) if count else 1


def torch_pins() -> str:
    """torch and torchvision at this machine's releases: torchvision's compiled operators work
    only with the torch they were built for."""
    import torch
    import torchvision

    # the local build tag (+cpu, +cu130) is not on PyPI's index
    return " ".join(f"{module.__name__}=={module.__version__.split('+')[0]}" for module in (torch, torchvision))


def run_script(job: CloudJob) -> str:
    """What every node runs, from SkyPilot's variables."""
    line = torchrun_command(job.layout, '"$SKYPILOT_NODE_RANK"', '"$PS_BENCH_HEAD"', job.bench_args,
                            port=job.port, python="python")
    lines = ["set -euo pipefail",
             "# the static rendezvous: the first address of SKYPILOT_NODE_IPS hosts the store",
             'PS_BENCH_HEAD=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)']
    if job.iface:
        lines.append(f"export TP_SOCKET_IFNAME={shlex.quote(job.iface)} GLOO_SOCKET_IFNAME={shlex.quote(job.iface)}")
    return "\n".join([*lines, f"exec {line}"]) + "\n"


def setup_script() -> str:
    version = ps_bench.__version__
    return "\n".join([
        "set -euo pipefail",
        f"pip install {torch_pins()}  # first, pinned: an open range would pull another build",
        "pip install -e .",
        f"python -c 'import ps_bench; assert ps_bench.__version__ == \"{version}\", ps_bench.__version__'",
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
        f"# bench.py cloud: {layout.nodes} nodes x {layout.nproc_per_node} processes = {layout.world_size} ranks"
        + (f" ({job.summary})" if job.summary else ""),
        "# The master (last rank) runs on the last node: the results file is written there, under",
        f"# ~/sky_workdir; fetch it with: rsync -Pavz {last_node(job)}:~/sky_workdir/results/ results/",
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
