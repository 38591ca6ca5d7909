"""Standard output and error whose reader may leave first: ``bench.py | head``, or a pager quit
before the job ends.

Python ignores SIGPIPE, so once the reader is gone the next write to the pipe raises
``BrokenPipeError``: in a rank, mid-round, that ended the job, and the rounds already measured
were recorded as a failed run. ``outlive_reader`` wraps ``sys.stdout`` and ``sys.stderr`` so that
the write that finds the pipe closed points the stream's descriptor at ``/dev/null`` instead: the
process goes on silently, and its results file is written as if the output had been read to the
end. Each process that prints does this once (``ps_bench.cli.main``, and each rank as it starts):
a pipe's end is closed for every process that writes to it, and each finds out on its own.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


class OutlivesReader:
    """A text stream that drops what it is given once its reader has left (the first
    ``BrokenPipeError``), and otherwise is the stream it wraps."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.reader_left()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.reader_left()

    def reader_left(self) -> None:
        """From now on the descriptor is /dev/null: what is still buffered, and every later
        write, go there, and so does the interpreter's flush at exit."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self.stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def outlive_reader() -> None:
    """Wraps ``sys.stdout`` and ``sys.stderr`` in ``OutlivesReader`` where they are pipes or
    files of this process (not already wrapped, nor replaced by a caller that captures them)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None or isinstance(stream, OutlivesReader):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
            continue
        setattr(sys, name, OutlivesReader(stream))
