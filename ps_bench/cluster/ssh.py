"""The agents of ``bench.py launch``, one torchrun agent per host over OpenSSH's ``ssh``: the
job's hosts (``Target``, ``HostJob``), the preflight that each host has the same ps_bench and
torch, and the run, which watches the ``ssh`` clients and ends every host's agent once one fails.
Each agent runs under ``ssh -tt``, so closing the connection hangs up the remote session and
stops torchrun there (see ``ps_bench.cluster.hosts``)."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

import ps_bench
from ps_bench.cluster.torchrun import DEFAULT_PORT, NodeLayout, torchrun_command
from ps_bench.config import ConfigError
from ps_bench.runtime.addresses import interface_env


STOP_GRACE_S = 10.0  # after the local ssh clients are told to stop, before they are killed
PREFLIGHT_TIMEOUT_S = 60.0
SETTLE_S = 5.0  # after a host fails, how long the others get to report their own failure


# what torchrun reports of the rank that failed first
ROOT_CAUSE_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.M)
ROOT_CAUSE_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)


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


# -- commands --------------------------------------------------------------------------------------
def remote_shell(job: HostJob, command: str) -> str:
    """The command line the remote shell runs: into the work folder, the job's variables, then
    ``command``."""
    exports = {**job.env, **(interface_env(job.iface) if job.iface else {})}
    prefix = f"cd {shlex.quote(job.workdir)} && " if job.workdir else ""
    assignments = " ".join(f"{key}={shlex.quote(value)}" for key, value in exports.items())
    return f"{prefix}exec {'env ' + assignments + ' ' if assignments else ''}{command}"


def agent_command(job: HostJob, node_rank: int) -> list[str]:
    line = torchrun_command(job.layout, str(node_rank), shlex.quote(job.head), job.bench_args,
                            port=job.port, python=job.python)
    return ["ssh", "-tt", *job.ssh.argv(), job.targets[node_rank].destination,
            remote_shell(job, line)]


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
            raise ConfigError(f"host {target.destination}: no answer over ssh in "
                              f"{PREFLIGHT_TIMEOUT_S:g} s") from None
        last = (stderr.strip().splitlines() or [""])[-1]
        if check.returncode == 255:
            raise ConfigError(f"host {target.destination}: cannot connect over ssh: {last}")
        if check.returncode != 0:
            raise ConfigError(f"host {target.destination}: {job.python} cannot import ps_bench and "
                              f"torch (in {job.workdir or 'the login folder'}): {last}; install "
                              f"them there (ps_bench, and torch pinned to this machine's) or set "
                              f"--python/--workdir")
        found = stdout.strip().splitlines()[-1] if stdout.strip() else ""
        if found != wanted:
            raise ConfigError(f"host {target.destination} has ps_bench and torch "
                              f"{found or '(nothing printed)'}, "
                              f"this machine {wanted}; install the same versions on every host")


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
    """``host H (node N): trainer 1 (rank 3, trainer3) killed by SIGKILL``, from torchrun's
    report."""
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


def run(job: HostJob, role_of: Callable[[int], str],
        write: Callable[[str], None] | None = None) -> int:
    """Starts every host's agent and waits; returns 0, or raises HostsFailed naming the first
    host that failed, after every remote process is stopped. ``write``: where the hosts' lines
    go, standard output as it is when they come (``ps_bench.runtime.streams``) by default."""
    lock = threading.Lock()

    def locked_write(text: str) -> None:
        with lock:
            (write or sys.stdout.write)(text)
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
