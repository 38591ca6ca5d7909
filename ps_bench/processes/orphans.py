"""Run folders whose launcher was killed outright (SIGKILL: the OOM killer, a scheduler's hard
stop), where nothing could write the failed run's results. A launcher holds a lock in its run
folder while it lives (the kernel lets go of it when the process dies, however it dies); the
next launch on the machine writes the finished rounds such a folder holds as that run's results
file, where that run would have written it, and removes the folder. And a rank never outlives
its launcher (``die_with``)."""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import IO

from ps_bench.results.files import failed_results, keep_results, read_snapshot

OWNER_NAME = "launcher.lock"  # in the run folder: locked by its launcher, {"pid", "results_path"}
KILLED = ("its launcher was killed outright (SIGKILL: the OOM killer, a scheduler's hard stop) "
          "before it wrote the results; the finished rounds kept by the next run on this machine")


def claim(run_dir: str, results_path: str) -> IO[str]:
    """Locks ``run_dir`` for this launcher's life; keep the returned file open until the folder
    is removed. The lock is taken before the file has its name, so no other launch ever sees the
    name unlocked while this one lives."""
    stream = open(Path(run_dir) / f".{OWNER_NAME}", "w")
    fcntl.flock(stream, fcntl.LOCK_EX)
    stream.write(json.dumps({"pid": os.getpid(), "results_path": os.path.abspath(results_path)}))
    stream.flush()
    os.replace(Path(run_dir) / f".{OWNER_NAME}", Path(run_dir) / OWNER_NAME)
    return stream


def recover(folder: str | None = None) -> list[Path]:
    """The results files written for the run folders in ``folder`` (the temporary folder) whose
    launchers are gone; each such run folder is removed, finished rounds or none."""
    kept = []
    for run_dir in sorted(Path(folder or tempfile.gettempdir()).glob("ps_bench-*")):
        try:
            if run_dir.stat().st_uid != os.getuid():  # another user's: theirs to recover
                continue
            stream = open(run_dir / OWNER_NAME)
        except OSError:  # not a launcher's, or one just starting, or removed by another launch
            continue
        with stream:
            try:
                fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its launcher lives (or another launch is recovering it)
                continue
            if not (run_dir / OWNER_NAME).exists():  # recovered by another launch meanwhile
                continue
            try:
                owner = json.loads(stream.read())
            except json.JSONDecodeError:
                owner = {}
            snapshot = read_snapshot(run_dir)
            if snapshot is not None and owner.get("results_path"):
                path = keep_results(failed_results(snapshot, KILLED, config=snapshot.get(
                    "config", {})), owner["results_path"])
                if path is not None:
                    kept.append(path)
            shutil.rmtree(run_dir, ignore_errors=True)
    return kept


PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1


def prctl(option: int, value: int | bytes) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):  # not Linux: the launcher's terminate() is what remains
        pass


def die_with(launcher_pid: int) -> None:
    """This rank ends when its parent (the forkserver) ends, by the kernel's parent-death
    signal, and when the launcher ends, even by SIGKILL: a thread blocks on the launcher's
    pidfd, which becomes readable when it exits."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # already gone
        os._exit(1)
    except (OSError, AttributeError):  # no pidfd here (not Linux 5.3+)
        return

    def watch() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
