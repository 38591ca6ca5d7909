"""How a rank fails: it records who it is and why in the run folder, then exits.

The launcher reads these records to print one summary naming the first failure by role and
rank; a rank killed by a signal leaves no record, and the launcher names the signal.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class Identity:
    role: str
    index: int
    rank: int
    name: str
    run_dir: str
    echo: bool  # print the traceback here too (nobody else will: under torchrun)

    def describe(self) -> str:
        return f"{self.role} {self.index} (rank {self.rank}, {self.name})"


_identity: Identity | None = None
_progress: Callable[[], int] | None = None  # a trainer's iterations done, for its failure record


class Terminated(BaseException):
    """SIGTERM reached the launcher (raised by its signal handler)."""


def raise_terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: the launcher's ``try`` blocks stop what they started, as for Ctrl-C."""
    raise Terminated()


def set_identity(identity: Identity) -> None:
    global _identity
    _identity = identity


def set_progress(progress: Callable[[], int]) -> None:
    """A trainer's count of its iterations so far: its failure record says where it failed."""
    global _progress
    _progress = progress


def error_file(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / f"error-rank{rank}.json"


_sinks: list[Callable[[dict], None]] = []


def add_sink(sink: Callable[[dict], None]) -> None:
    """Also hands every failure record to ``sink`` (under torchrun: the store a restarted
    attempt reads, to say what it recovered from)."""
    _sinks.append(sink)


def _entry(error: BaseException) -> dict:
    text = "".join(traceback.format_exception(error))
    return {**asdict(_identity), "error": f"{type(error).__name__}: {error}".strip(),
            "traceback": text, "time": time.time(),
            **({"iteration": _progress()} if _progress is not None else {})}


def announce(error: BaseException) -> None:
    """Hands a failure to the sinks only: for a rank about to vanish on purpose, whose exit
    the launcher reports by itself."""
    if _identity is None:
        return
    entry = _entry(error)
    for sink in _sinks:
        try:
            sink(entry)
        except Exception:  # noqa: BLE001 - a failing rank must still reach its exit
            pass


def record(error: BaseException) -> None:
    """Writes this rank's failure record (first one wins)."""
    me = _identity
    if me is None:
        return
    announce(error)
    text = "".join(traceback.format_exception(error))
    entry = _entry(error)
    path = error_file(me.run_dir, me.rank)
    try:
        if not path.exists():  # written whole, then renamed: a reader never sees half a record
            pending = path.with_name(f"{path.name}.{threading.get_ident()}.pending")
            pending.write_text(json.dumps(entry))
            os.replace(pending, path)
    except OSError:
        pass
    if me.echo:
        sys.stderr.write(f"[{me.name}] {text}")
        sys.stderr.flush()


# taken by the first thread to fail, never released: the process ends with it
_fatal = threading.Lock()


def fatal(error: BaseException) -> None:
    """Records the failure and ends this process now: with a peer gone, RPC threads can block
    interpreter teardown, so there is no orderly exit to wait for. Where several threads fail at
    once (two trainers' calls to a failing server), the first records and ends the process; the
    others wait for that, so none rewrites the record while the process exits."""
    _fatal.acquire()
    record(error)
    if _identity is not None and _identity.echo:  # nobody reads the record under torchrun
        shutil.rmtree(_identity.run_dir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def fatal_on_error(function: F) -> F:
    """An exception escaping ``function`` ends the rank (inside a worker process only;
    elsewhere, as in unit tests, it propagates as usual)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except Exception as error:
            if _identity is None:
                raise
            fatal(error)

    return wrapper


def read_records(run_dir: str | os.PathLike) -> dict[int, dict]:
    records = {}
    for path in Path(run_dir).glob("error-rank*.json"):
        try:
            entry = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        records[entry["rank"]] = entry
    return records
