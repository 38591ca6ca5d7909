"""A run's failures and what they cost, for its results file's ``recovery`` block: its checkpoints
(saved how often, how long each held training, the restore), each failure an earlier attempt
ended with (where and when, the restart, the iterations redone, the time to the next step
committed after it), every attempt (where it began and ended, its rounds as it kept them), and
goodput: the samples the run committed over its whole wall time, start-up, saves and restarts
included, beside the failure-free throughput of its timed rounds.

An iteration is committed when no failure takes it back: a restart from a checkpoint takes back
every iteration since the checkpoint, which the next attempt redoes. Step efficiency is the
committed iterations over the iterations run, redone ones included."""

from __future__ import annotations

import statistics
from datetime import datetime, timezone


# the lists of a results file's ``recovery`` block that hold one failure each (a restart's
# failures: those ``--mtbf`` drew while the job restarted, each beginning the restart again)
FAILURE_LISTS = ("failures", "trainers_dropped", "servers_lost", "restarts_struck")


def failures_in(recovery: dict) -> int:
    """The failures a run's ``recovery`` block lists: restarts, trainers dropped, servers lost."""
    return sum(len(recovery.get(key) or []) for key in FAILURE_LISTS)


def iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, timezone.utc).astimezone().isoformat(timespec="seconds")


def saves_summary(plan: dict | None, saves: list[dict], restore_s: float | None,
                  trainers: int) -> dict | None:
    """``--checkpoint-every``: the folder, the interval, the saves of this attempt (each's longest
    hold of training over the trainers), a checkpoint's bytes and, saved in the foreground, the
    rate a trainer wrote its share at (its bytes over the trainers, over the p50 save: what
    ``predict`` scales a checkpoint's cost with), and the restore it began with."""
    if plan is None:
        return None
    held = [save["held_s"] for save in saves]
    sizes = [save["bytes"] for save in saves if save.get("bytes")]
    p50 = statistics.median(held) if held else None
    nbytes = statistics.median(sizes) if sizes else None
    return {"folder": plan["folder"], "every": plan["every"], "background": plan["background"],
            "saves": len(held), "save_s": sum(held), "save_s_p50": p50,
            "bytes": nbytes,
            "bytes_per_s_per_trainer": (nbytes / trainers / p50
                                        if nbytes and p50 and not plan["background"] else None),
            "restore_s": restore_s}


def failure_entry(failure: dict, resumed_from: int, restarted_at: float | None,
                  ready_at: float | None) -> dict:
    """The failure an earlier attempt ended with (``rendezvous.recovered_failures``' entry), as this
    attempt recovered from it: resumed at ``resumed_from`` (0: from the start), its ranks started
    at ``restarted_at``, ready to train again (started up and restored) at ``ready_at``."""
    failed_at, failed_in = failure.get("time"), failure.get("iteration")
    return {"attempt": failure["attempt"], "role": failure.get("role"),
            "rank": failure.get("rank"), "host": failure.get("host"),
            "failure": failure["failure"], "failed_at": iso(failed_at),
            # the iterations done when it failed (a trainer's count; None for another role)
            "iterations_done": failed_in, "resumed_from": resumed_from,
            "iterations_redone": (max(0, failed_in - resumed_from)
                                  if failed_in is not None else None),
            # failure -> this attempt's ranks started: torchrun noticing, stopping the others,
            # starting them again
            "restart_s": (restarted_at - failed_at
                          if restarted_at is not None and failed_at is not None else None),
            # failure -> training again: detection, restart, start-up, restore
            "recovery_s": (ready_at - failed_at
                           if ready_at is not None and failed_at is not None else None)}


def goodput(attempts: list[dict], committed: int, samples_per_iteration: int,
            wall_s: float | None, failure_free: float | None,
            samples: int | None = None) -> dict:
    """The run's committed samples over its wall time, and its step efficiency: ``attempts``
    each with the iterations it ran (None where not known); ``samples``: those trained on where
    not every trainer ran every iteration (a trainer dropped, ``--trainer-timeout``)."""
    samples = committed * samples_per_iteration if samples is None else samples
    run = [attempt["iterations_run"] for attempt in attempts
           if attempt["iterations_run"] is not None]
    known = len(run) == len(attempts)
    return {"committed_iterations": committed,
            "committed_samples": samples,
            "iterations_run": sum(run) if known else None,
            "step_efficiency": committed / sum(run) if known and sum(run) else None,
            "wall_s": wall_s,
            "samples_per_s": samples / wall_s if wall_s else None,
            "failure_free_samples_per_s": failure_free}
