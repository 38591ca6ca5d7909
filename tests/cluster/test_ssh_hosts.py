"""``bench.py launch`` over real sshd on two namespace hosts: a run, and a worker killed mid-run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.benchrun import ROOT, communicate
from tests.cluster.machines import project_env

QUICK = ("--warmup-rounds", "1", "--rounds", "2")


def launch_command(ssh_hosts, *bench_args: str) -> list[str]:
    """``bench.py launch`` as run from the first host (the namespaces' addresses are only
    reachable from inside them)."""
    first, second = ssh_hosts.pair.hosts
    return first.command(
        sys.executable, str(ROOT / "bench.py"), "launch", "--hosts", f"{first.address},{second.address}",
        *ssh_hosts.ssh_options(), "--python", sys.executable, "--workdir", str(ROOT), "--iface", ssh_hosts.pair.iface,
        "--", *bench_args)


def job_processes(marker: str) -> list[int]:
    """Live processes, on any host, whose command line carries ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes() \
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(proc.name))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return found


def rank_pid(marker: str, rank: int) -> int | None:
    for pid in job_processes(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if f"RANK={rank}".encode() in environ and b"-u\0-m\0ps_bench" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
    return None


def test_launch_runs_across_both_hosts(ssh_hosts, tmp_path):
    out = tmp_path / "results.json"
    process = subprocess.Popen(launch_command(ssh_hosts, "--ntrainer", "2", "--nserver", "1", *QUICK, "--out", str(out)),
                               cwd=ROOT, env=project_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    stdout, stderr, _ = communicate(process, 300, "bench.py launch")
    assert process.returncode == 0, stdout + stderr
    first, second = ssh_hosts.pair.hosts
    assert f"[{second.address}] results: {out}" in stdout  # the master runs on the last host
    assert any(line.startswith(f"[{first.address}] ") for line in stdout.splitlines())
    results = json.loads(out.read_text())
    assert results["status"] == "ok" and results["replicas"]["identical"] is True
    hosts = {host["hostname"]: host for host in results["env"]["hosts"]}
    assert sorted(hosts) == ["psb-a", "psb-b"]
    assert hosts["psb-a"]["ranks"] == [0, 1] and hosts["psb-b"]["ranks"] == [2, 3]


def start_long_launch(ssh_hosts, out: Path) -> tuple[subprocess.Popen, list[str]]:
    """Starts a launch that would run for minutes, and returns once its first round is done.
    ``out`` (the results path) also marks the run's processes on every host."""
    process = subprocess.Popen(launch_command(ssh_hosts, "--ntrainer", "2", "--nserver", "1", "--rounds", "1000",
                                              "--out", str(out)),
                               cwd=ROOT, env=project_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    lines: list[str] = []
    running = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "[round 1/" in line:
                running.set()

    threading.Thread(target=read, daemon=True).start()
    if not running.wait(timeout=240):
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("the run never started its rounds:\n" + "".join(lines) + process.stderr.read())
    return process, lines


def assert_nothing_left(marker: str) -> None:
    deadline = time.monotonic() + 60
    while job_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(marker) == [], "processes of the run survived on a host"


def test_a_killed_remote_worker_ends_the_run_on_every_host(ssh_hosts, tmp_path):
    out = tmp_path / "results.json"
    process, lines = start_long_launch(ssh_hosts, out)
    victim = rank_pid(str(out), 2)  # server 0, on the second host
    assert victim is not None, job_processes(str(out))
    os.kill(victim, signal.SIGKILL)
    _, stderr, _ = communicate(process, 120, "bench.py launch after a worker was killed")
    first, second = ssh_hosts.pair.hosts
    assert process.returncode == 1, "".join(lines) + stderr
    last = stderr.strip().splitlines()[-1]
    # the first host's trainers may fail too, on their own, once their server is gone
    assert last.startswith(f"ps_bench: error: host {second.address} (node 1): server 0 (rank 2, server2) "
                           f"killed by SIGKILL"), stderr
    assert last.endswith(f"the run was stopped on every host ({first.address}, {second.address})")
    assert_nothing_left(str(out))


def test_ctrl_c_stops_every_host(ssh_hosts, tmp_path):
    out = tmp_path / "results.json"
    process, lines = start_long_launch(ssh_hosts, out)
    announced = sum(bool(re.search(r"\[round \d+/\d+\] timed +[\d.]+ s ", line)) for line in list(lines))
    process.send_signal(signal.SIGINT)
    _, stderr, _ = communicate(process, 120, "bench.py launch after Ctrl-C")
    assert process.returncode == 130, "".join(lines) + stderr
    assert stderr.strip().splitlines()[-1].startswith("ps_bench: interrupted by SIGINT; the run was stopped on every host")
    assert_nothing_left(str(out))
    # the last host's master, hung up on, wrote the rounds that finished (the hosts share this file system)
    results = json.loads(out.read_text())
    assert results["status"] == "failed" and results["rounds_completed"] >= announced, "".join(lines)
    assert "stopped by SIGHUP" in results["error"]


def test_a_host_that_cannot_run_the_job_is_named_before_anything_starts(ssh_hosts):
    command = launch_command(ssh_hosts, "--ntrainer", "2")
    command[command.index("--python") + 1] = "/nonexistent/python3"
    process = subprocess.run(command, cwd=ROOT, env=project_env(), capture_output=True, text=True, timeout=120)
    assert process.returncode == 2, process.stdout + process.stderr
    first = ssh_hosts.pair.hosts[0]
    assert process.stderr.startswith(f"ps_bench: error: host {first.address}: /nonexistent/python3 cannot import "
                                     f"ps_bench and torch"), process.stderr
    assert process.stderr.count("\n") == 1 and process.stdout == ""
