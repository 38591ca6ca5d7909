"""Writing results: one run's file (the ``ps_bench.result/1`` contract, docs/results.md), written
atomically and never over another; a sweep's lines (``results.jsonl``, one results object per
run of a point, appended); the configuration hash that tells a sweep's points apart and matches
them across sweeps. Reading them back is ``ps_bench.results.load``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ps_bench.config import RESULTS_SCHEMA
from ps_bench.places import why_not_written

RESULTS_NAME = "results.jsonl"  # a sweep's lines, in its --out folder
# Options a sweep sets itself, and options that change how a run reports, not what it measures.
NOT_HASHED = ("out", "dry_run", "per_rank", "debug", "verbose", "emulate_keep")


def iso_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def environment(backend: str) -> dict:
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "cuda_devices": ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                         if cuda else []),
        "backend": backend,
        "intra_op_threads": torch.get_num_threads(),
    }


def default_results_path(hook: str, num_trainers: int, num_servers: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{stamp}-{hook}-{num_trainers}t{num_servers}s.json"


def results_path(out: str | None, hook: str, num_trainers: int, num_servers: int) -> Path:
    """Where a run's results file goes: ``--out``, or a new name under ``results/``; where
    ``--out`` names a folder (one that exists, or a path ending in a separator), that new name
    inside it."""
    default = default_results_path(hook, num_trainers, num_servers)
    if not out:
        return default
    if out.endswith(("/", os.sep)) or Path(out).is_dir():
        return Path(out) / default.name
    return Path(out)


def strict(value: Any) -> Any:
    """``value`` with every float that is not finite (a diverged run's loss and parameter norm)
    as None: JSON has no NaN or infinity, and readers other than Python's refuse them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(item) for item in value]
    return value


def write_results(results: dict, path: str | os.PathLike) -> Path:
    """Writes atomically and never overwrites: an existing name gets a numbered suffix.

    The content goes to a temporary file in the target folder, which is then hard-linked
    under the first free name (link fails rather than replace), so a reader never sees a
    half-written file and two runs never take the same name.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=target.parent)
    try:
        os.fchmod(handle, 0o666 & ~umask())  # as any file the user writes, not mkstemp's 0600
        with os.fdopen(handle, "w") as stream:
            json.dump(strict(results), stream, indent=2, allow_nan=False)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        for attempt in range(10_000):
            candidate = (target if attempt == 0
                         else target.with_name(f"{target.stem}-{attempt}{target.suffix}"))
            try:
                os.link(temporary, candidate)
                return candidate
            except FileExistsError:
                continue
        raise FileExistsError(f"no free name next to {target}")
    finally:
        os.unlink(temporary)


def umask() -> int:
    """The process's file-creation mask, read without setting it where Linux tells it (setting
    it, even back, would race any thread creating a file meanwhile)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def kept_path(path: str | os.PathLike) -> Path:
    """Where ``keep_results`` puts results that ``path`` could not take: its name under
    ``ps_bench/`` in the system's temporary folder."""
    return Path(tempfile.gettempdir()) / "ps_bench" / Path(path).name


def kept_since(path: str | os.PathLike, since: float) -> Path | None:
    """The newest file ``keep_results`` wrote at or after ``since`` (epoch seconds) for results
    that ``path`` could not take (``kept_path``, or its name with a number where that was taken)."""
    kept = kept_path(path)
    found = [(where.stat().st_mtime, where)
             for where in [kept, *kept.parent.glob(f"{kept.stem}-*{kept.suffix}")]
             if where.exists() and where.stat().st_mtime >= since]
    return max(found)[1] if found else None


def keep_results(results: dict, path: str | os.PathLike) -> Path | None:
    """``write_results`` at ``path``, or where that cannot be written (checked before the run
    began, but a disk fills, a quota runs out, a folder goes) at ``kept_path(path)``, saying on
    stderr why; None where neither can be."""
    for where in (Path(path), kept_path(path)):
        try:
            return write_results(results, where)
        except OSError as error:
            print(f"ps_bench: warning: the results could not be written to {where}: "
                  f"{why_not_written(error)}", file=sys.stderr, flush=True)
    return None


def append_line(path: Path, entry: dict) -> None:
    """One results object as a line of ``path``, flushed to disk. A line torn by a writer that
    was killed stays a line of its own (the reader skips it): the new one starts on a fresh line."""
    with open(path, "ab+") as stream:
        stream.seek(0, os.SEEK_END)
        if stream.tell():
            stream.seek(-1, os.SEEK_END)
            torn = stream.read(1) != b"\n"
        else:
            torn = False
        stream.write((("\n" if torn else "") + json.dumps(strict(entry), allow_nan=False)
                      + "\n").encode())
        stream.flush()
        os.fsync(stream.fileno())


def config_hash(resolved: dict[str, Any]) -> str:
    """A hash of what a run measures: every resolved option (canonical names) and the model and
    data entries they name, less ``NOT_HASHED``."""
    payload = {k: v for k, v in resolved.items() if k not in NOT_HASHED}
    return hashlib.sha256(
        json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


SNAPSHOT_NAME = "partial.json"  # in the run folder: the finished rounds of a running job


def failed_results(results: dict | None, error: str, *, config: dict,
                   argv: list[str] | None = None, env: dict | None = None) -> dict:
    """``results`` (what finished, or None when nothing did) marked failed with ``error``. With
    nothing finished, the contract's identifying keys are kept and nothing is measured:
    ``rounds_completed`` 0, an empty ``summary``."""
    if results is None:
        results = {"schema": RESULTS_SCHEMA, "started": iso_now(), "argv": argv or [],
                   "config": config, "env": env or {}, "rounds_completed": 0, "summary": []}
    return {**results, "status": "failed", "error": error, "finished": iso_now()}


def write_snapshot(results: dict, run_dir: str | os.PathLike) -> None:
    """What has finished so far, for the launcher to keep if the job fails later."""
    path = Path(run_dir) / SNAPSHOT_NAME
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(results))
    os.replace(temporary, path)


def read_snapshot(run_dir: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(run_dir) / SNAPSHOT_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None
