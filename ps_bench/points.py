"""One point of a sweep, run: its ranks forked from the sweep's preloaded forkserver (``spawn``),
or, for a point that gives ``max_restarts``, under torchrun (``--standalone``, that many restarts),
which restarts the job as it would any job of the user's: the point's failures drawn by
``--mtbf`` and its restarts from its checkpoints are measured as a torchrun job has them."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_bench.config import ConfigError
from ps_bench.job import Job, cuda_device_count
from ps_bench.processes.launch import JobFailed, LaunchSpec, spawn
from ps_bench.results.files import environment, failed_results, iso_now, kept_since
from ps_bench.results.load import load_file
from ps_bench.runtime.failures import Terminated


@dataclass
class Point:
    index: int  # from 1
    name: str
    overrides: dict[str, Any]
    options: dict[str, Any]  # base plus overrides, as a run JSON
    config_hash: str
    resolved: dict[str, Any]
    job: Job  # validated
    repeats: int = 1  # how many times the sweep runs it, each run a line of its own
    max_restarts: int | None = None  # run under torchrun with that many restarts


RESTARTS_KEY = "max_restarts"  # a sweep point's: run it under torchrun with that many restarts


def split_restarts(values: Any, where: str) -> tuple[Any, int | None]:
    """A block of a sweep file's options without ``max_restarts``, and its value (None: not
    given); ConfigError for one that is not a whole number, 0 or more."""
    if not isinstance(values, dict) or RESTARTS_KEY not in values:
        return values, None
    restarts = values[RESTARTS_KEY]
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
        raise ConfigError(f"{where}: {RESTARTS_KEY} runs the point under torchrun with that many "
                          f"restarts: a whole number, 0 or more; got {json.dumps(restarts)}")
    return {k: v for k, v in values.items() if k != RESTARTS_KEY}, restarts


class Interrupted(Exception):
    """The sweep was stopped by a signal; ``exit_code`` is 130 or 143."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


def run_point(point: Point, out_dir: Path, timeout_s: float | None) -> dict:
    """Runs one point's job, its output to the point's log; returns its results (a failed stub
    if it wrote none). Raises Interrupted on Ctrl-C or SIGTERM, once its ranks are stopped."""
    stem = f"{point.index:03d}-{point.config_hash}"
    attempt = 1
    while (out_dir / "points" / f"{stem}-{attempt}.json").exists():
        attempt += 1
    config_file = out_dir / "points" / f"{stem}.config.json"
    config_file.write_text(json.dumps(point.options, indent=2))
    results_file = out_dir / "points" / f"{stem}-{attempt}.json"
    log_file = out_dir / "logs" / f"{stem}.log"
    argv = ["bench.py", "--config", str(config_file), "--out", str(results_file)]
    cfg = dataclasses.replace(point.job.config, out=str(results_file))
    started = time.time()
    spec = LaunchSpec(dataclasses.replace(point.job, config=cfg), argv, "", str(results_file),
                      cfg.world_size, cuda_device_count(),
                      launched_at=started, milestones={"imported": started, "validated": started},
                      log_path=str(log_file))
    error = None
    with open(log_file, "a") as log, redirect_stdout(log), redirect_stderr(log):
        print(f"==== {iso_now()} attempt {attempt}: {' '.join(argv)}", flush=True)
        for note in point.job.notes:
            print(f"ps_bench: note: {note}", flush=True)
        try:
            if point.max_restarts is not None:
                error = under_torchrun(point, config_file, results_file, log, timeout_s)
            else:
                spawn(spec, watchdog=(timeout_s, "--point-timeout") if timeout_s else None)
        except (JobFailed, ConfigError) as failure:
            error = str(failure)
            if isinstance(failure, JobFailed) and failure.detail:
                print(failure.detail.rstrip())
            print(f"ps_bench: error: {failure}", flush=True)
        except KeyboardInterrupt:
            raise Interrupted(130) from None
        except Terminated:
            raise Interrupted(143) from None
    if results_file.exists():
        return load_file(results_file)
    kept = kept_since(results_file, started)  # its folder could not take them: a disk filled
    if kept:
        print(f"ps_bench: warning: point {point.index}'s results could not be written to "
              f"{results_file}; they are in {kept}", file=sys.stderr, flush=True)
        return load_file(kept)
    return failed_results(None, error or f"the point wrote no results; see {log_file}",
                          config=point.resolved, argv=argv, env=environment(cfg.backend))


def under_torchrun(point: Point, config_file: Path, results_file: Path, log,
                   timeout_s: float | None) -> str | None:
    """Runs the point under torchrun (``--standalone``, ``max_restarts`` restarts), its output to
    ``log``; why it failed, or None. Stopped with its whole process group past ``timeout_s`` or
    on Ctrl-C and SIGTERM, which are raised again."""
    cfg = point.job.config
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(cfg.world_size), "--max-restarts", str(point.max_restarts), "-m", "ps_bench",
               "--config", str(config_file), "--out", str(results_file)]
    print(f"ps_bench: under torchrun: {' '.join(command[1:])}", flush=True)
    process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(process)
        return f"the point did not finish within --point-timeout {timeout_s:g} s"
    except BaseException:
        stop(process)
        raise
    return None if code == 0 else f"torchrun ended with status {code}"


def stop(process: subprocess.Popen) -> None:
    """torchrun and every process it started: SIGTERM, then SIGKILL."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sent)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue
