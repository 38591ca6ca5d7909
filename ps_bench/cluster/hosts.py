"""``bench.py launch``: one torchrun agent per host of your own, started over OpenSSH's ``ssh``.

OpenSSH's client is on every machine that has hosts to reach, reads the user's own keys,
agents and ``~/.ssh/config``, and needs nothing installed on our side. Each agent runs under
``ssh -tt``: with a terminal, closing the connection hangs up the remote session, so
stopping the local ``ssh`` stops torchrun there, and torchrun stops its ranks (without a
terminal, sshd leaves the remote command running). torchrun supervises the ranks; this
module only watches the ``ssh`` clients: the first host whose agent fails ends the run on
every host.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

import ps_bench
from ps_bench.cluster.torchrun import (DEFAULT_PORT, UNKNOWN_GPUS, NodeLayout, add_engine_arguments, cluster_job,
                                       torchrun_command, with_iface)
from ps_bench.config import ConfigError, RunConfig
from ps_bench.runtime.failures import Terminated, raise_terminated
from ps_bench.options import EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM, typed
from ps_bench.runtime.addresses import interface_env
from ps_bench.runtime.topology import Topology

STOP_GRACE_S = 10.0  # after the local ssh clients are told to stop, before they are killed
PREFLIGHT_TIMEOUT_S = 60.0
SETTLE_S = 5.0  # after a host fails, how long the others get to report their own failure
BENCH_OPTIONS = True
DESCRIPTION = (
    "Run this benchmark on your own hosts: one torchrun agent per host, started over OpenSSH's ssh "
    "(static rendezvous; node ranks in host order), each host's output prefixed with its name.")
EPILOG = """\
examples:
  python bench.py launch --hosts node1,node2 -- --ntrainer 6 --nserver 1
  python bench.py launch --hostfile hosts.txt --ssh-key ~/.ssh/bench --iface eth1 \\
      --python /opt/venv/bin/python --workdir /srv/ps_bench -- --ntrainer 6 --nserver 1 --out results/r.json
  python bench.py launch --hosts alice@10.0.0.1,alice@10.0.0.2 --ssh-option StrictHostKeyChecking=accept-new -- --rounds 3

A hostfile lists one [user@]host per line, optionally with slots=N (DeepSpeed's and MPI's
format; N must be the processes per host). Every host must be reachable with ssh without a
password, and have ps_bench and torch at this machine's versions (checked first). The first
host hosts torchrun's store (--port); the last host runs the master and writes the results
file (--out, relative to --workdir). Ctrl-C or a failed host stops every host's processes.
"""


@dataclass(frozen=True)
class Target:
    """``[user@]host`` as the user wrote it."""

    destination: str
    slots: int | None = None

    @property
    def host(self) -> str:
        return self.destination.rpartition("@")[2]


@dataclass
class SshOptions:
    key: str | None = None
    port: int | None = None
    options: list[str] = field(default_factory=list)  # -o KEY=VALUE, passed through

    def argv(self) -> list[str]:
        argv = ["-o", "BatchMode=yes"]  # never stop to ask for a password
        if self.key:
            argv += ["-i", self.key]
        if self.port:
            argv += ["-p", str(self.port)]
        for option in self.options:
            argv += ["-o", option]
        return argv


@dataclass
class HostJob:
    targets: list[Target]
    layout: NodeLayout
    bench_args: list[str]
    ssh: SshOptions
    python: str = "python3"
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    iface: str | None = None
    port: int = DEFAULT_PORT
    master_addr: str | None = None  # default: the first host's name as given

    @property
    def head(self) -> str:
        return self.master_addr or self.targets[0].host


# -- reading hosts ------------------------------------------------------------------------------
def parse_hosts(text: str) -> list[Target]:
    targets = [Target(item.strip()) for item in text.split(",") if item.strip()]
    if not targets:
        raise ConfigError("--hosts: expected [user@]host[,[user@]host...]; got none")
    return targets


def read_hostfile(path: str) -> list[Target]:
    """One host per line, ``[user@]host [slots=N]`` (DeepSpeed's and MPI's format); # comments."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"--hostfile {path!r} cannot be read: {error.strerror}") from None
    targets = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = None
        for word in words[1:]:
            match = re.fullmatch(r"slots=(\d+)", word)
            if match is None:
                raise ConfigError(f"--hostfile {path}:{number}: expected '[user@]host [slots=N]'; got {line.strip()!r}")
            slots = int(match.group(1))
        targets.append(Target(words[0], slots))
    if not targets:
        raise ConfigError(f"--hostfile {path!r} lists no hosts")
    return targets


def check_targets(targets: Sequence[Target], layout: NodeLayout) -> None:
    seen = set()
    for target in targets:
        if target.destination in seen:
            raise ConfigError(f"host {target.destination} is listed twice; list each host once")
        seen.add(target.destination)
        if target.slots is not None and target.slots != layout.nproc_per_node:
            raise ConfigError(f"the hostfile gives {target.destination} slots={target.slots}, but this job runs "
                              f"{layout.nproc_per_node} processes on each of its {layout.nodes} hosts")


# -- commands --------------------------------------------------------------------------------------
def remote_shell(job: HostJob, command: str) -> str:
    """The command line the remote shell runs: into the work folder, the job's variables, then ``command``."""
    exports = {**job.env, **(interface_env(job.iface) if job.iface else {})}
    prefix = f"cd {shlex.quote(job.workdir)} && " if job.workdir else ""
    assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in exports.items())
    return f"{prefix}exec {'env ' + assignments + ' ' if assignments else ''}{command}"


def agent_command(job: HostJob, node_rank: int) -> list[str]:
    line = torchrun_command(job.layout, str(node_rank), shlex.quote(job.head), job.bench_args, port=job.port,
                            python=job.python)
    return ["ssh", "-tt", *job.ssh.argv(), job.targets[node_rank].destination, remote_shell(job, line)]


def preflight_command(job: HostJob, target: Target) -> list[str]:
    probe = "import ps_bench, torch; print(ps_bench.__version__, torch.__version__)"
    return ["ssh", *job.ssh.argv(), target.destination,
            remote_shell(job, f"{shlex.quote(job.python)} -c {shlex.quote(probe)}")]


def local_versions() -> str:
    return f"{ps_bench.__version__} {torch.__version__}"


def preflight(job: HostJob) -> None:
    """Every host answers over ssh and imports ps_bench and torch at this machine's versions."""
    wanted = local_versions()
    checks = {target: subprocess.Popen(preflight_command(job, target), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for target in job.targets}
    for target, check in checks.items():
        try:
            stdout, stderr = check.communicate(timeout=PREFLIGHT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in checks.values():
                other.kill()
            raise ConfigError(f"host {target.destination}: no answer over ssh in {PREFLIGHT_TIMEOUT_S:g} s") from None
        last = (stderr.strip().splitlines() or [""])[-1]
        if check.returncode == 255:
            raise ConfigError(f"host {target.destination}: cannot connect over ssh: {last}")
        if check.returncode != 0:
            raise ConfigError(f"host {target.destination}: {job.python} cannot import ps_bench and torch "
                              f"(in {job.workdir or 'the login folder'}): {last}; install them there "
                              f"(ps_bench, and torch pinned to this machine's) or set --python/--workdir")
        found = stdout.strip().splitlines()[-1] if stdout.strip() else ""
        if found != wanted:
            raise ConfigError(f"host {target.destination} has ps_bench and torch {found or '(nothing printed)'}, "
                              f"this machine {wanted}; install the same versions on every host")


# -- running -------------------------------------------------------------------------------------
ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)


def failed_rank(output: str) -> tuple[int, int] | None:
    """(rank, exit code) of the root cause torchrun reported, if it did."""
    cause = output.rpartition("Root Cause")[2]
    rank, code = ROOT_CAUSE_RANK.search(cause), ROOT_CAUSE_EXIT.search(cause)
    if rank is None or code is None:
        return None
    return int(rank.group(1)), int(code.group(1))


def exit_meaning(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class Agent:
    """One host's ssh client: its output, prefixed and kept, and how it ended."""

    def __init__(self, job: HostJob, node_rank: int, write: Callable[[str], None]) -> None:
        self.target = job.targets[node_rank]
        self.node_rank = node_rank
        self.output: list[str] = []
        self.ended_at: float | None = None
        self.process = subprocess.Popen(agent_command(job, node_rank), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        errors="replace", start_new_session=True)
        self.reader = threading.Thread(target=self.relay, args=(write,), daemon=True)
        self.reader.start()

    def relay(self, write: Callable[[str], None]) -> None:
        for line in self.process.stdout:
            line = line.rstrip("\r\n").replace("\r", "")
            self.output.append(line)
            write(f"[{self.target.host}] {line}\n")

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None and self.ended_at is None:
            self.ended_at = time.monotonic()
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()  # the connection closes, the remote session hangs up


def describe_failure(agent: Agent, job: HostJob, role_of: Callable[[int], str]) -> str:
    """``host H (node N): trainer 1 (rank 3, trainer3) killed by SIGKILL``, from torchrun's report."""
    where = f"host {agent.target.host} (node {agent.node_rank})"
    cause = failed_rank("\n".join(agent.output))
    code = agent.process.returncode
    if code == 255 and cause is None:
        return f"{where}: the ssh connection failed: {(agent.output or ['(no output)'])[-1]}"
    if cause is None:
        return f"{where}: torchrun ended with {exit_meaning(code)}"
    rank, rank_code = cause
    return f"{where}: {role_of(rank)} {exit_meaning(rank_code)}"


def settle(agents: Sequence[Agent]) -> None:
    """Gives the other hosts a moment to report their own failure: a rank's death soon shows
    as errors in its peers on other hosts, and the report should name the death."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and any(agent.poll() is None for agent in agents):
        time.sleep(0.1)


def root_cause_order(agent: Agent) -> tuple[int, float]:
    """A rank killed by a signal first (it caused the others' errors), then the earliest."""
    cause = failed_rank("\n".join(agent.output))
    killed = cause is not None and cause[1] < 0
    return (0 if killed else 1, agent.ended_at or 0.0)


def summarise_failures(failed: Sequence[Agent], job: HostJob, role_of: Callable[[int], str]) -> str:
    ordered = sorted(failed, key=root_cause_order)
    summary = describe_failure(ordered[0], job, role_of)
    if len(ordered) > 1:
        summary += f"; then {', '.join(agent.target.host for agent in ordered[1:])} failed too"
    return summary


def run(job: HostJob, role_of: Callable[[int], str], write: Callable[[str], None] = sys.stdout.write) -> int:
    """Starts every host's agent and waits; returns 0, or raises HostsFailed naming the first
    host that failed, after every remote process is stopped."""
    lock = threading.Lock()

    def locked_write(text: str) -> None:
        with lock:
            write(text)
            sys.stdout.flush()

    agents: list[Agent] = []
    try:
        agents = [Agent(job, node, locked_write) for node in range(len(job.targets))]
        while True:
            codes = [agent.poll() for agent in agents]
            if any(code not in (None, 0) for code in codes):
                settle(agents)
                failed = [agent for agent in agents if agent.poll() not in (None, 0)]
                stop_all(agents)
                raise HostsFailed(summarise_failures(failed, job, role_of))
            if all(code == 0 for code in codes):
                stop_all(agents)
                return 0
            time.sleep(0.1)
    except BaseException:
        stop_all(agents)
        raise


def stop_all(agents: Sequence[Agent]) -> None:
    for agent in agents:
        agent.stop()
    deadline = time.monotonic() + STOP_GRACE_S
    for agent in agents:
        try:
            agent.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            agent.process.kill()
            agent.process.wait()
    for agent in agents:
        agent.reader.join(timeout=STOP_GRACE_S)


class HostsFailed(Exception):
    """A host's agent failed; ``str()`` names the host and the rank."""


# -- the command line --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_mutually_exclusive_group(required=True)
    hosts.add_argument("--hosts", metavar="[USER@]H1,H2,...", help="the hosts, the first one is the head")
    hosts.add_argument("--hostfile", metavar="FILE", help="the hosts, one per line ([user@]host [slots=N])")
    parser.add_argument("--ssh-key", metavar="FILE", help="private key for ssh -i (default: ssh's own choice)")
    parser.add_argument("--ssh-port", type=typed(int, "ssh-port"), metavar="P", help="sshd's port on every host")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to ssh as -o KEY=VALUE (repeat for more)")
    add_engine_arguments(parser, node="host")
    parser.add_argument("--python", default="python3", metavar="PATH",
                        help="interpreter on the hosts; an ssh session has a bare PATH, so prefer an absolute "
                             "path (default: python3)")
    parser.add_argument("--workdir", metavar="DIR", help="folder to run in on every host (default: the login folder)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job on every host (repeat for more)")
    parser.add_argument("--master-addr", metavar="ADDR", help="address the hosts reach the first host at "
                        "(default: the first host's name as given)")


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env: expected KEY=VALUE; got {item!r}")
        env[key] = value
    return env


def check(args: argparse.Namespace, bench_argv: list[str]) -> tuple[list[Target], RunConfig, NodeLayout]:
    """The hosts (the hostfile read), the engine's options and the bench options, before any host
    is reached."""
    targets = parse_hosts(args.hosts) if args.hosts else read_hostfile(args.hostfile)
    parse_env(args.env)
    cfg, layout = cluster_job(args, bench_argv, len(targets), UNKNOWN_GPUS, hosts=True)
    check_targets(targets, layout)
    return targets, cfg, layout


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    targets, cfg, layout = check(args, bench_argv)
    env = parse_env(args.env)
    job = HostJob(targets, layout, with_iface(bench_argv, args.iface), SshOptions(args.ssh_key, args.ssh_port,
                  args.ssh_option), python=args.python, workdir=args.workdir, env=env, iface=args.iface,
                  port=args.port, master_addr=args.master_addr)
    preflight(job)
    topology = Topology(cfg.ntrainer, cfg.ncudatrainer, cfg.nserver, cfg.ncudaserver, cfg.mapping,
                        cuda_collectives=cfg.backend != "gloo")
    names = ", ".join(target.host for target in targets)
    print(f"ps_bench: {layout.world_size} processes on {layout.nodes} hosts ({names}), {layout.nproc_per_node} "
          f"each; the master and the results file are on {targets[-1].host}", flush=True)
    signal.signal(signal.SIGTERM, raise_terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run(job, lambda rank: topology.info(rank).describe())
    except HostsFailed as error:
        sys.stderr.write(f"ps_bench: error: {error}; the run was stopped on every host ({names})\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write(f"ps_bench: interrupted by SIGINT; the run was stopped on every host ({names})\n")
        return EXIT_SIGINT
    except Terminated:
        sys.stderr.write(f"ps_bench: terminated by SIGTERM; the run was stopped on every host ({names})\n")
        return EXIT_SIGTERM
