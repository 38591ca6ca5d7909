"""What the master keeps of the finished rounds while the job runs: a snapshot of its record in
the run folder after each timed round (paced: ``SnapshotPacing``), which the launcher writes as
the failed run's results file should the job end early; and, when the job is stopped (a signal
in ``STOPPING``), the rounds a paced-out snapshot had not kept, written before the master ends.
Under torchrun no launcher of ours reads the snapshot: ``on_stop`` writes the results file."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator

from ps_bench.results.files import write_snapshot
from ps_bench.results.record import RunRecord

SNAPSHOT_CHEAP_S = 0.05
# what stops a job's ranks: the launcher's SIGTERM, torchrun's, and the hang-up torchrun passes on
# when the ssh session of a `bench.py launch` host ends
STOPPING = (signal.SIGTERM, signal.SIGHUP)
UNFINISHED = "the job ended before it finished"


class SnapshotPacing:
    """When the master keeps its finished rounds. The snapshot grows with the run: once writing
    one costs more than SNAPSHOT_CHEAP_S, it is skipped while less than ten times that cost has
    passed since the last one (at most about a tenth of the wall time, between rounds, never
    inside the timed region). The first is always written, and its cost paces nothing: it carries
    what a process pays once (numpy's percentile imports numpy.ma, 0.25 s from a cold cache), and
    pacing by it would lose the rounds that finish in the next seconds to a failure there."""

    def __init__(self) -> None:
        self.written = 0
        self.at = self.cost = 0.0
        self.behind = False  # a round finished since the last snapshot: a stop writes it

    def due(self, now: float) -> bool:
        due = self.cost <= SNAPSHOT_CHEAP_S or now - self.at >= 10 * self.cost
        self.behind = self.behind or not due
        return due

    def wrote(self, start: float, end: float) -> None:
        self.written += 1
        self.at = end
        self.cost = end - start if self.written > 1 else 0.0
        self.behind = False


class Keeper:
    """The master's record, kept. ``on_stop`` (the signal's name) -> None, where no launcher of
    ours reads the run folder (torchrun); else a stop writes the snapshot."""

    def __init__(self, record: RunRecord, run_dir: str,
                 on_stop: Callable[[str], None] | None = None,
                 on_written: Callable[[dict], None] | None = None) -> None:
        """``on_written``: also handed each snapshot written (the job's store keeps it for a
        restarted attempt)."""
        self.record, self.run_dir, self.on_stop, self.on_written = (record, run_dir, on_stop,
                                                                    on_written)
        self.pacing = SnapshotPacing()
        self.recording = False  # a round is going into the record: a stop waits for it
        self.stopped_by: int | None = None  # the signal that waited

    def watch(self) -> None:
        """From the master's main thread: every signal in STOPPING keeps the rounds first."""
        for signum in STOPPING:
            signal.signal(signum, self.on_stopping)

    def release(self) -> None:
        """Once the rounds are over: a stop from here on must not write a failed run over the
        results the master is about to write."""
        for signum in STOPPING:
            signal.signal(signum, signal.SIG_DFL)

    def write(self) -> None:
        results = self.record.results("failed", error=UNFINISHED)
        write_snapshot(results, self.run_dir)
        if self.on_written is not None:
            self.on_written(results)

    def snapshot(self) -> None:
        """After a timed round, unless paced out (``SnapshotPacing``)."""
        start = time.perf_counter()
        if self.pacing.due(start):
            self.write()
            self.pacing.wrote(start, time.perf_counter())

    @contextlib.contextmanager
    def adding(self) -> Iterator[None]:
        """A round going into the record and its snapshot: a stop that comes meanwhile waits
        until both are whole."""
        self.recording = True
        try:
            yield
        finally:
            self.recording = False
        if self.stopped_by is not None:
            self.stop(self.stopped_by)

    def on_stopping(self, signum: int, frame) -> None:
        """The job is stopped (Ctrl-C, another rank failed, a watchdog; under torchrun its agent,
        or the hang-up of the ssh session it runs in)."""
        if self.recording:
            self.stopped_by = signum
        else:
            self.stop(signum)

    def stop(self, signum: int) -> None:
        with contextlib.suppress(OSError):  # what was kept before stands
            if self.on_stop is not None:
                self.on_stop(signal.Signals(signum).name)
            elif self.pacing.behind:
                self.write()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # ends as the signal ends it, which the launcher names
