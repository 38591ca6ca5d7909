"""What each attempt of a job keeps for the attempts after it, in the job's store: torchrun keeps
its store across the restarts it makes (``--max-restarts``), so a restarted attempt finds when
the job began, where each earlier attempt began (its first iteration, from a checkpoint or
from the start) and the rounds it finished (its master's snapshots), and the results file of
the attempt that completes holds every attempt's rounds. A job not under torchrun has one
attempt: there is nothing earlier to find."""

from __future__ import annotations

import json
import time

import torch.distributed as dist

from ps_bench.options import plural
from ps_bench.results.recovery import failure_entry, goodput, iso, saves_summary
from ps_bench.runtime.faults import restart_struck

PREFIX = "ps_bench/attempts"
STARTED = f"{PREFIX}/job-started"


class Attempts:
    """Attempt ``attempt`` of the job whose store is ``store``; ``restartable``: an attempt may
    follow it (torchrun's ``--max-restarts``), for which it keeps its rounds."""

    def __init__(self, store: dist.Store, attempt: int, restartable: bool = True) -> None:
        self.store, self.attempt, self.restartable = store, attempt, restartable
        self.found: list[dict] | None = None  # the earlier attempts, read once

    def job_started(self, now: float) -> float:
        """When the job's first attempt began (``now``, where this is the first)."""
        return float(self.store.compare_set(STARTED, "", repr(now)))

    def begin(self, iteration: int, at: float, struck: list[dict] | None = None,
              waited_s: float = 0.0) -> None:
        """This attempt begins training at ``iteration`` (the iterations done before it), at
        ``at``, after ``waited_s`` for the failures that ``struck`` its restart."""
        self.store.set(f"{PREFIX}/{self.attempt}/began", json.dumps(
            {"iteration": iteration, "time": at, "struck": struck or [], "waited_s": waited_s}))

    def release(self, at: float) -> None:
        """A restarted job trains again at ``at`` (``--mtbf``): its ranks' failures due before
        it struck the restart, and are passed over (``runtime.faults.TimedFault``)."""
        self.store.set(f"{PREFIX}/{self.attempt}/released", repr(at))

    def released(self) -> float | None:
        """When this attempt trains again, once its master has said (``release``)."""
        key = f"{PREFIX}/{self.attempt}/released"
        return float(self.store.get(key)) if self.store.check([key]) else None

    def keep(self, results: dict) -> None:
        """This attempt's rounds so far (its master's snapshot of its record), where an attempt
        may follow to read them: its own, not the earlier attempts' its record holds (each
        attempt keeps its own once, or the kept would grow with every attempt)."""
        if self.restartable:
            recovery = results.get("recovery")
            if recovery and recovery.get("attempts"):
                results = {**results, "recovery": {**recovery, "attempts": [
                    {key: value for key, value in attempt.items() if key != "results"}
                    for attempt in recovery["attempts"]]}}
            self.store.set(f"{PREFIX}/{self.attempt}/kept", json.dumps(results))

    def earlier(self) -> list[dict]:
        """Every earlier attempt: where it began (None: it began no training) and what it kept
        (None: no round); read from the store once."""
        if self.found is not None:
            return self.found
        found = []
        for attempt in range(self.attempt):
            began, kept = (f"{PREFIX}/{attempt}/{name}" for name in ("began", "kept"))
            found.append({"attempt": attempt,
                          "began": (json.loads(self.store.get(began))
                                    if self.store.check([began]) else None),
                          "kept": (json.loads(self.store.get(kept))
                                   if self.store.check([kept]) else None)})
        self.found = found
        return found


class RecoveryBooks:
    """What the master notes of this attempt's checkpoints and recovery as its rounds come in, and
    the results file's ``recovery`` block from it (``results.recovery``)."""

    def __init__(self, attempts: Attempts | None, plan, recovered: list[dict],
                 samples_per_iteration: int, trainers: int,
                 schedule: list[tuple[float, str, int]] | None = None) -> None:
        self.attempts, self.plan, self.recovered = attempts, plan, recovered
        # --mtbf: the job's failures (seconds into it, role, index), some of which may strike a
        # restart; the restart's failures and the time it waited for them
        self.schedule, self.struck, self.waited_s = schedule or [], [], 0.0
        self.samples_per_iteration = samples_per_iteration
        self.trainers = trainers
        self.began_at_iteration = (plan.resume["iteration"]
                                   if plan is not None and plan.resume else 0)
        self.iteration = self.began_at_iteration  # the iterations done so far
        self.saves: list[dict] = []
        self.restore_s: float | None = None
        self.ready_at: float | None = None  # when this attempt was ready to train (time.time())
        self.started: float | None = None  # when the job's first attempt began
        # --trainer-timeout: the trainers dropped (``processes.waiting.Elastic``), and the samples
        # the living trained on
        self.drops: list[dict] = []
        # --mtbf, --trainer-timeout or --server-replicas: a recovery block even with no failure
        self.failing = False
        self.servers_lost: list[dict] = []  # --server-replicas
        self.healed: dict | None = None  # the groups healed from a live peer (processes.healing)
        self.cuts: list[dict] = []  # links cut (--inject-fault trainer:I:N:cut=DURATION)
        self.samples = 0

    @property
    def wanted(self) -> bool:
        """Only a run with checkpoints, one that fails on a schedule or goes on without a rank,
        or one restarted, has a recovery block."""
        return (self.plan is not None or self.failing or bool(self.recovered)
                or bool(self.drops) or bool(self.servers_lost) or bool(self.cuts))

    def resume_point(self, per_round: int) -> tuple[int, int]:
        """Where training begins, rounds of ``per_round`` iterations: the round and its iteration
        after the checkpoint the job resumes from (``--checkpoint-every``), else the first's."""
        done = self.began_at_iteration
        if self.plan is not None and self.plan.start_over:
            print(f"ps_bench: --checkpoint-dir {self.plan.folder} held a finished run's "
                  f"checkpoints: this run starts over, and has removed them", flush=True)
        if not done or not per_round:
            return 0, 0
        round_index, step = divmod(done, per_round)
        print(f"ps_bench: resumed from the checkpoint of iteration {done} "
              f"({self.plan.resume['path']}): round {round_index + 1}, from its iteration "
              f"{step + 1}", flush=True)
        return round_index, step

    def begin(self, ready_at: float) -> None:
        """Training begins, every trainer built (and restored): its first step follows. Under
        ``--mtbf``, a restart struck by the schedule's failures begins again from the last of
        them (``restart_struck``): the job waits out the restarts that were struck."""
        self.ready_at = began = ready_at
        if self.attempts is None:
            return
        if self.schedule and self.attempts.attempt:
            failed_at = (self.recovered[-1].get("time") if self.recovered else None) or ready_at
            started = self.attempts.job_started(ready_at)
            began, struck = restart_struck([started + at for at, *_ in self.schedule],
                                           failed_at, ready_at)
            self.struck = [{"attempt": self.attempts.attempt, "role": self.schedule[place][1],
                            "index": self.schedule[place][2],
                            "failed_at": iso(started + self.schedule[place][0]),
                            "into_s": round(self.schedule[place][0], 3)} for place in struck]
            self.waited_s = began - ready_at
            self.attempts.release(began)
            if struck:
                first, last = self.struck[0]["into_s"], self.struck[-1]["into_s"]
                span = f"{first:.1f}" + (f" to {last:.1f}" if len(struck) > 1 else "")
                print(f"ps_bench: {plural(len(struck), 'failure')} drawn by --mtbf struck the "
                      f"restart ({span} s into the job), each beginning it again: training in "
                      f"{self.waited_s:.1f} s", flush=True)
                time.sleep(max(0.0, began - time.time()))
        self.attempts.begin(self.began_at_iteration, began, self.struck, self.waited_s)

    def add(self, rounds: list[dict], elapsed: float | None = None) -> None:
        """A round's trainer results: its iterations, each save's longest hold over the
        trainers, the restore, and the link cuts that ended in it (``elapsed``: its time)."""
        self.cuts += [{**cut, "began": iso(cut["began"]), "round_s": elapsed}
                      for result in rounds for cut in result.get("link_cuts", [])]
        first = rounds[0]
        self.iteration += first["iterations"]
        self.samples += sum(result["samples_processed"] for result in rounds)
        books = [result.get("checkpoints") or {"saves": [], "restore_s": None} for result in rounds]
        for place, save in enumerate(books[0]["saves"]):
            self.saves.append({"iteration": save["iteration"], "bytes": save.get("bytes"),
                               "held_s": max(each["saves"][place]["held_s"] for each in books
                                             if place < len(each["saves"]))})
        restored = [each["restore_s"] for each in books if each["restore_s"] is not None]
        if restored:
            self.restore_s = max(restored)

    def block(self, launched_at: float, restarted_at: float | None, ended_at: float,
              failure_free: float | None) -> dict | None:
        """The ``recovery`` block: ``launched_at``, when this attempt began; ``restarted_at``,
        when its first rank started; ``failure_free``, the timed rounds' samples a second."""
        if not self.wanted:
            return None
        earlier = self.attempts.earlier() if self.attempts is not None else []
        if self.started is None:
            self.started = (self.attempts.job_started(launched_at) if self.attempts is not None
                            else launched_at)
        started = self.started
        attempts = [attempt_entry(found, failure) for found, failure in zip(earlier,
                                                                           self.recovered)]
        failures = [recovered_by(earlier, place + 1, failure)
                    for place, failure in enumerate(self.recovered[:-1])]
        if self.recovered:  # the failure this attempt recovered from
            failures.append({**failure_entry(self.recovered[-1], self.began_at_iteration,
                                             restarted_at, self.ready_at),
                             "waited_s": round(self.waited_s, 3) if self.schedule else None})
        struck = [each for found in earlier
                  for each in (found["began"] or {}).get("struck") or []] + self.struck
        attempts.append({"attempt": len(earlier), "began_at_iteration": self.began_at_iteration,
                         "ended_at_iteration": self.iteration, "began": iso(launched_at),
                         "iterations_run": self.iteration - self.began_at_iteration})
        plan, base = self.plan, attempts[0]["began_at_iteration"] or 0
        healed = dict(self.healed or {})  # groups started again: their samples after healing
        samples = self.samples + (healed.pop("iterations", 0) * self.samples_per_iteration
                                  // self.trainers)
        return {"checkpoints": saves_summary(
                    None if plan is None else {"folder": plan.folder, "every": plan.every,
                                               "background": plan.asynchronous},
                    self.saves, self.restore_s, self.trainers),
                "failures": failures, "attempts": attempts,
                # resumed from a checkpoint of a run before this one (started again by hand): the
                # iterations it committed are no part of this file
                "resumed_from_an_earlier_run": base or None,
                "goodput": goodput(attempts, self.iteration - base, self.samples_per_iteration,
                                   ended_at - started, failure_free,
                                   samples if self.drops else None),
                **({"trainers_dropped": self.drops} if self.drops else {}),
                **({"servers_lost": self.servers_lost} if self.servers_lost else {}),
                **({"restarts_struck": struck} if struck else {}),
                **({"links_cut": self.cuts} if self.cuts else {}),
                **healed}


def attempt_entry(found: dict, failure: dict) -> dict:
    """An earlier attempt (``Attempts.earlier``) and the failure that ended it: where it began
    training and where it failed (none run where it failed before it began)."""
    began = (found["began"] or {}).get("iteration")
    ended = failure.get("iteration")
    run = (0 if found["began"] is None else
           ended - began if ended is not None and began is not None else None)
    return {"attempt": found["attempt"], "began_at_iteration": began,
            "ended_at_iteration": ended, "iterations_run": run, "failure": failure["failure"],
            "results": found["kept"]}


def recovered_by(earlier: list[dict], attempt: int, failure: dict) -> dict:
    """The failure that ended attempt ``attempt - 1``, as attempt ``attempt`` recovered from it:
    what that attempt's own books (its kept snapshot) measured of it."""
    kept = earlier[attempt]["kept"] or {}
    measured = ((kept.get("recovery") or {}).get("failures") or [{}])[-1]
    began = earlier[attempt]["began"]
    entry = failure_entry(failure, (began or {}).get("iteration") or 0, None, None)
    for key in ("restart_s", "recovery_s", "waited_s"):
        entry[key] = measured.get(key)
    return entry
