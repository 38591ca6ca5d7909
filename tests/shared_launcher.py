"""The launcher of the suite's shared runs (``tests/conftest.py``, ``BenchRuns.ok``): one process
that runs them one after the other as ``bench.py sweep`` runs its points, each a one-point sweep
(``ps_bench.sweep.load_sweep``, validated as ``bench.py`` validates a command line) run by
``ps_bench.sweep.run_point``, its ranks new processes forked from one preloaded forkserver, so that
no run pays for importing torch again (about 2 s of the 4 a small run takes alone on 2 cores).

Protocol: one JSON line per run on stdin, ``{"argv": [...], "folder": DIR, "timeout_s": S}``; one
JSON line per run on the stdout it started with, ``{"status", "results", "log", "error"}``. The
forkserver and the ranks write to ``LOG`` (its first argument), not to that stdout. Ends, with its
forkserver, when stdin closes.

    python -m tests.shared_launcher LOG
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def answer(protocol, **fields) -> None:
    protocol.write(json.dumps(fields) + "\n")
    protocol.flush()


def run(argv: list[str], folder: Path, timeout_s: float) -> dict:
    """One run of ``bench.py ARGV`` as the one point of a sweep in ``folder``."""
    from ps_bench.config import ConfigError
    from ps_bench.options import parse_run_options
    from ps_bench.sweep import load_sweep, run_point

    folder.mkdir(parents=True, exist_ok=True)
    try:
        options, config = parse_run_options(argv)
        if config is not None:
            raise ConfigError("--config: run it with bench.py")
        (folder / "sweep.json").write_text(json.dumps({"name": "shared", "variants": [
            {"name": "run", **options}]}))
        _, (point,) = load_sweep(str(folder / "sweep.json"))
    except (ConfigError, SystemExit) as refused:
        return {"status": "refused", "results": None, "log": "", "error": str(refused)}
    (folder / "points").mkdir(exist_ok=True)
    (folder / "logs").mkdir(exist_ok=True)
    results = run_point(point, folder, timeout_s)
    log = "".join(path.read_text() for path in sorted((folder / "logs").glob("*.log")))
    return {"status": results.get("status"), "results": results, "log": log,
            "error": results.get("error")}


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w")
    log = open(sys.argv[1], "a")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    from ps_bench.runtime import preload
    preload.start(models=["hf:"])  # the Hugging Face models' imports too: some runs train one
    try:
        for line in sys.stdin:
            request = json.loads(line)
            started = time.monotonic()
            outcome = run(request["argv"], Path(request["folder"]), request["timeout_s"])
            answer(protocol, elapsed_s=time.monotonic() - started, **outcome)
    finally:
        preload.stop()


if __name__ == "__main__":
    main()
