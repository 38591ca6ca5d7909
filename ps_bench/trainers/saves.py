"""A trainer's checkpoints (``--checkpoint-every``): every so many iterations its state is written
into the run's checkpoint folder (``runtime.checkpoints``), as its strategy's engine writes it
(``strategies.checkpoints``), and trainer 0 commits each once every trainer's part is written;
a trainer built to resume reads the newest complete one back.

A save runs between two iterations, outside both clocks; what it held training is the round's
untimed time (``untimed_s``), as ``--verify``'s checks are, and is reported on its own. With
``--checkpoint-async`` it holds training only while the state is copied; the writing goes on
in the background on a process group of its own (gloo: its collectives must not interleave
with the training's), and the next save, or the end of training, waits for it to be committed.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ps_bench.config import RunConfig
from ps_bench.runtime import checkpoints
from ps_bench.strategies import checkpoints as engine_checkpoints


class Saves:
    """Trainer ``rank``'s checkpoints of a run configured by ``config`` under ``plan`` (None:
    the run takes none)."""

    def __init__(self, plan: checkpoints.Plan | None, config: RunConfig, rank: int,
                 device: torch.device, wire: Any) -> None:
        """``wire``: the trainer's byte counter, paused while a save's collectives run (they
        are no iteration's bytes)."""
        self.plan, self.config, self.rank, self.device, self.wire = (plan, config, rank, device,
                                                                     wire)
        self.every = plan.every if plan is not None else 0
        self.group = (dist.new_group(backend="gloo")
                      if plan is not None and plan.asynchronous else None)
        # a background save: (its writing, folder, iteration, seconds it held training)
        self.writing: tuple[Future, Path, int, float] | None = None
        self.taken: list[dict] = []  # the saves since the last take: iteration, held_s
        self.restore_s: float | None = None  # reading the checkpoint it resumed from
        self.reported = False
        if plan is not None and plan.start_over and rank == 0:  # before any trainer's first save
            checkpoints.start_over(plan.folder)

    def own(self, iteration: int) -> dict[str, Any]:
        """This trainer's own entry in a checkpoint: the iteration and its random number
        generators (the data's position follows from the iteration)."""
        return {"iteration": torch.tensor(iteration),
                "rng": engine_checkpoints.rng_state(self.device)}

    def save(self, synchroniser: Any, model: Any, optimizer: Any, iteration: int) -> float:
        """This iteration's state written (every trainer at once); the seconds it held training."""
        started = time.perf_counter()
        self.wire.paused = True
        try:
            self.settle()
            folder = checkpoints.step_folder(self.plan.folder, iteration)
            folder.mkdir(parents=True, exist_ok=True)
            held, writing = engine_checkpoints.save(synchroniser, model, optimizer, str(folder),
                                                    self.rank, self.own(iteration),
                                                    self.plan.asynchronous, self.group)
        finally:
            self.wire.paused = False
        nbytes = None
        if writing is None:
            nbytes = self.commit(folder, iteration, held)
        else:
            self.writing = (writing, folder, iteration, held)
        held = time.perf_counter() - started
        self.taken.append({"iteration": iteration, "held_s": held, "bytes": nbytes})
        return held

    def settle(self) -> None:
        """The save still writing in the background, waited for and committed."""
        if self.writing is not None:
            writing, folder, iteration, held = self.writing
            self.writing = None
            writing.result()
            self.commit(folder, iteration, held)

    def commit(self, folder: Path, iteration: int, held_s: float) -> int | None:
        """Trainer 0 writes the manifest once every trainer's part is in (DCP's save, and its
        background writing, end with every trainer's); returns the checkpoint's bytes (trainer
        0; None on the others)."""
        if self.rank != 0:
            return None
        nbytes = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
        checkpoints.commit(folder, self.config, iteration, {
            "saved": time.time(), "held_s": held_s, "background": self.plan.asynchronous,
            "trainers": self.config.num_trainers, "bytes": nbytes})
        return nbytes

    def restore(self, synchroniser: Any, model: Any, optimizer: Any) -> int:
        """The checkpoint ``plan.resume`` names read into the model, the optimizer and this
        process's random number generators; returns its iteration."""
        started = time.perf_counter()
        self.wire.paused = True
        try:
            own = engine_checkpoints.load(synchroniser, model, optimizer, self.plan.resume["path"],
                                          self.rank, self.own(0))
        finally:
            self.wire.paused = False
        engine_checkpoints.set_rng_state(own["rng"], self.device)
        self.restore_s = time.perf_counter() - started
        return int(own["iteration"])

    def take(self) -> dict:
        """What a round reports: its saves, and (the first round of a resumed run) the restore."""
        taken, self.taken = self.taken, []
        restored = self.restore_s if not self.reported else None
        self.reported = True
        return {"saves": taken, "restore_s": restored}

    def finish(self, completed: int) -> None:
        """Training is over: the last save committed, and the folder marked finished (a run
        started again on it starts over)."""
        if self.plan is None:
            return
        self.wire.paused = True
        self.settle()
        self.wire.paused = False
        if self.rank == 0:
            checkpoints.mark_finished(self.plan.folder, completed)
