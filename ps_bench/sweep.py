"""``bench.py sweep FILE --out DIR``: many runs from one JSON file, each in its own process tree.

A sweep file is ``{"name": ..., "base": {options}, "grid": {option: [values]}, "variants":
[{"name": ..., option: value}], "repeat": N}``. Its points are the cartesian product of ``grid``
(times each variant when both are given); a point is ``base`` plus its overrides, run ``repeat``
times (default 1; the repeats take turns, point after point, so a drifting machine touches every
point alike). Every point is validated before anything runs. The sweep is every point's
launcher: it starts the preloaded forkserver once (``ps_bench.runtime.preload``), and each point's
ranks are new processes forked from it, so no point pays for importing torch and a crash or hang of
one point's ranks ends only that point (its ranks are stopped, what finished is kept, the next
point starts afresh). One JSON line per run of a point (the full results object plus ``point``:
name, overrides, configuration hash and which repeat) is appended to ``DIR/results.jsonl``;
each point's output (its run file, ``POINT.config.json``, reruns it alone with ``bench.py
--config``) goes to its log in ``DIR/logs/``.
"""

from __future__ import annotations

import argparse
import itertools
import fcntl
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any

from tabulate import tabulate

from ps_bench.config import RESULTS_SCHEMA, ConfigError, RunConfig, read_json
from ps_bench.runfiles import build_config, is_run_options, option_values
from ps_bench.job import validate
from ps_bench.options import plural, typed
from ps_bench.places import check_writable_folder, why_not_written
from ps_bench.registry import did_you_mean
from ps_bench.results.files import RESULTS_NAME, append_line, config_hash
from ps_bench.results.load import diverged, load_lines
from ps_bench.runtime import preload
from ps_bench.runtime.failures import raise_terminated
from ps_bench.points import Interrupted, Point, run_point, split_restarts

DESCRIPTION = (
    "Run every point of a sweep file, each in its own process tree, appending one JSON line per "
    "point to OUT/results.jsonl (logs in OUT/logs/). A sweep file is {\"name\": ..., "
    "\"base\": {options}, \"grid\": {option: [values]}, "
    "\"variants\": [{\"name\": ..., option: value}]}: the points are the "
    "cartesian product of grid (times each variant), each base plus its overrides; "
    "\"repeat\": N runs each point N times, every run recorded (bench.py compare reads them all); "
    "\"max_restarts\": N in base or a variant runs those points under torchrun, which restarts "
    "each up to N times.")
EPILOG = (
    "examples:\n"
    "  python bench.py sweep configs/sweeps/hooks.json --out results/hooks --dry-run"
    "   # its points; none run\n"
    "  python bench.py sweep configs/sweeps/hooks.json --out results/hooks "
    "&& python bench.py report results/hooks\n")

SWEEP_KEYS = ("name", "base", "grid", "variants", "repeat")
LOCK_NAME = "sweep.lock"  # held by the sweep running into the folder (hold_folder)


def run_options(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Checks keys and types of a block of run options; returns them under canonical names."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a JSON object of run options")
    return option_values(values, where, refused={
        "out": "'out' is set by the sweep (each point writes into the sweep's folder)",
        "dry_run": "'dry_run' would run no point (bench.py sweep --dry-run lists them)"})


def describe(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, dict) else v}"
                    for k, v in overrides.items()) or "base"


def load_sweep(path: str, machine: bool = True) -> tuple[str, list[Point]]:
    """Reads and expands a sweep file; every point is validated (ConfigError names the point),
    with ``machine=False`` as on a machine that can run it (root and tc for emulated links)."""
    raw = read_json(path, "sweep file")
    if not isinstance(raw, dict):
        raise ConfigError(f"sweep file {path!r} must hold a JSON object")
    if raw.get("schema") == RESULTS_SCHEMA:
        raise ConfigError(f"{path!r} is a results file: make its run again with bench.py --config "
                          f"{path}")
    if is_run_options(raw):
        raise ConfigError(f"{path!r} is a run config: run it with bench.py --config {path}, or "
                          f"give its options as a sweep's base")
    for key in raw:
        if key not in SWEEP_KEYS:
            raise ConfigError(f"sweep file {path!r}: unknown key {key!r}; "
                              f"{did_you_mean(key, SWEEP_KEYS)}valid keys: {', '.join(SWEEP_KEYS)}")
    name = raw.get("name", Path(path).stem)
    base, base_restarts = split_restarts(raw.get("base", {}), f"sweep {path!r}: base")
    base = run_options(base, f"sweep {path!r}: base")
    grid_raw = raw.get("grid", {})
    if not isinstance(grid_raw, dict):
        raise ConfigError(f"sweep {path!r}: grid must be an object of option: [values]")
    grid: dict[str, list] = {}
    for key, values in grid_raw.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep {path!r}: grid option {key!r} needs a non-empty list "
                              f"of values")
        checked = [run_options({key: v}, f"sweep {path!r}: grid") for v in values]
        grid[next(iter(checked[0]))] = [next(iter(c.values())) for c in checked]
    variants_raw = raw.get("variants", [])
    if not isinstance(variants_raw, list):
        raise ConfigError(f"sweep {path!r}: variants must be a list of objects")
    variants = []
    for number, variant in enumerate(variants_raw, start=1):
        if not isinstance(variant, dict):
            raise ConfigError(f"sweep {path!r}: variant {number} must be an object")
        label = variant.get("name", f"variant{number}")
        if label in [named for named, _, _ in variants]:
            raise ConfigError(f"sweep {path!r}: two variants are named {label!r}: the report "
                              f"could not tell their points apart")
        where = f"sweep {path!r}: variant {label!r}"
        variant, restarts = split_restarts(variant, where)
        options = run_options({k: v for k, v in variant.items() if k != "name"}, where)
        clash = set(options) & set(grid)
        if clash:
            raise ConfigError(f"sweep {path!r}: variant {label!r} sets {', '.join(sorted(clash))}, "
                              f"which the grid varies")
        variants.append((label, options, base_restarts if restarts is None else restarts))
    if not grid and not variants:
        raise ConfigError(f"sweep {path!r} has no points: give a grid, variants, or both")
    repeats = raw.get("repeat", 1)
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ConfigError(f"sweep {path!r}: repeat must be a whole number of runs per point, "
                          f"at least 1; got {json.dumps(repeats)}")
    combos = ([dict(zip(grid, values)) for values in itertools.product(*grid.values())] if grid
              else [{}])
    points = []
    for variant_label, variant_options, restarts in variants or [(None, {}, base_restarts)]:
        for combo in combos:
            overrides = {**({"variant": variant_label} if variant_label else {}), **combo}
            options = {**base, **variant_options, **combo}
            index = len(points) + 1
            label = " ".join(filter(None, [variant_label, describe(combo) if combo else ""]))
            try:
                job = validate(build_config(options), machine=machine)
            except ConfigError as error:
                raise ConfigError(f"sweep {path!r}: point {index} ({label}): {error}") from None
            resolved = {**job.config.to_dict(), "model_config": job.model.to_dict(),
                        "data_config": job.data.to_dict()}
            hashed = config_hash(resolved)
            twin = next((p for p in points if p.config_hash == hashed), None)
            if twin is not None:
                raise ConfigError(f"sweep {path!r}: points {twin.index} ({twin.name}) and {index} "
                                  f"({label}) are the same run: list each once (\"repeat\": N "
                                  f"runs every point N times)")
            points.append(Point(index, label, {**overrides, **variant_options}, options,
                                hashed, resolved, job, repeats, restarts))
    return name, points


def plan_table(runs: list[tuple[Point, int]], done: set[tuple[str, int]]) -> str:
    """``--dry-run``'s table: each run of each point, its processes, and whether it is ``done``
    (its configuration hash and repeat recorded ok) or to run."""
    repeated = runs[0][0].repeats > 1
    return tabulate([[point.index, point.name, *([repeat] if repeated else []),
                      processes(point.job.config),
                      "done" if (point.config_hash, repeat) in done else "to run"]
                     for point, repeat in runs],
                    headers=["point", "options", *(["run"] if repeated else []), "processes",
                             "state"])


def processes(cfg: RunConfig) -> str:
    """``4: 2 trainers, 1 server, 1 master`` for a point's job."""
    trainers, servers = cfg.ntrainer + cfg.ncudatrainer, cfg.nserver + cfg.ncudaserver
    return (f"{cfg.world_size}: {plural(trainers, 'trainer')}, {plural(servers, 'server')}, "
            f"1 master")


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="sweep file (JSON)")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for results.jsonl, logs and point files")
    parser.add_argument("--resume", action="store_true",
                        help="skip points already recorded ok in OUT "
                             "(same resolved configuration); re-run the rest")
    parser.add_argument("--point-timeout", type=typed(float, "point-timeout"), default=900.0,
                        metavar="SECONDS",
                        help="stop a point that runs longer than this and record it as failed "
                             "(default: 900)")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the points (their options and processes, and with --resume "
                             "which are done) and run none; creates nothing")


def check(args: argparse.Namespace, bench_argv: list[str]) -> None:
    """The sweep file, every point of it validated (as on a machine that can run it), and a
    folder for its results."""
    check_point_timeout(args.point_timeout)
    load_sweep(args.file, machine=False)
    check_writable_folder(args.out, "--out")


def check_point_timeout(seconds: float) -> None:
    if not 0 < seconds < math.inf:
        raise ConfigError(f"--point-timeout must be a positive number of seconds; got {seconds:g}")


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    check_point_timeout(args.point_timeout)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_terminated)
    return run_sweep(args.file, args.out, args.resume, args.point_timeout, debug=args.debug,
                     dry_run=args.dry_run)


def hold_folder(out: str) -> IO[str]:
    """The sweep's hold on its folder (``points/`` and ``logs/`` made first): an exclusive lock
    on ``OUT/sweep.lock`` for as long as the returned file is open, dropped by the kernel however
    the sweep ends. A second sweep into a folder held is refused: it would run again every point
    the first has not recorded yet, beside it, on the same cores."""
    try:
        for folder in ("points", "logs"):
            (Path(out) / folder).mkdir(parents=True, exist_ok=True)
        hold = open(Path(out) / LOCK_NAME, "a+")
    except OSError as error:
        raise ConfigError(f"--out {out}: {why_not_written(error)}") from None
    try:
        fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        hold.seek(0)
        holder = hold.read().strip() or "a process on this machine"
        hold.close()
        raise ConfigError(f"--out {out}: another sweep is running into it ({holder}); wait for it "
                          f"to end, or choose another --out") from None
    except OSError:  # a file system without locks: the sweep runs, unguarded
        return hold
    hold.truncate(0)
    hold.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}")
    hold.flush()
    return hold


def run_sweep(path: str, out: str, resume: bool, timeout_s: float | None,
              debug: bool = False, dry_run: bool = False) -> int:
    name, points = load_sweep(path)
    check_writable_folder(out, "--out")
    hold = None if dry_run else hold_folder(out)  # before the results are read
    try:
        return sweep_points(name, points, out, resume, timeout_s, debug, dry_run)
    finally:
        if hold is not None:
            hold.close()


def sweep_points(name: str, points: list[Point], out: str, resume: bool,
                 timeout_s: float | None, debug: bool, dry_run: bool) -> int:
    out_dir = Path(out)
    results_path = out_dir / RESULTS_NAME
    done = {(line["point"]["hash"], line["point"].get("repeat", 1))
            for line in load_lines(results_path)
            if line.get("status") == "ok" and "point" in line} if resume else set()
    if not resume and results_path.exists() and results_path.stat().st_size:
        raise ConfigError(f"{results_path} already holds results: add --resume to continue "
                          f"that sweep, or choose another --out")
    repeats = points[0].repeats
    # repeat after repeat, each of every point: a machine that drifts during the sweep touches every
    # point alike
    runs = [(point, repeat) for repeat in range(1, repeats + 1) for point in points]
    todo = [(point, repeat) for point, repeat in runs if (point.config_hash, repeat) not in done]
    each = f" x {repeats} runs each" if repeats > 1 else ""
    finished = plural(len(runs) - len(todo), "run") if each else len(runs) - len(todo)
    print(f"sweep {name}: {plural(len(points), 'point')}{each}, {finished} already done, "
          f"{len(todo)} to run; results in {results_path}", flush=True)
    if dry_run:
        print(plan_table(runs, done))
        return 0
    if todo:
        preload.start(debug, models=[point.job.config.model for point, _ in todo])
    try:
        return run_points(name, points, todo, out_dir, timeout_s)
    finally:
        preload.stop()


def run_points(name: str, points: list[Point], todo: list[tuple[Point, int]], out_dir: Path,
               timeout_s: float | None) -> int:
    """Runs the (point, repeat) pairs not done yet, one after the other; returns the sweep's exit
    status."""
    results_path = out_dir / RESULTS_NAME
    failed = 0
    started = time.monotonic()
    unit = "point" if points[0].repeats == 1 else "run"
    for number, (point, repeat) in enumerate(todo, start=1):
        point_start = time.monotonic()
        which = f"{point.name} run {repeat}/{point.repeats}" if point.repeats > 1 else point.name
        kept = (f"{plural(number - 1, unit)} of this run {'is' if number == 2 else 'are'} in "
                f"{results_path}; --resume continues")
        try:
            results = run_point(point, out_dir, timeout_s)
            results["point"] = {"index": point.index, "name": point.name,
                                "overrides": point.overrides, "hash": point.config_hash,
                                "sweep": name, "repeat": repeat}
            append_line(results_path, results)
        except Interrupted as stopped:
            print(f"sweep stopped at point {point.index} ({which}); {kept}", file=sys.stderr,
                  flush=True)
            return stopped.exit_code
        except OSError as error:  # the sweep's own files: a disk or a quota filled, a folder went
            print(f"ps_bench: error: sweep stopped at point {point.index} ({which}): "
                  f"{error.filename or out_dir}: {why_not_written(error)}; {kept}",
                  file=sys.stderr, flush=True)
            return 1
        elapsed = time.monotonic() - point_start
        status = results.get("status", "failed")
        failed += status != "ok"
        mean = (time.monotonic() - started) / number
        if status != "ok":
            detail = f"FAILED: {str(results.get('error', '')).splitlines()[0][:160]}"
        else:
            detail = "ok, diverged (parameters not finite)" if diverged(results) else "ok"
        print(f"[{point.index}/{len(points)}] {which}  {elapsed:.1f} s  {detail}  "
              f"(elapsed {duration(time.monotonic() - started)}, "
              f"~{duration(mean * (len(todo) - number))} left)",
              flush=True)
    print(f"sweep {name}: ran {plural(len(todo), unit)}: {len(todo) - failed} ok, {failed} failed; "
          f"`bench.py report {out_dir}` compares them"
          f"{f', `bench.py compare` two such folders' if points[0].repeats > 1 else ''}",
          flush=True)
    return 1 if failed else 0
