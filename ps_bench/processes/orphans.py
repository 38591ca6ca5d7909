"""Run folders whose launcher was killed outright (SIGKILL: the OOM killer, a scheduler's hard
stop), where nothing could write the failed run's results. A launcher holds a lock in its run
folder while it lives (the kernel lets go of it when the process dies, however it dies); the
next launch on the machine writes the finished rounds such a folder holds as that run's results
file, where that run would have written it, and removes the folder."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
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
