"""Helpers for integration tests: run ``bench.py`` as a real process tree, with a timeout and a survivor check."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class BenchRun:
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float
    results: dict | None
    out: Path | None = None  # the --out it was given

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_session_gone(pgid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not session_alive(pgid):
            return True
        time.sleep(0.1)
    return not session_alive(pgid)


def communicate(process: subprocess.Popen, timeout_s: float, what: str) -> tuple[str, str, float]:
    """Waits for a process started in its own session: a hang fails the test, and every
    process of that session must be gone shortly after it exits. Returns stdout, stderr and
    the seconds it took."""
    start = time.monotonic()
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{what} did not finish in {timeout_s} s\n{stdout}\n{stderr}")
    elapsed = time.monotonic() - start
    if not wait_session_gone(process.pid, 10):
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"processes of {what} survived it")
    return stdout or "", stderr or "", elapsed


def run_bench(*args: str, timeout_s: float = 300, out: Path | None = None, env: dict | None = None) -> BenchRun:
    """Runs ``python bench.py ARGS`` in its own session (see ``communicate``)."""
    command = [sys.executable, str(ROOT / "bench.py"), *args]
    if out is not None:
        command += ["--out", str(out)]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, **(env or {})},
    )
    stdout, stderr, elapsed = communicate(process, timeout_s, f"bench.py {' '.join(args)}")
    return BenchRun(process.returncode, stdout, stderr, elapsed, printed_results(stdout), out)


def printed_results(stdout: str) -> dict | None:
    """The results file whose path the run printed, if any."""
    for line in stdout.splitlines():
        for prefix in ("results: ", "results (failed run): "):
            if line.startswith(prefix):
                return json.loads(Path(line[len(prefix):]).read_text())
    return None


def start_bench(*args: str, env: dict | None = None) -> subprocess.Popen:
    """Starts ``python bench.py ARGS`` in its own session, stdout and stderr piped."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "bench.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, **(env or {})},
    )


def read_until(process: subprocess.Popen, text: str, timeout_s: float = 120) -> list[str]:
    """Reads stdout until a line contains ``text`` (the rest stays in the pipe); returns the
    lines read, that one included."""
    deadline = time.monotonic() + timeout_s
    read = []
    for line in process.stdout:
        read.append(line)
        if text in line:
            return read
        if time.monotonic() > deadline:
            break
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail(f"never saw {text!r}")


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    children = [int(p) for p in out.split()]
    return children + [d for child in children for d in descendants(child)]


def rank_pids(launcher_pid: int) -> list[int]:
    """The launcher's rank processes, in rank order: its descendants whose process name (what
    ``ps -o comm`` shows) each rank sets to ``ps_bench rN``."""
    ranks = {}
    for pid in descendants(launcher_pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except FileNotFoundError:
            continue
        if name.startswith("ps_bench r"):
            ranks[int(name.removeprefix("ps_bench r"))] = pid
    return [ranks[rank] for rank in sorted(ranks)]


def ranks_running() -> set[int]:
    """Every process on this machine named as a rank (``ps_bench rN``)."""
    pids = set()
    for comm in Path("/proc").glob("[0-9]*/comm"):
        try:
            if comm.read_text().startswith("ps_bench r"):
                pids.add(int(comm.parent.name))
        except OSError:
            continue
    return pids


def listening_sockets(pids: list[int]) -> dict[int, list[str]]:
    """pid -> the TCP addresses ("127.0.0.1:41234", "[::]:29500") each of ``pids`` listens on,
    from /proc: the socket inodes of its open files, matched against /proc/net/tcp and tcp6."""
    listening: dict[int, str] = {}  # inode -> address
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            host, port = fields[1].split(":")
            raw = bytes.fromhex(host)
            # the kernel prints each 32-bit word of the address in host (little-endian) order
            ordered = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(ordered)
            shown = f"[{address}]" if width == 32 else str(address)
            listening[int(fields[9])] = f"{shown}:{int(port, 16)}"
    out: dict[int, list[str]] = {}
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except (FileNotFoundError, ProcessLookupError):
            continue
        inodes = [int(link[8:-1]) for link in links if link.startswith("socket:[")]
        out[pid] = sorted(listening[inode] for inode in inodes if inode in listening)
    return out


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return ipaddress.ip_address(host).is_loopback


@contextlib.contextmanager
def small_file_system(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` as a file system of ``size`` (tmpfs: ``8k``, whole pages) while the block runs,
    for what a full disk does to a run; the test is skipped where mounting is not allowed."""
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small file system needs root (and mount)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
