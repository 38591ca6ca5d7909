"""``bench.py slurm``: an sbatch script that runs one torchrun agent per node through ``srun``.

SLURM allocates the nodes and starts one task on each; torchrun (static rendezvous, node rank
from ``$SLURM_NODEID``) starts and supervises the ranks. ``$SLURM_NODEID`` is 0 in the batch
shell itself, so the script hands each task a single-quoted command that expands it there.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ps_bench.cluster.torchrun import DEFAULT_PORT, NodeLayout, torchrun_command
from ps_bench.config import ConfigError

OUTPUT = "%x-%j.out"  # job name and id: one log per job, next to where it was submitted


@dataclass
class SlurmJob:
    """What ``bench.py slurm`` was asked for, with the layout the validated run needs."""

    layout: NodeLayout
    bench_args: list[str]
    job_name: str = "ps_bench"
    gpus_per_node: int = 0
    partition: str | None = None
    time: str | None = None
    iface: str | None = None
    port: int = DEFAULT_PORT
    max_restarts: int = 0
    python: str = sys.executable
    summary: str = ""  # one line on what the job runs, for the script's header
    extra_directives: list[str] = field(default_factory=list)


def directives(job: SlurmJob) -> list[str]:
    lines = [f"--job-name={job.job_name}", f"--nodes={job.layout.nodes}", "--ntasks-per-node=1",
             f"--output={OUTPUT}"]
    if job.gpus_per_node:
        lines.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.partition:
        lines.append(f"--partition={job.partition}")
    if job.time:
        lines.append(f"--time={job.time}")
    return [f"#SBATCH {line}" for line in lines + job.extra_directives]


def sbatch_script(job: SlurmJob) -> str:
    """The whole script, ready for ``sbatch``."""
    layout = job.layout
    node_command = torchrun_command(layout, '"$SLURM_NODEID"', '"$PS_BENCH_HEAD"', job.bench_args,
                                    port=job.port, max_restarts=job.max_restarts, python=job.python)
    lines = [
        "#!/bin/bash",
        f"# bench.py slurm: {layout.nodes} nodes x {layout.nproc_per_node} processes = {layout.world_size} ranks"
        + (f" ({job.summary})" if job.summary else ""),
        "# The master (last rank) runs on the last node: the results file is written there.",
        *directives(job),
        "set -euo pipefail",
        "",
        "# torchrun's static rendezvous: the first node hosts the store, every node gets its rank",
        'PS_BENCH_HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export PS_BENCH_HEAD",
    ]
    if job.iface:
        lines += [f"export TP_SOCKET_IFNAME={shlex.quote(job.iface)} GLOO_SOCKET_IFNAME={shlex.quote(job.iface)}"]
    lines += [
        "",
        "# single quotes: $SLURM_NODEID must be expanded by each task (it is 0 in this batch shell)",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote('exec ' + node_command)}",
        "",
    ]
    return "\n".join(lines)


def submit(script: str, path: str | None) -> int:
    """``sbatch --wait``: returns the job's exit status (0 when every node succeeded)."""
    if shutil.which("sbatch") is None:
        raise ConfigError("--submit: sbatch is not on PATH; run this on a SLURM login node, or write the "
                          "script with -o FILE and submit it where SLURM is")
    if path is not None:
        Path(path).write_text(script)
        return subprocess.run(["sbatch", "--wait", path]).returncode
    with tempfile.NamedTemporaryFile("w", prefix="ps_bench-", suffix=".sbatch") as stream:
        stream.write(script)  # sbatch keeps its own copy once the job is queued
        stream.flush()
        return subprocess.run(["sbatch", "--wait", stream.name]).returncode


def write_or_print(script: str, path: str | None) -> None:
    if path is None:
        sys.stdout.write(script)
        return
    Path(path).write_text(script)
    print(f"ps_bench: wrote {path}; submit it with: sbatch {shlex.quote(path)}")


def bench_args_with_iface(bench_args: Sequence[str], iface: str | None) -> list[str]:
    """The ranks check the interface on their own node (it need not exist where the script is written)."""
    return [*bench_args, "--iface", iface] if iface else list(bench_args)
