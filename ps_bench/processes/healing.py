"""Replica groups that heal from a live peer (torchft's, ``Strategy.recovery`` HEAL), as the master
and the launcher see them.

The master runs what the strategy keeps beside the job (``Synchroniser.beside``: torchft's
lighthouse) and tells every trainer of it, in the store too, where a group started again reads it.
A trainer that fails is dropped from the rounds as ``--trainer-timeout`` drops one
(``waiting.Elastic``): the other groups go on committing steps. The launcher starts the failed
trainer again (``rejoin``), outside the master's rounds: it trains on its own shard, joins the
quorum at its first synchronisation and heals there from a live peer, then commits with the others
until the job ends; its first commit goes to the store. At the end the master sets it beside the
steps a group that never failed committed: when it healed, at which step, the steps the others
committed while it was away, and whether what it synchronised then is bit for bit theirs."""

from __future__ import annotations

import json
import time
from typing import Any

import torch.distributed as dist

from ps_bench.job import Job
from ps_bench.options import plural
from ps_bench.results.recovery import iso
from ps_bench.strategies import HOOKS
from ps_bench.strategies.record import HEAL

BESIDE_KEY = "ps_bench/beside"  # what the master runs beside the job, for a group started again
HEALED_PREFIX = "ps_bench/healed"  # a group started again: its first commit


def healed_key(index: int, start: int | str) -> str:
    """Trainer ``index``'s ``start``-th start again (from 1; ``"count"``: how many so far)."""
    return f"{HEALED_PREFIX}/trainer{index}/{start}"


class Healing:
    """The master's side: what runs beside the job, and the groups healed, for the results."""

    def __init__(self, job: Job, store: dist.Store | None) -> None:
        self.job, self.store = job, store
        self.closer: Any = None
        self.heals = job.strategy.recovery == HEAL and job.goes_on()["trainer"]

    def start(self) -> dict | None:
        """Starts what the strategy runs beside the job (None: nothing); every trainer gets the
        dict it returns."""
        factory = HOOKS.get(self.job.config.hook)
        if not hasattr(factory, "beside"):
            return None
        beside, self.closer = factory.beside(self.job.config, self.heals)
        if self.store is not None:
            self.store.set(BESIDE_KEY, json.dumps(beside))
        return beside

    def close(self) -> None:
        if self.closer is not None:
            self.closer.shutdown()
            self.closer = None

    def starts(self, index: int) -> list[dict | None]:
        """Each start again of trainer ``index``: its heal (None: it did not heal)."""
        if self.store is None or not self.store.check([healed_key(index, "count")]):
            return []
        count = int(self.store.add(healed_key(index, "count"), 0))
        keys = [healed_key(index, start) for start in range(1, count + 1)]
        return [json.loads(self.store.get(key)) if self.store.check([key]) else None
                for key in keys]

    def report(self, living: Any, elastic: Any) -> dict:
        """The groups healed (``elastic``'s drops, ``waiting.Elastic``), against the steps
        ``living``, a trainer that never failed, committed (``commit_log``). Returns the recovery
        block's part, with ``iterations``: those the groups started again committed after they
        healed."""
        log, drops, failed_at = (living.rpc_sync().commit_log(), elastic.drops,
                                 elastic.failed_times())
        by_step = {entry["step"]: entry for entry in log}
        groups, iterations = [], 0
        for drop in drops:
            index = drop["trainer"]
            starts = self.starts(index)
            healed = next((start for start in starts if start is not None), None)
            after = sum(start["iterations"] for start in starts if start is not None)
            iterations += after
            failed = failed_at.get(index)
            until = healed["at"] if healed else time.time()
            theirs = by_step.get(healed["step"]) if healed else None
            groups.append({
                "trainer": index, "starts": len(starts), "failed_at": iso(failed),
                "restarted_at": iso(healed["restarted_at"]) if healed else None,
                "healed_at": iso(healed["at"]) if healed else None,
                "healed_at_step": healed["step"] if healed else None,
                # failure -> started again and its strategy built; -> its first commit
                "restart_s": healed["ready_at"] - failed if healed and failed else None,
                "recovery_s": healed["at"] - failed if healed and failed else None,
                "steps_committed_while_away": sum(
                    1 for entry in log if (failed or 0) < entry["at"] < until),
                "parameters_equal": (None if theirs is None else
                                     theirs["digest"] == healed["digest"]
                                     and theirs["fragment"] == healed["fragment"]),
                "norm": healed["norm"] if healed else None,
                "their_norm": theirs["norm"] if theirs else None,
                "iterations_after_healing": after})
        last = log[-1] if log else {"step": 0, "failed_before": 0}
        attempted = last["step"] + last["failed_before"]
        steps = {"committed": last["step"], "failed": last["failed_before"],
                 "step_efficiency": last["step"] / attempted if attempted else None}
        for group in groups:
            print(describe(group, steps), flush=True)
        return {"groups_healed": groups, "steps": steps, "iterations": iterations}


def describe(group: dict, steps: dict) -> str:
    """A healed group's line of the report."""
    index = group["trainer"]
    away = plural(group["steps_committed_while_away"], "step")
    if group["healed_at"] is None:
        return (f"ps_bench: trainer {index}'s replica group did not heal before the run ended; "
                f"the others committed {away} after it failed")
    equal = {True: "its parameters equal theirs bit for bit",
             False: "its parameters DIFFER from theirs", None: "not compared"}[
        group["parameters_equal"]]
    efficiency = (f"; step efficiency {steps['step_efficiency']:.3f} "
                  f"({steps['committed']} committed of {steps['committed'] + steps['failed']})"
                  if steps["step_efficiency"] is not None else "")
    return (f"ps_bench: trainer {index}'s replica group started again "
            f"{group['restart_s']:.1f} s after it failed and healed from a live peer at step "
            f"{group['healed_at_step']} ({group['recovery_s']:.1f} s after); the others "
            f"committed {away} while it was away; {equal} at that step{efficiency}")
