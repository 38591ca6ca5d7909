"""``bench.py slurm``: an sbatch script that runs one torchrun agent per node through ``srun``.

SLURM allocates the nodes and starts one task on each; torchrun (static rendezvous, node rank
from ``$SLURM_NODEID``) starts and supervises the ranks. ``$SLURM_NODEID`` is 0 in the batch
shell itself, so the script hands each task a single-quoted command that expands it there.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ps_bench.cluster.torchrun import (DEFAULT_PORT, NodeLayout, add_engine_arguments, cluster_job,
                                       export_line, summary, torchrun_command, with_iface)
from ps_bench.config import ConfigError, RunConfig
from ps_bench.options import EXIT_FAILED, EXIT_OK, EXIT_SIGINT, plural, typed
from ps_bench.places import check_output_file, write_output

OUTPUT = "%x-%j.out"  # job name and id: one log per job, next to where it was submitted
# sbatch --time's forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds; and no limit
SLURM_TIME = re.compile(r"\d+(-\d+)?(:\d+){0,2}|infinite|unlimited", re.IGNORECASE)
BENCH_OPTIONS = True
DESCRIPTION = (
    "Write an sbatch script that runs this benchmark on N nodes: srun starts one task per node, "
    "each starts a torchrun agent (static rendezvous, the first node hosts the store, node rank "
    "from $SLURM_NODEID), and torchrun starts and supervises the ranks.")
EPILOG = """\
examples:
  python bench.py slurm --nodes 2 -- --ntrainer 6 --nserver 1            # print the script
  python bench.py slurm --nodes 2 --gpus-per-node 4 --partition gpu --time 00:30:00 \\
      --iface eth1 -o job.sbatch -- --ntrainer 6 --nserver 1 --backend nccl
  python bench.py slurm --nodes 2 --submit -- --ntrainer 2 --nserver 1  # sbatch --wait, its status

The bench options after -- are checked here first (bad ones exit 2 before anything queues).
nodes x processes per node must equal the job's trainers + servers + 1; the master (last rank)
runs on the last node, which writes the results file (--out, relative to the submit folder).
The job's log is %x-%j.out (job name, job id).
"""


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


def directive_value(value: str) -> str:
    """A directive's value as sbatch reads it: quoted where it holds a space (``check`` refuses
    what quotes cannot carry)."""
    return f'"{value}"' if any(character.isspace() for character in value) else value


def directives(job: SlurmJob) -> list[str]:
    lines = [f"--job-name={directive_value(job.job_name)}", f"--nodes={job.layout.nodes}",
             "--ntasks-per-node=1", f"--output={OUTPUT}"]
    if job.gpus_per_node:
        lines.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.partition:
        lines.append(f"--partition={directive_value(job.partition)}")
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
        f"# bench.py slurm: {plural(layout.nodes, 'node')} x "
        f"{plural(layout.nproc_per_node, 'process')} = "
        f"{layout.world_size} ranks"
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
        lines.append(export_line(job.iface))
    lines += [
        "",
        "# single quotes: $SLURM_NODEID must be expanded by each task (it is 0 in this batch "
        "shell)",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
        f"{shlex.quote('exec ' + node_command)}",
        "",
    ]
    return "\n".join(lines)


def submit(script: str, path: str | None, job_name: str) -> int:
    """``sbatch --wait``: returns the job's exit status (0 when every node succeeded)."""
    if shutil.which("sbatch") is None:
        raise ConfigError("--submit: sbatch is not on PATH; run this on a SLURM login node, or "
                          "write the script with -o FILE and submit it where SLURM is")
    if path is not None:
        write_output(path, "-o", lambda where: Path(where).write_text(script))
        return wait_for(path, job_name, kept=True)
    with tempfile.NamedTemporaryFile("w", prefix="ps_bench-", suffix=".sbatch") as stream:
        stream.write(script)  # sbatch keeps its own copy once the job is queued
        stream.flush()
        return wait_for(stream.name, job_name, kept=False)


def wait_for(path: str, job_name: str, kept: bool) -> int:
    """``sbatch --wait PATH``, its lines passed on; then a line saying what became of the job
    (sbatch's status alone does not tell a job that failed from one never submitted)."""
    process = subprocess.Popen(["sbatch", "--wait", path], stdout=subprocess.PIPE, text=True)
    job = None
    try:
        for line in process.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            submitted = re.match(r"Submitted batch job (\d+)", line)
            if submitted and job is None:
                job = submitted.group(1)
        code = process.wait()
    except KeyboardInterrupt:
        process.wait()
        sys.stderr.write("ps_bench: interrupted; sbatch stopped waiting"
                         + (f", and job {job} goes on unless cancelled: scancel {job}\n" if job
                            else "\n"))
        return EXIT_SIGINT
    if job is None:
        sys.stderr.write(f"ps_bench: error: sbatch did not submit the job (its error is above)"
                         f"{f'; the script is {path}' if kept else ''}\n")
        return code or EXIT_FAILED
    log = OUTPUT.replace("%x", job_name).replace("%j", job)
    if code:
        sys.stderr.write(f"ps_bench: error: SLURM job {job} ended with status {code}; its log: "
                         f"{log}\n")
    else:
        print(f"ps_bench: SLURM job {job} finished; its log: {log}")
    return code


def write_or_print(script: str, path: str | None) -> None:
    if path is None:
        sys.stdout.write(script)
        return
    write_output(path, "-o", lambda where: Path(where).write_text(script))
    print(f"ps_bench: wrote {path}; submit it with: sbatch {shlex.quote(path)}")


# -- the command line --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", required=True, type=typed(int, "nodes"), metavar="N",
                        help="nodes to use")
    parser.add_argument("--gpus-per-node", type=typed(int, "gpus-per-node"), default=0, metavar="G",
                        help="GPUs to ask for on each node (default: 0)")
    parser.add_argument("--partition", metavar="P", help="SLURM partition (default: the cluster's)")
    parser.add_argument("--time", metavar="T",
                        help="time limit, e.g. 00:30:00 (default: the partition's)")
    parser.add_argument("--job-name", default="ps_bench", metavar="J",
                        help="job name (default: ps_bench)")
    add_engine_arguments(parser)
    parser.add_argument("--max-restarts", type=typed(int, "max-restarts"), default=0, metavar="K",
                        help="torchrun restarts the whole job up to K times after a failure "
                             "(default: 0)")
    parser.add_argument("--python", default=sys.executable, metavar="PATH",
                        help=f"interpreter on the nodes (default: this one, {sys.executable})")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the script here instead of printing it")
    parser.add_argument("--submit", action="store_true",
                        help="submit with sbatch --wait and exit with the job's status")


def check(args: argparse.Namespace, bench_argv: list[str]) -> tuple[RunConfig, NodeLayout]:
    """The engine's options and the bench options, for the job as it will run on the nodes."""
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more; got {args.max_restarts}")
    if args.gpus_per_node < 0:  # cluster_job reads -1 as "unknown", not as a count
        raise ConfigError(f"--gpus-per-node must be 0 or more; got {args.gpus_per_node}")
    if args.time is not None and not SLURM_TIME.fullmatch(args.time):
        raise ConfigError(f"--time {args.time!r}: sbatch takes minutes, minutes:seconds, "
                          f"hours:minutes:seconds, days-hours, days-hours:minutes or "
                          f"days-hours:minutes:seconds (e.g. 00:30:00), or UNLIMITED")
    for flag, value in (("--job-name", args.job_name), ("--partition", args.partition)):
        if value is not None and (not value.strip() or '"' in value or
                                  not all(c.isprintable() or c == " " for c in value)):
            raise ConfigError(f"{flag} {value!r}: the script's #SBATCH line cannot carry it (a "
                              f"name, not empty, without quotes or control characters)")
    if args.output is not None:
        check_output_file(args.output, "-o")
    return cluster_job(args, bench_argv, args.nodes, args.gpus_per_node)


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    cfg, layout = check(args, bench_argv)
    job = SlurmJob(layout, with_iface(bench_argv, args.iface), job_name=args.job_name,
                   gpus_per_node=args.gpus_per_node, partition=args.partition, time=args.time,
                   iface=args.iface, port=args.port, max_restarts=args.max_restarts,
                   python=args.python, summary=summary(cfg))
    script = sbatch_script(job)
    if args.submit:
        return submit(script, args.output, args.job_name)
    write_or_print(script, args.output)
    return EXIT_OK
