"""How the master waits for the trainers' rounds: with a progress line while a round runs long,
and, under ``--trainer-timeout`` (``runtime.membership``), for the living trainers only: a trainer
whose round fails is dropped by the master (the servers drop one that stops sending), and each
drop goes into the results with its cause and what it cost."""

from __future__ import annotations

import threading
import time
from typing import Callable

from torch.futures import Future, collect_all

from ps_bench.options import plural
from ps_bench.results.recovery import iso
from ps_bench.runtime.membership import MEMBERSHIP, announce, drop_entry, failure_of
from ps_bench.runtime.topology import Topology
from ps_bench.servers.replicas import replica_of
from ps_bench.strategies.record import HEAL, SERVERS_KEEP

# a round still running this long after it began prints a progress line, then every
# PROGRESS_EVERY_S; each trainer has PROGRESS_ASK_S to say where it is
PROGRESS_FIRST_S, PROGRESS_EVERY_S, PROGRESS_ASK_S = 5.0, 30.0, 5.0
# how the living go on after a drop, by the strategy's way of recovering (else: their servers
# average over those that sent)
HOW_IT_GOES_ON = {HEAL: "its replica group starts again and heals from a live peer",
                  SERVERS_KEEP: "the servers, which own the parameters, apply their updates"}


def wait_round(futures: list, trainers: list, label: str) -> list[dict]:
    """The trainers' rounds, once every one has ended; while they run, a progress line after
    ``PROGRESS_FIRST_S`` and every ``PROGRESS_EVERY_S`` after that (``round_progress``)."""
    ended = threading.Event()
    collect_all(futures).then(lambda _: ended.set())
    began, wait_s = time.perf_counter(), PROGRESS_FIRST_S
    while not ended.wait(wait_s):
        print(f"{label} {round_progress(trainers, time.perf_counter() - began)}", flush=True)
        wait_s = PROGRESS_EVERY_S
    return [future.wait() for future in futures]


def round_progress(trainers: list, elapsed_s: float) -> str:
    """Where the trainers are in the running round, asked of each at once: the slowest's
    iteration and the fastest's, and the time left at the slowest's pace so far."""
    asked = [t.rpc_async(timeout=PROGRESS_ASK_S).round_progress() for t in trainers]
    at = {}
    for index, future in enumerate(asked):
        try:
            at[index] = future.wait()
        except RuntimeError:  # it did not answer in time: said below
            pass
    silent = [str(index) for index in range(len(trainers)) if index not in at]
    quiet = (f"; trainer{'s' * (len(silent) > 1)} {', '.join(silent)} did not say where they are "
             f"within {PROGRESS_ASK_S:g} s" if silent else "")
    if not at:
        return f"{elapsed_s:.0f} s so far{quiet}"
    slowest = min(at, key=lambda index: at[index][0])
    low, high, total = at[slowest][0], max(k for k, _ in at.values()), at[slowest][1]
    text = (f"{elapsed_s:.0f} s so far: trainers at iteration {low}"
            + (f" to {high} (the slowest: trainer {slowest})" if high > low else "")
            + f" of {total}")
    done = low - 1
    if done > 0:
        text += f", about {elapsed_s * (total - done) / done:.0f} s left"
    return text + quiet


class Elastic:
    """The drops the master has seen, and the rounds' waits that leave the dropped out."""

    def __init__(self, topology: Topology, view, recovery: str | None = None) -> None:
        self.topology, self.view = topology, view
        self.reported: set[int] = set()
        self.drops: list[dict] = []
        self.how = HOW_IT_GOES_ON.get(recovery, "each average over the trainers that sent")
        self.failed: dict[int, float] = {}  # trainer -> when it failed, where it said

    def living(self) -> list[int]:
        return MEMBERSHIP.living(self.topology.num_trainers)

    def wait(self, futures: dict[int, Future], progress: Callable[[float], None],
             first_s: float, every_s: float) -> dict[int, dict | None]:
        """Each living trainer's round (None for the dropped): waits until every future of a
        trainer not dropped has ended; a trainer whose round failed is dropped here and told to
        every other rank. ``progress(elapsed_s)`` prints a line after ``first_s``, then every
        ``every_s``."""
        began, next_line = time.perf_counter(), time.perf_counter() + first_s
        wake = threading.Event()  # a round ended, or a trainer was dropped
        for future in futures.values():
            future.add_done_callback(lambda _: wake.set())
        MEMBERSHIP.listeners.append(wake.set)
        try:
            while True:
                wake.clear()  # before looking: what happens after it wakes the wait below
                for index, future in futures.items():
                    if future.done() and index not in MEMBERSHIP.dropped and failed(future):
                        self.drop_failed(index)
                if all(future.done() or index in MEMBERSHIP.dropped
                       for index, future in futures.items()):
                    break
                wake.wait(max(0.0, next_line - time.perf_counter()))
                if time.perf_counter() >= next_line:
                    progress(time.perf_counter() - began)
                    next_line = time.perf_counter() + every_s
        finally:
            MEMBERSHIP.listeners.remove(wake.set)
        self.note()
        return {index: (future.wait() if future.done() and index not in MEMBERSHIP.dropped
                        else None) for index, future in futures.items()}

    def drop_failed(self, index: int) -> None:
        """Trainer ``index``'s round failed (its process ended): dropped, every rank told."""
        record = self.record_of(index)
        done = (record or {}).get("iteration")  # the iterations it had completed
        drops = {index: drop_entry(index, "master", None if done is None else done + 1, None)}
        living = [i for i in self.living() if i != index]
        announce(drops, [self.topology.trainers[i].name for i in living],
                 [info.name for info in self.topology.servers])

    def record_of(self, index: int) -> dict | None:
        """Trainer ``index``'s failure record, where its process left one."""
        return failure_of(self.view, self.topology.trainers[index].rank)

    def note(self) -> None:
        """Prints each drop not yet printed and keeps it for the results."""
        for index, entry in sorted(MEMBERSHIP.dropped.items()):
            if index in self.reported:
                continue
            self.reported.add(index)
            record = self.record_of(index)
            failed_at = (record or {}).get("time")
            if failed_at is not None:
                self.failed[index] = failed_at
            cause = (record or {}).get("error")
            self.drops.append({
                "trainer": index, "rank": self.topology.trainers[index].rank,
                "noticed_by": entry["noticed_by"], "at_iteration": entry["iteration"],
                "waited_s": entry["waited_s"], "dropped_at": iso(entry["at"]),
                "failure": cause, "failed_at": iso(failed_at),
                "failed_at_iteration": (record or {}).get("iteration"),
                # failure -> the living's waiting buckets answered: detection and the drop
                "recovery_s": entry["at"] - failed_at if failed_at is not None else None,
                "living": len(self.living())})
            waited = (f" after {entry['waited_s']:.1f} s without its gradient"
                      if entry["waited_s"] is not None else " (its round failed)")
            at = f" at iteration {entry['iteration']}" if entry["iteration"] else ""
            print(f"ps_bench: trainer {index} dropped{at} by {entry['noticed_by']}{waited}"
                  f"{f' ({cause})' if cause else ''}; {plural(len(self.living()), 'trainer')} "
                  f"go{'es' * (len(self.living()) == 1)} on, {self.how}", flush=True)

    def failed_times(self) -> dict[int, float]:
        """When each dropped trainer failed (time.time()), where its record says."""
        return dict(self.failed)


def failed(future: Future) -> bool:
    try:
        future.wait()
    except RuntimeError:
        return True
    return False


class ServersLost:
    """``--server-replicas``: the servers found gone as the master asks each for its round's
    books, and each one's replica answering for it (when, from which iteration, how long after
    the server failed)."""

    def __init__(self, topology: Topology, view) -> None:
        self.topology, self.view = topology, view
        self.lost: set[int] = set()
        self.entries: list[dict] = []

    def take(self, servers: list) -> list[dict | None]:
        """Each server's books of the round, reset for the next (None: lost)."""
        served: list[dict | None] = []
        for index, server in enumerate(servers):
            books = None
            if index not in self.lost:
                try:
                    books = server.rpc_sync().take_metrics()
                    server.rpc_sync().reset_state()
                except RuntimeError:  # gone: its replica answers for it
                    self.lost.add(index)
                    books = None
            served.append(books)
        for books in served:
            for takeover in (books or {}).get("takeovers", []):
                self.note(takeover)
        return served

    def note(self, takeover: dict) -> None:
        index = takeover["server"]
        if any(entry["server"] == index for entry in self.entries):
            return
        info = self.topology.servers[index]
        record = failure_of(self.view, info.rank) or {}
        failed_at = record.get("time")
        replica = replica_of(index, len(self.topology.servers))
        self.entries.append({
            "server": index, "rank": info.rank, "replica": replica,
            "failure": record.get("error"), "failed_at": iso(failed_at),
            "answered_from_iteration": takeover["iteration"],
            # failure -> its replica's first answer for it: the trainers' calls failing, asked
            # again of the replica, every living trainer's contribution there
            "recovery_s": takeover["at"] - failed_at if failed_at is not None else None})
        after = (f", {takeover['at'] - failed_at:.2f} s after it failed"
                 if failed_at is not None else "")
        cause = f" ({record['error']})" if record.get("error") else ""
        print(f"ps_bench: server {index} lost{cause}; server {replica}, its replica, answers "
              f"for it from iteration {takeover['iteration']}{after}", flush=True)
