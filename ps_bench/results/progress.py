"""``--target-loss``'s books: where training stands after each round (warmup too), and the
``convergence`` object of the results file: whether, after how many iterations and seconds the
averaged model's smoothed loss met the target, why training stopped, and both loss curves."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ps_bench.config import DEFAULT_MAX_ITERATIONS, RunConfig
from ps_bench.metrics.stats import SMOOTHING, smoothed_loss
from ps_bench.runtime.topology import Topology


class Progress:
    """What the trainers' rounds say of training: trainer 0's loss curves (the averaged model's
    training and held-out losses, the same on every trainer) and every trainer's iteration ms."""

    def __init__(self, config: RunConfig, topology: Topology) -> None:
        self.config, self.topology = config, topology
        self.curve: list[tuple] = []  # (iterations done, training loss[, seconds])
        self.held_out: list[tuple] = []  # (iterations done, held-out loss[, seconds])
        self.iteration_ms: dict[int, list[float]] = defaultdict(list)  # trainer rank -> ms
        self.training: dict = {"reached_at": None, "diverged": False, "stopped": False}

    @property
    def max_iterations(self) -> int:
        return self.config.max_iterations or DEFAULT_MAX_ITERATIONS

    def add(self, rounds: list[dict]) -> bool:
        """One round's ``convergence`` from every trainer, in trainer order; returns whether
        training has stopped."""
        for info, result in zip(self.topology.trainers, rounds):
            self.iteration_ms[info.rank].extend(result["convergence"]["batch_ms"])
            self.held_out.extend(result["convergence"]["held_out"])
        progress = rounds[0]["convergence"]  # every trainer reached the same numbers
        self.curve.extend(progress["curve"])
        self.training = {key: progress[key] for key in self.training}
        return progress["stopped"]

    def line(self) -> str:
        """Where training stands, for the round's line."""
        if not self.curve:
            return ""
        iterations, loss = self.curve[-1][:2]
        smoothed = smoothed_loss(self.curve)
        shown = f"{smoothed:.4f}" if smoothed is not None else f"{loss:.4f} (not yet smoothed)"
        return (f"  | {iterations}/{self.max_iterations} iterations, the model's loss {shown}, "
                f"target {self.config.target_loss}")

    def summary(self) -> dict:
        """The results file's ``convergence``: both loss curves as ``[iterations, seconds,
        loss]`` (a loss that is no longer finite is null), seconds of training on the slowest
        trainer's clock unless a point carries its own (--staleness)."""
        clocks = [np.cumsum([0.0] + values) / 1000.0 for values in self.iteration_ms.values()]

        def at(iterations: int) -> float:  # seconds of training after that many iterations
            return float(max(c[min(iterations, len(c) - 1)] for c in clocks)) if clocks else 0.0

        def points(curve: list[tuple]) -> list[list]:
            return [[point[0], point[2] if len(point) > 2 else at(point[0]),
                     finite_or_none(point[1])]
                    for point in curve]

        reached_at, diverged = self.training["reached_at"], self.training["diverged"]
        done = self.curve[-1][0] if self.curve else 0
        iterations = reached_at if reached_at is not None else done
        why = ("target" if reached_at is not None else "diverged" if diverged
               else "max_iterations" if self.training["stopped"] else "unfinished")
        loss_curve = points(self.curve)
        return {
            "target_loss": self.config.target_loss,
            "reached": reached_at is not None,
            "iterations": iterations,
            "seconds": next((s for i, s, _ in reversed(loss_curve) if i == iterations),
                            at(iterations)),
            "stopped_by": why,
            "diverged": diverged,
            "final_loss": finite_or_none(smoothed_loss(self.curve)),
            "smoothing": SMOOTHING,
            "max_iterations": self.max_iterations,
            "labels": self.config.labels,
            "loss_curve": loss_curve,
            "held_out": points(self.held_out),
        }


def finite_or_none(value: float | None) -> float | None:
    """JSON has no NaN or infinity: a loss that diverged is null."""
    return value if value is not None and np.isfinite(value) else None
