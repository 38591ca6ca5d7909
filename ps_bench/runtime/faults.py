"""``--inject-fault ROLE:INDEX:ITER:KIND[:first][,...]``: make ranks fail on purpose; and
``--straggler trainer:INDEX:DELAY``: make one trainer slower on purpose.

ROLE is trainer, server or master; INDEX counts ranks of that role from 0 (trainer 1,
server 0, master 0). ITER counts from 1: a trainer's training iterations (warmup included),
the training iteration of the gradient a server receives, or the master's round. KIND is
``exit`` (the process dies at once), ``raise`` (an exception), ``hang`` (stops responding, for
ever) or, for a trainer on an emulated network (``--emulate-link``), ``cut=DURATION``: its host's
link down for that long (``ip link set eth0 down`` in its namespace, then up), the process going
on, its connections waiting as TCP does. A trailing ``:first`` limits the fault to torchrun's
first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), so a job started with ``--max-restarts`` can
recover.
Several faults are separated by commas: ``trainer:1:25:exit:first,trainer:2:60:exit``.
"""

from __future__ import annotations

import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ps_bench.config import ConfigError, RunConfig, need
from ps_bench.runtime import failures
from ps_bench.runtime.network import HOST_IFACE

ROLES = ("trainer", "server", "master")
KINDS = ("exit", "raise", "hang", "cut=DURATION")
CUT = "cut"
FIRST_ATTEMPT = "first"
FORMAT = "ROLE:INDEX:ITER:KIND[:first], e.g. trainer:1:3:hang or trainer:1:5:exit:first"


class InjectedFault(RuntimeError):
    """The exception ``raise`` faults throw."""


@dataclass(frozen=True)
class Fault:
    role: str
    index: int
    iteration: int
    kind: str
    first_attempt_only: bool = False
    duration_s: float | None = None  # a link cut's

    @classmethod
    def parse(cls, text: str) -> "Fault":
        """Raises ValueError with a sentence for people."""
        parts = text.split(":")
        if len(parts) not in (4, 5):
            raise ValueError(f"expected {FORMAT}; got {text!r}")
        role, index, iteration, kind = parts[:4]
        if len(parts) == 5 and parts[4] != FIRST_ATTEMPT:
            raise ValueError(f"the optional 5th field must be {FIRST_ATTEMPT!r} "
                             f"(first attempt only); got {parts[4]!r}")
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
        duration_s = None
        if kind.startswith(f"{CUT}="):
            try:
                duration_s = parse_duration(kind.split("=", 1)[1])
            except ValueError as error:
                raise ValueError(f"a cut's DURATION {error}") from None
            kind = CUT
            if role != "trainer":
                raise ValueError(f"a link cut is a trainer's (its host's link); got {role!r}")
        elif kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
        try:
            index_value, iteration_value = int(index), int(iteration)
        except ValueError:
            raise ValueError(f"INDEX and ITER must be integers; "
                             f"got {index!r} and {iteration!r}") from None
        if index_value < 0 or iteration_value < 1:
            raise ValueError(f"INDEX must be 0 or more and ITER 1 or more; "
                             f"got {index_value} and {iteration_value}")
        return cls(role, index_value, iteration_value, kind, first_attempt_only=len(parts) == 5,
                   duration_s=duration_s)

    def matches(self, role: str, index: int, iteration: int) -> bool:
        if self.first_attempt_only and restart_count() > 0:
            return False
        return (self.role, self.index, self.iteration) == (role, index, iteration)

    def trigger(self) -> None:
        where = f"{self.role} {self.index} at iteration {self.iteration}"
        if self.kind == "exit":
            failures.announce(InjectedFault(f"injected fault: {where} (exit)"))
            os._exit(3)
        if self.kind == "raise":
            raise InjectedFault(f"injected fault: {where}")
        if self.kind == CUT:
            print(f"ps_bench: {where}: its link down for {self.duration_s:g} s (--inject-fault)",
                  flush=True)
            cut_link(self.duration_s, self.iteration)
            return
        threading.Event().wait()  # hang: never returns


_cuts: list[dict] = []  # this rank's link cuts not yet taken


def cut_link(duration_s: float, iteration: int) -> None:
    """This rank's host link (in its emulated host's namespace) down for ``duration_s``, then up
    again from a thread of its own; the cut is kept for the round's results (``take_cuts``)."""
    link = ["ip", "link", "set", "dev", HOST_IFACE]
    subprocess.run([*link, "down"], check=True, capture_output=True)
    began = time.time()

    def restore() -> None:
        time.sleep(duration_s)
        subprocess.run([*link, "up"], check=True, capture_output=True)
        _cuts.append({"at_iteration": iteration, "duration_s": duration_s, "began": began,
                      "down_s": time.time() - began})

    threading.Thread(target=restore, name="ps_bench link cut", daemon=True).start()


def take_cuts(**tags) -> list[dict]:
    """The link cuts this rank has made and ended since the last take, each with ``tags``."""
    taken = list(_cuts)
    del _cuts[:len(taken)]
    return [{**tags, **cut} for cut in taken]


def restart_count() -> int:
    """How many times torchrun has restarted this job (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def parse_faults(text: str | None) -> tuple[Fault, ...]:
    """``--inject-fault``: one fault, or several separated by commas (each as ``Fault.parse``)."""
    if not text:
        return ()
    return tuple(Fault.parse(part.strip()) for part in text.split(","))


DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}
DRAWN_MOST = 10_000  # failures drawn ahead: far more than any run lives through


def parse_duration(text: str) -> float:
    """Seconds, from a positive number with a unit of ms, s, min or h (``90s``, ``5min``, ``2h``);
    ValueError with a sentence for people."""
    text = text.strip()
    unit = next((u for u in ("ms", "min", "s", "h") if text.endswith(u)), None)
    try:
        value = float(text[:-len(unit)]) if unit else None
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):
        raise ValueError(f"must be a positive number with a unit of ms, s, min or h, e.g. 90s or "
                         f"2h; got {text!r}")
    return value * DURATION_UNITS[unit]


@dataclass(frozen=True)
class Drawn:
    """``--mtbf``: the job's failures at exponential gaps of mean ``mtbf_s`` from its start (its
    first attempt's), each of a rank drawn uniformly among those of ``roles``; seeded, so that
    every rank draws the same schedule, and every run of the same seed."""

    mtbf_s: float
    roles: tuple[str, ...]
    seed: int

    def schedule(self, counts: dict[str, int]) -> list[tuple[float, str, int]]:
        """``(seconds into the job, role, index)`` of each failure, ``counts`` the ranks of each
        role."""
        generator = random.Random(f"mtbf:{self.seed}")
        ranks = [(role, index) for role in self.roles for index in range(counts[role])]
        at, drawn = 0.0, []
        for _ in range(DRAWN_MOST):
            at += generator.expovariate(1.0 / self.mtbf_s)
            drawn.append((at, *ranks[generator.randrange(len(ranks))]))
        return drawn


def drawn_of(cfg: RunConfig) -> Drawn | None:
    """``--mtbf`` and ``--fail-roles`` checked (a positive duration, roles this run has: a
    ``ConfigError`` in one line), as the schedule they draw (None: no ``--mtbf``)."""
    if cfg.mtbf is None:
        need(cfg.fail_roles == "trainer", "--fail-roles names the ranks --mtbf fails: give --mtbf")
        return None
    try:
        mtbf_s = parse_duration(cfg.mtbf)
    except ValueError as error:
        raise ConfigError(f"--mtbf {error}") from None
    roles = tuple(role.strip() for role in cfg.fail_roles.split(","))
    counts = role_counts(cfg)
    for role in roles:
        need(role in counts, f"--fail-roles: {role!r} is no role; give trainer, server or master, "
                             f"several separated by commas")
        need(counts[role] > 0, f"--fail-roles {role}: this run has no {role}")
    return Drawn(mtbf_s, roles, cfg.torch_seed)


def role_counts(cfg: RunConfig) -> dict[str, int]:
    return {"trainer": cfg.num_trainers, "server": cfg.num_servers, "master": 1}


def schedule_of(cfg: RunConfig) -> list[tuple[float, str, int]]:
    """``--mtbf``'s failures as every rank of this run draws them (none without it)."""
    drawn = drawn_of(cfg)
    return drawn.schedule(role_counts(cfg)) if drawn is not None else []


def restart_struck(failures: list[float], failed_at: float, ready_at: float
                   ) -> tuple[float, list[int]]:
    """When a restart that ``failures`` struck ends, as Daly's model has it (Future Generation
    Computer Systems 22(3), 2006, eq. 13's ``e^(R/M)``): a failure while the job restarts begins
    the restart again, from that failure. ``failures``: the schedule's times, in order;
    ``failed_at``: the failure restarted from; ``ready_at``: when the restart was done, its
    length ``R`` the one each restart again takes. Returns when training begins, and the places
    in ``failures`` of those that struck the restart."""
    restart_s = ready_at - failed_at
    began, struck = ready_at, []
    for place, at in enumerate(failures):
        if at >= began:
            break
        if at > failed_at:
            struck.append(place)
            began = at + restart_s
    return began, struck


class TimedFault:
    """This rank's next failure of a ``--mtbf`` schedule, due at a time rather than an iteration:
    the first drawn for it after its attempt began (those drawn while the job was down, between
    a failure and the restart, struck the restart: ``restart_struck``). ``released``: when a
    restarted job trains again (None while its master has not said), read once a failure is
    due; the failures before it are passed over."""

    def __init__(self, drawn: Drawn, counts: dict[str, int], role: str, index: int,
                 job_started: float, attempt_started: float,
                 released: Callable[[], float | None] | None = None) -> None:
        self.mine = [job_started + at for at, who, which in drawn.schedule(counts)
                     if (who, which) == (role, index)]
        self.job_started, self.released = job_started, released
        self.where, self.mtbf_s = f"{role} {index}", drawn.mtbf_s
        self.after(attempt_started)

    def after(self, began: float) -> None:
        """Armed with the first failure due at or after ``began``."""
        self.at = next((at for at in self.mine if at >= began), float("inf"))
        self.into_s = self.at - self.job_started

    def matches(self, role: str, index: int, iteration: int) -> bool:
        if time.time() < self.at:
            return False
        if self.released is not None:
            began = self.released()
            if began is None:  # its master has not yet said when training begins
                return False
            self.released = None
            self.after(began)
        return time.time() >= self.at

    def trigger(self) -> None:
        """Exits at once, its failure recorded: the launcher names it, and torchrun's next
        attempt reads it."""
        failures.record(InjectedFault(
            f"failure drawn by --mtbf (mean {self.mtbf_s:g} s): {self.where} at "
            f"{self.into_s:.1f} s into the job (exit)"))
        os._exit(3)


_armed: tuple[TimedFault, ...] = ()  # this process's --mtbf failure, once armed


def arm(fault: TimedFault | None) -> None:
    """This rank's ``--mtbf`` failure, checked wherever its injected faults are."""
    global _armed
    _armed = (fault,) if fault is not None else ()


def faults_of(text: str | None) -> tuple[Fault | TimedFault, ...]:
    """This rank's faults: ``--inject-fault``'s, and its ``--mtbf`` failure where armed."""
    return parse_faults(text) + _armed


def maybe_inject(faults: tuple[Fault, ...], role: str, index: int, iteration: int) -> None:
    """The first of ``faults`` made for this rank at this iteration, triggered."""
    for fault in faults:
        if fault.matches(role, index, iteration):
            fault.trigger()


STRAGGLER_FORMAT = ("trainer:INDEX:DELAY (persistent) or any:DELAY:P (transient), "
                    "e.g. trainer:1:30ms or any:20ms:0.2 (DELAY in us, ms or s; P in (0, 1])")
UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_delay(delay: str) -> float:
    """Seconds, from a number with a unit of us, ms or s; ValueError with a sentence for people."""
    delay = delay.strip()
    unit = next((u for u in ("us", "ms", "s") if delay.endswith(u)), None)
    try:
        value = float(delay[:-len(unit)]) if unit else None
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"DELAY must be a number with a unit of us, ms or s, e.g. 30ms; "
                         f"got {delay!r}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"DELAY must be 0 or more; got {delay!r}")
    return value * UNITS[unit]


@dataclass(frozen=True)
class Straggler:
    """``--straggler trainer:INDEX:DELAY``: trainer INDEX sleeps DELAY in every iteration
    (persistent); ``--straggler any:DELAY:P``: in each iteration each trainer sleeps DELAY with
    probability P (transient). Either way after its forward pass and inside the clock, in every
    trainer mode."""

    index: int | None  # None: any trainer, with ``probability``
    delay_s: float
    probability: float = 1.0

    @classmethod
    def parse(cls, text: str) -> "Straggler":
        """Raises ValueError with a sentence for people."""
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in ("trainer", "any"):
            raise ValueError(f"expected {STRAGGLER_FORMAT}; got {text!r}")
        if parts[0] == "any":
            try:
                probability = float(parts[2])
            except ValueError:
                raise ValueError(f"P must be a probability in (0, 1]; got {parts[2]!r}") from None
            if not 0 < probability <= 1:
                raise ValueError(f"P must be a probability in (0, 1]; got {parts[2]!r}")
            return cls(None, parse_delay(parts[1]), probability)
        try:
            index = int(parts[1])
        except ValueError:
            raise ValueError(f"INDEX must be an integer; got {parts[1]!r}") from None
        if index < 0:
            raise ValueError(f"INDEX must be 0 or more; got {index}")
        return cls(index, parse_delay(parts[2]))


class Straggling:
    """What one trainer sleeps in each iteration under ``--straggler``: the persistent delays
    that name it, plus each transient one whose draw for (seed, trainer, iteration) comes up. A
    draw depends on nothing else, so every run with the same seed delays the same iterations,
    whatever its rounds."""

    def __init__(self, texts: list[str] | None, index: int, seed: int) -> None:
        stragglers = [Straggler.parse(text) for text in texts or []]
        self.index, self.seed = index, seed
        self.persistent_s = sum(s.delay_s for s in stragglers if s.index == index)
        self.transient = [(s.delay_s, s.probability) for s in stragglers if s.index is None]

    def __bool__(self) -> bool:
        return bool(self.persistent_s or self.transient)

    def delay_s(self, iteration: int) -> float:
        """Seconds to sleep in training iteration ``iteration`` (from 1)."""
        delay = self.persistent_s
        for number, (seconds, probability) in enumerate(self.transient):
            if random.Random(f"{self.seed}:{number}:"
                             f"{self.index}:{iteration}").random() < probability:
                delay += seconds
        return delay
