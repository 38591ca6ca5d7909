"""Watching a local job's ranks: the first that fails ends the job, named by role and rank
(the earliest cause first), every other rank is stopped (SIGTERM, then SIGKILL), and a job that
outlives its watchdog gives every rank's Python stacks (faulthandler, on SIGUSR1) before it ends."""

from __future__ import annotations

import faulthandler
import math
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Collection, Protocol

from ps_bench.runtime import failures
from ps_bench.runtime.topology import Topology


class Job(Protocol):
    """What supervision needs of a job (``ps_bench.processes.launch.LaunchSpec`` has it)."""

    run_dir: str

    def topology(self) -> Topology: ...


GRACE_S = 2.0  # SIGTERM, then this long, then SIGKILL
SETTLE_S = 0.3  # after a failure, how long the ranks it took down get to report theirs
LEAVE_S = 2.0  # how long the trainers a job went on without get to end after it
RESTARTS_MOST = 8  # the failed ranks a job starts again at most (a rank that fails at once, again)
STACKS_WAIT_S = 5.0  # how long a rank asked for its stacks gets to write them


def stacks_file(run_dir: str, rank: int) -> Path:
    """Where a rank writes its Python stacks on SIGUSR1; it exists once the rank can do so."""
    return Path(run_dir) / f"stacks-rank{rank}.txt"


def listen_for_stack_requests(run_dir: str, rank: int) -> None:
    """From here on SIGUSR1 makes this rank write every thread's Python stack. The file gets
    its final name only once the handler is in place: until then SIGUSR1 would kill the rank,
    so the launcher asks only ranks whose file exists."""
    final = stacks_file(run_dir, rank)
    pending = final.with_suffix(".pending")
    stream = open(pending, "w")
    faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
    os.replace(pending, final)


class JobFailed(Exception):
    """The job ended badly; ``str()`` is one line, ``detail`` the traceback or stacks behind it."""

    def __init__(self, summary: str, detail: str = "") -> None:
        super().__init__(summary)
        self.detail = detail


def describe_failures(spec: Job, exit_codes: dict[int, int]) -> JobFailed:
    """Names the first failure: a process killed by a signal, else the earliest exception."""
    topology = spec.topology()
    records = failures.read_records(spec.run_dir)
    causes = []  # (order, rank, one line, detail)
    for rank, exitcode in exit_codes.items():
        who = topology.info(rank).describe()
        record = records.get(rank)
        # a death with no record of its own (a signal, an abrupt exit) comes before the errors
        # it caused in its peers
        if exitcode < 0:
            causes.append((0.0, rank, f"{who} was {ended_how(exitcode)}", ""))
        elif record is not None:
            error = record["error"].strip().splitlines()[0]
            causes.append((record["time"], rank, f"{who} failed: {error}", record["traceback"]))
        else:
            causes.append((0.0, rank, f"{who} exited with status {exitcode} "
                                      f"without an error of its own", ""))
    causes.sort(key=lambda cause: (cause[0], cause[1]))
    _, first_rank, summary, detail = causes[0]
    others = [topology.info(rank).name for _, rank, _, _ in causes[1:]]
    if others:
        summary += f"; then {', '.join(others)} ended too"
    return JobFailed(summary, detail)


def ended_how(exitcode: int) -> str:
    return (f"killed by {signal.Signals(-exitcode).name}" if exitcode < 0
            else f"exit status {exitcode}")


@dataclass
class Stacks:
    """What the ranks could tell when the watchdog fired: stacks, or why there are none."""

    text: str  # one block per rank: its stacks, or a line saying why it has none
    given: int
    total: int

    def summary(self) -> str:
        if self.given == self.total:
            return "every rank's Python stacks are above"
        if self.given == 0:
            return "no rank could give its Python stacks; a line above says why for each"
        return (f"the Python stacks of {self.given} of {self.total} ranks are above; a line says "
                f"why each of the others has none")


def dump_stacks(spec: Job, processes: list) -> Stacks:
    """Asks every rank that can answer for its Python stacks (faulthandler) and collects them;
    a rank that cannot (gone, or not yet past start-up) gets a line saying why."""
    topology = spec.topology()
    reasons: dict[int, str] = {}
    asked: list[int] = []
    for rank, process in enumerate(processes):
        if process.exitcode is not None:
            reasons[rank] = f"it had already ended ({ended_how(process.exitcode)})"
        elif not stacks_file(spec.run_dir, rank).exists():
            reasons[rank] = ("it was still starting (importing torch and ps_bench), "
                             "before it can give stacks")
        else:
            try:
                os.kill(process.pid, signal.SIGUSR1)
                asked.append(rank)
            except ProcessLookupError:
                reasons[rank] = "it ended as it was asked for them"
    deadline = time.monotonic() + STACKS_WAIT_S
    texts: dict[int, str] = {}
    while asked:
        for rank in list(asked):
            text = stacks_file(spec.run_dir, rank).read_text()
            if text.strip():
                texts[rank] = text
                asked.remove(rank)
        if not asked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    time.sleep(0.2)  # let the last writer finish its dump
    for rank in texts:
        texts[rank] = stacks_file(spec.run_dir, rank).read_text()
    for rank in asked:
        reasons[rank] = f"it was asked but wrote none within {STACKS_WAIT_S:g} s"
    parts = []
    for rank in range(len(processes)):
        who = topology.info(rank).describe()
        if rank in texts:
            parts.append(f"---- Python stacks of {who} ----\n{texts[rank].rstrip()}")
        else:
            parts.append(f"---- no Python stacks from {who}: {reasons[rank]}")
    return Stacks("\n".join(parts), len(texts), len(processes))


def terminate(processes: list) -> None:
    """SIGTERM, then SIGKILL after a grace period, for every process still alive."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()


def supervise(spec: Job, processes: list, watchdog: tuple[float, str] | None = None,
              tolerated: Collection[int] = (),
              restart: Callable[[int], Any] | None = None) -> None:
    """Returns when every rank exited 0 (those of ``tolerated`` may have failed: trainers the
    job goes on without); raises JobFailed otherwise, or when ``watchdog`` (seconds, the option
    that set them) runs out. ``restart(rank)``: a tolerated rank that failed while the job runs
    starts again in the process it returns (at most RESTARTS_MOST times a job). Waits on the
    ranks' sentinels: it wakes when one ends, not on a polling interval."""
    deadline = time.monotonic() + watchdog[0] if watchdog else None
    restarts = 0
    while True:
        codes = {rank: p.exitcode for rank, p in enumerate(processes)}
        running = any(code is None for rank, code in codes.items() if rank not in tolerated)
        for rank, code in codes.items():
            if (restart is not None and running and rank in tolerated and code not in (None, 0)
                    and restarts < RESTARTS_MOST):
                processes[rank], codes[rank] = restart(rank), None
                restarts += 1
        if any(code not in (None, 0) and rank not in tolerated for rank, code in codes.items()):
            time.sleep(SETTLE_S)
            codes = {rank: p.exitcode for rank, p in enumerate(processes)}
            terminate(processes)
            raise describe_failures(spec, {r: c for r, c in codes.items() if c not in (None, 0)})
        if all(code is not None for code in codes.values()):  # 0, or tolerated
            return
        if tolerated and all(codes[rank] == 0 for rank in codes if rank not in tolerated):
            # the job is done; a tolerated rank still running is stuck where it failed (a hang)
            deadline = min(deadline or math.inf, time.monotonic() + LEAVE_S)
            if time.monotonic() >= deadline:
                terminate(processes)
                return
        if deadline is not None and time.monotonic() > deadline:
            stacks = dump_stacks(spec, processes)
            terminate(processes)
            raise JobFailed(f"the job did not finish within {watchdog[1]} {watchdog[0]:g} s; "
                            f"{stacks.summary()}", stacks.text)
        # from the same reading as ``codes``: a rank that ends after it has a ready sentinel (a
        # second reading could find every rank ended, and wait on nothing until the deadline)
        waiting = [processes[rank].sentinel for rank, code in codes.items() if code is None]
        wait(waiting, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
