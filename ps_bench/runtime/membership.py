"""``--trainer-timeout``: elastic membership of the parameter-server family. A trainer that sends
nothing for that long while the others wait on a bucket is dropped, and every round from then on
completes with the living: each bucket's average divides by the trainers that sent it (Li et al.,
"Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014, §4.4-4.5).

A server notices first, from a bucket that waits too long (its watchdog); the master, from a
trainer's round that fails. Whoever notices announces the drop to every other rank, trainers and
the master before the servers, and waits for them: a living trainer knows its peer is gone before
any average without that peer reaches it (its ``--verify`` means over the living), and a server
that waits on the same trainer completes its buckets as the notice arrives. Each process keeps one
``Membership``; its listeners (a server's waiting buckets, the master's waiting round) run as a
notice arrives."""

from __future__ import annotations

import inspect
import json
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.nn.parallel import DistributedDataParallel

from ps_bench.config import RunConfig, need
from ps_bench.runtime import failures
from ps_bench.runtime.faults import parse_faults

# DDP without the buffers' broadcast from trainer 0 before every forward, which would wait on a
# dropped trainer (each keeps its own BatchNorm statistics): the option's newer name where it has it
ELASTIC_DDP = ({"forward_sync_buffers": False}
               if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else {"broadcast_buffers": False})
NOTICE_TIMEOUT_S = 10.0  # how long an announcement waits for each rank to take the notice


class Membership:
    """This process's view: the trainers dropped so far, each with how it was noticed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.dropped: dict[int, dict] = {}
        self.listeners: list[Callable[[], None]] = []
        self._group: tuple[frozenset, dist.ProcessGroup] | None = None

    def take(self, drops: dict[int, dict]) -> list[int]:
        """Adds the drops not known yet (index -> how it was noticed); returns their indices."""
        with self.lock:
            new = [index for index in drops if index not in self.dropped]
            for index in new:
                self.dropped[index] = drops[index]
        if new:
            for listener in list(self.listeners):
                listener()
        return new

    def living(self, trainers: int) -> list[int]:
        with self.lock:
            return [index for index in range(trainers) if index not in self.dropped]

    def group(self, trainers: int) -> dist.ProcessGroup | None:
        """A process group of the living trainers (made by them alone, once for each membership);
        None while every trainer lives (the trainers' own group serves)."""
        living = frozenset(self.living(trainers))
        if len(living) == trainers:
            return None
        if self._group is None or self._group[0] != living:
            self._group = (living, dist.new_group(sorted(living), use_local_synchronization=True))
        return self._group[1]


MEMBERSHIP = Membership()


def notice(drops: dict[int, dict]) -> None:
    """RPC target: another rank dropped these trainers."""
    MEMBERSHIP.take(drops)


def announce(drops: dict[int, dict], trainers: list[str], others: list[str]) -> None:
    """Drops ``drops`` here and tells every rank named: ``trainers`` (the living) first, then
    ``others`` (servers, the master), waiting for each (never from an RPC thread)."""
    for names in (trainers, others):
        futures = [rpc.rpc_async(name, notice, args=(drops,), timeout=NOTICE_TIMEOUT_S)
                   for name in names]
        for future in futures:
            try:
                future.wait()
            except RuntimeError:  # a rank that is gone or stuck: it hears nothing more of ours
                pass
    MEMBERSHIP.take(drops)


def drop_entry(index: int, by: str, iteration: int | None, waited_s: float | None) -> dict:
    """How trainer ``index`` was noticed: by whom, at which of the living's iterations, after
    how long without its gradient."""
    return {"trainer": index, "noticed_by": by, "iteration": iteration, "waited_s": waited_s,
            "at": time.time()}


def check(cfg: RunConfig, elastic: bool, hook: str) -> None:
    """``--trainer-timeout`` against the run: positive, shorter than an RPC's timeout, a strategy
    whose every gradient goes to averaging servers, and nothing that waits on every trainer."""
    if cfg.trainer_timeout is None:
        return
    need(0 < cfg.trainer_timeout < cfg.rpc_timeout,
         f"--trainer-timeout must be positive and shorter than --rpc-timeout "
         f"({cfg.rpc_timeout:g} s), or the living trainers' calls fail first; "
         f"got {cfg.trainer_timeout}")
    need(elastic, f"--trainer-timeout drops a trainer from rounds its parameter servers average; "
                  f"--hook {hook} does not send every gradient to servers that average "
                  f"(use ps, ps_fp16, ps_bf16 or ps_compressed)")
    need(cfg.num_servers >= 1, "--trainer-timeout: the servers drop the trainer; give --nserver")
    need(cfg.mapping != "group", "--trainer-timeout with --mapping group: a group's server sums "
                                 "for its root, which would wait on a sum that never comes")
    for option, value in (("--checkpoint-every", cfg.checkpoint_every),
                          ("--target-loss", cfg.target_loss), ("--limits", cfg.limits or None)):
        need(value is None, f"--trainer-timeout with {option}: it waits on every trainer "
                            f"together, the dropped one too")


def check_going_on(cfg: RunConfig, by_itself: bool, hook: str) -> None:
    """Failures in a job whose strategy goes on without a failed trainer by itself
    (``goes_on``): what the living can go on without."""
    if not by_itself or not (cfg.inject_fault or cfg.mtbf):
        return
    hung = [fault for fault in parse_faults(cfg.inject_fault)
            if fault.kind == "hang" and fault.role == "trainer"]
    need(not hung, f"--hook {hook} under failures: a hung trainer is noticed by nothing (torchft's "
                   f"heartbeats still come, the servers never wait for it); inject exit or raise")
    for option, value in (("--target-loss", cfg.target_loss), ("--limits", cfg.limits or None)):
        need(value is None, f"--hook {hook} under failures with {option}: it waits on every "
                            f"trainer together, the failed one too")


DONE_KEY = "membership/done"


def goes_on(cfg: RunConfig, by_itself: bool = False) -> dict[str, bool]:
    """The roles a job goes on without (a trainer dropped, a server answered for by its
    replica); ``by_itself``: the strategy goes on without a failed trainer as its real system
    does (torchft's groups, the one started again healing from a live peer; servers that own the
    parameters), where the job has failures."""
    failing = bool(cfg.inject_fault or cfg.mtbf)
    return {"trainer": cfg.trainer_timeout is not None or (by_itself and failing),
            "server": bool(cfg.server_replicas)}


def leave(view: dist.Store, master: bool) -> None:
    """Ends RPC in a run that may have dropped trainers, whose graceful shutdown would wait on
    every rank, the dropped too: the master says in the store that the job is done (its results
    written), and each rank, the dropped one too where it still runs, ends RPC at once. ``view``:
    a store client of its own (a client waiting holds up every other call on it)."""
    if master:
        view.set(DONE_KEY, "1")
    else:
        view.wait([DONE_KEY], timedelta(days=30))
    rpc.shutdown(graceful=False)


def keep_failures(view: dist.Store, rank: int) -> None:
    """This rank's failure record also goes to the store, where the master reads its cause and
    time when it drops the trainer (an ``exit`` leaves no file of its own)."""
    key = f"membership/failure/rank{rank}"

    def keep(entry: dict) -> None:
        view.set(key, json.dumps(entry))
        view.check([key])  # a round trip: the store has it before this rank exits

    failures.add_sink(keep)


def failure_of(view: dist.Store | None, rank: int) -> dict | None:
    """Rank ``rank``'s failure record (``keep_failures``), where it left one in ``view``."""
    key = f"membership/failure/rank{rank}"
    return json.loads(view.get(key)) if view is not None and view.check([key]) else None
