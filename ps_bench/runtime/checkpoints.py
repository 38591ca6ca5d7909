"""Where a run's checkpoints live and which one a run resumes from (``--checkpoint-every N``,
``--checkpoint-dir DIR``); the trainers write them (``strategies.checkpoints``, each strategy's
``Synchroniser``).

A checkpoint is a folder ``step-NNNNNNNN`` (the iteration it was taken after) holding what the
strategy's engine wrote (``torch.distributed.checkpoint``'s files, or DeepSpeed's), and last of
all ``ps_bench.json``, its manifest: a folder without one was being written when its run
stopped, and is never read. The manifest names the run's options that shape its training
(``TRAJECTORY``): a run resumes only from a checkpoint of the same training, and refuses
another's in one line. A run that finishes writes ``finished.json``; a run started again on a
finished folder starts over (its old checkpoints removed, said in a line), and a run started
again on an unfinished one resumes from its newest complete checkpoint. Without
``--checkpoint-dir`` the folder is ``checkpoints/HOOK-Nt-HASH`` from the working directory,
HASH of the training options: the same command line, started again (by torchrun or by hand),
finds its own checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_bench.config import ConfigError, RunConfig, need
from ps_bench.places import check_writable_folder

MANIFEST, FINISHED = "ps_bench.json", "finished.json"
SCHEMA = "ps_bench.checkpoint/1"
STEP_PREFIX = "step-"
KEPT = 2  # complete checkpoints kept: the newest, and the one before while it is written
# the options that shape a run's training: a checkpoint resumes a run only where they agree
TRAJECTORY = ("model", "model_options", "data", "labels", "hook", "hook_options", "ds_config",
              "ntrainer", "ncudatrainer", "nserver", "ncudaserver", "mapping", "per_host",
              "epochs", "batch_size", "grad_accum", "precision", "reduce_dtype", "lr", "optimizer",
              "momentum", "weight_decay", "warmup_rounds", "rounds", "target_loss",
              "max_iterations", "bucket_cap_mb", "gradient_as_bucket_view", "torch_seed",
              "cuda_seed", "backend", "checkpoint_every")


@dataclass(frozen=True)
class Plan:
    """A run's checkpoints: its folder, every how many iterations, saved in the background or
    not, and the newest complete checkpoint found there when the run was validated (its
    manifest; None: the run starts from its first iteration), or that it found a finished run's
    there."""

    folder: str
    every: int
    asynchronous: bool
    resume: dict | None = None
    # the folder holds a finished run's checkpoints: this run starts over, and removes them
    start_over: bool = False


def trajectory(cfg: RunConfig) -> dict[str, Any]:
    """The run's options that shape its training."""
    return {name: getattr(cfg, name) for name in TRAJECTORY}


def default_folder(cfg: RunConfig) -> str:
    """``checkpoints/HOOK-Nt-HASH``: the same training options, the same folder."""
    digest = hashlib.sha256(json.dumps(trajectory(cfg), sort_keys=True, default=str).encode())
    return str(Path("checkpoints") / f"{cfg.hook}-{cfg.num_trainers}t-{digest.hexdigest()[:10]}")


def step_folder(folder: str | os.PathLike, iteration: int) -> Path:
    return Path(folder) / f"{STEP_PREFIX}{iteration:08d}"


def steps(folder: str | os.PathLike) -> list[Path]:
    """The checkpoint folders in ``folder``, complete or not, oldest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    return sorted(path for path in root.iterdir()
                  if path.is_dir() and path.name.startswith(STEP_PREFIX)
                  and path.name[len(STEP_PREFIX):].isdigit())


def read_manifest(step: Path) -> dict | None:
    """A complete checkpoint's manifest, with its folder as ``path``; None for one half written."""
    try:
        manifest = json.loads((step / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        return None
    return {**manifest, "path": str(step)}


def newest(folder: str | os.PathLike) -> dict | None:
    """The manifest of the newest complete checkpoint in ``folder`` (None: there is none)."""
    for step in reversed(steps(folder)):
        manifest = read_manifest(step)
        if manifest is not None:
            return manifest
    return None


def finished(folder: str | os.PathLike) -> bool:
    return (Path(folder) / FINISHED).is_file()


def write_json(path: Path, content: dict) -> None:
    """Written whole or not at all: to a temporary name, then renamed."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(content, indent=2) + "\n")
    os.replace(temporary, path)


def commit(step: Path, cfg: RunConfig, iteration: int, extra: dict) -> None:
    """Makes ``step`` a complete checkpoint: its manifest, written last; then drops the complete
    checkpoints older than the ``KEPT`` newest, and any half written below this one."""
    write_json(step / MANIFEST, {"schema": SCHEMA, "iteration": iteration,
                                 "trajectory": trajectory(cfg), **extra})
    complete = [path for path in steps(step.parent) if read_manifest(path) is not None]
    for path in steps(step.parent):
        older = int(path.name[len(STEP_PREFIX):]) < iteration
        if older and (path not in complete or path in complete[:-KEPT]):
            shutil.rmtree(path, ignore_errors=True)


def mark_finished(folder: str | os.PathLike, iteration: int) -> None:
    write_json(Path(folder) / FINISHED, {"schema": SCHEMA, "iteration": iteration})


def start_over(folder: str | os.PathLike) -> None:
    """A finished run's folder, started again: its checkpoints removed, so that none of them is
    taken for this run's."""
    for path in steps(folder):
        shutil.rmtree(path, ignore_errors=True)
    (Path(folder) / FINISHED).unlink(missing_ok=True)


def differences(saved: dict, current: dict) -> list[str]:
    """The training options a checkpoint's run and this one set apart, as flags."""
    return [f"--{name.replace('_', '-')} {json.dumps(saved.get(name))} there, "
            f"{json.dumps(value)} here"
            for name, value in current.items() if saved.get(name) != value]


def plan(cfg: RunConfig, refused: str | None) -> Plan | None:
    """``--checkpoint-every`` and ``--checkpoint-dir`` checked: the interval, the strategy
    (``refused``: why it cannot restart from a checkpoint, None where it can), the folder
    writable, and the newest complete checkpoint there of this very training (another run's is
    refused); None without checkpoints."""
    if cfg.checkpoint_every is None:
        need(cfg.checkpoint_dir is None and not cfg.checkpoint_async,
             "--checkpoint-dir and --checkpoint-async go with --checkpoint-every N")
        return None
    need(cfg.checkpoint_every >= 1,
         f"--checkpoint-every must be at least 1 (iterations); got {cfg.checkpoint_every}")
    need(refused is None, f"--checkpoint-every with --hook {cfg.hook}: {refused}")
    need(cfg.target_loss is None, "--checkpoint-every with --target-loss: a resumed run's loss "
                                  "curve and its time to the target are not carried over yet")
    folder = cfg.checkpoint_dir or default_folder(cfg)
    need(folder.strip() != "", "--checkpoint-dir: give a folder, e.g. checkpoints/run1")
    check_writable_folder(folder, "--checkpoint-dir")
    manifest = newest(folder)
    if manifest is not None:
        apart = differences(manifest.get("trajectory", {}), trajectory(cfg))
        if apart:
            raise ConfigError(f"--checkpoint-dir {folder!r} holds a checkpoint of another run "
                              f"({'; '.join(apart)}): give another folder, or remove it")
    done = finished(folder)
    return Plan(folder, cfg.checkpoint_every, cfg.checkpoint_async, None if done else manifest,
                done)
