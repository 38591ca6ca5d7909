"""The interpreter local ranks start from: a forkserver that has already imported torch and
ps_bench.

A spawned rank is a new interpreter that imports torch again (about 1.5 s of CPU each, and on a
few cores the ranks take turns). Instead, ``torch.multiprocessing``'s forkserver imports
``PRELOAD`` once and forks every rank from there: a rank starts with everything imported. The
forkserver is a fresh interpreter of its own, started by exec, so nothing the launcher did
(CUDA, threads) is inherited, and it never initialises CUDA itself. ``start`` brings it up
early, from ``bench.py`` before the launcher's own imports, so the two import side by side; a
sweep starts it once and every point's ranks are forked from it.

This module imports nothing heavy: ``bench.py`` calls it before torch is loaded.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Iterable
from multiprocessing import forkserver, resource_tracker, util

START_METHOD = "forkserver"
# torch, RPC, trainers, servers, models, metrics; and what DistributedDataParallel imports when a
# trainer first builds one (1 to 2 s of CPU)
PRELOAD = ["ps_bench.runtime.forkserver", "ps_bench.processes.launch", "torch._dynamo"]
# What building any Hugging Face model imports (4 s of CPU on the development machine), preloaded
# only when a run names one (--model hf:...): a missing transformers is passed over here and
# reported by the run's validation.
HF_MODULES = ("transformers.modeling_utils",)
RUN_ONLY_FLAGS = ("-h", "--help", "--dry-run", "--dry_run", "--version")
RUNNING_SUBCOMMANDS = ("emulate",)  # subcommands that run one job from this machine's launcher
# the forkserver listens on TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, an AF_UNIX path of at most
# 107 bytes (Linux's sun_path less its NUL): a longer TMPDIR than this cannot hold it
LONGEST_TMPDIR = 107 - len("/pymp-XXXXXXXX/listener-XXXXXXXX")
SHORT_TMPDIR = "/tmp"


def context(models: Iterable[str] = ()) -> multiprocessing.context.BaseContext:
    """The forkserver context ranks are started from, preloading ``PRELOAD`` and what the
    ``models`` the runs will train import."""
    ctx = multiprocessing.get_context(START_METHOD)
    ctx.set_forkserver_preload(
        PRELOAD + (list(HF_MODULES) if any(str(m).startswith("hf:") for m in models) else []))
    return ctx


def prepare_environment(debug: bool) -> None:
    """What ranks read when torch loads, set before the forkserver starts (it keeps the
    environment it started with): one intra-op thread (``ps_bench`` sets it), and torch's C++
    log quiet unless ``--debug`` (once a rank is gone, every peer's RPC agent logs each broken
    pipe)."""
    if not debug:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def start(debug: bool = False, models: Iterable[str] = ()) -> None:
    """Starts the forkserver now (it imports ``PRELOAD``, and what ``models`` need, while the
    caller goes on); a no-op when it is running already."""
    prepare_environment(debug)
    os.environ["PS_BENCH_LAUNCHER_PID"] = str(os.getpid())  # read by ps_bench.runtime.forkserver
    context(models)
    socket_folder()
    forkserver.ensure_running()


def socket_folder() -> None:
    """multiprocessing's folder for this process (the forkserver's socket in it), made under
    ``SHORT_TMPDIR`` where the temporary folder's path is too long for the socket's (a
    job-specific TMPDIR on a cluster, a test's own): multiprocessing removes it at exit."""
    if len(os.fsencode(tempfile.gettempdir())) <= LONGEST_TMPDIR or \
            not os.access(SHORT_TMPDIR, os.W_OK | os.X_OK):
        return
    saved, tempfile.tempdir = tempfile.tempdir, SHORT_TMPDIR
    try:
        util.get_temp_dir()  # made once a process, kept for every later call
    finally:
        tempfile.tempdir = saved


def named_models(argv: list[str]) -> list[str]:
    """The models a command line names, from its words alone (``--model NAME``, ``--model=NAME``
    and a ``--config`` file's ``"model"``), before it is parsed: a wrong guess costs a preloaded
    module or a slower start, never a wrong result."""
    models, config = [], None
    for word, following in zip(argv, argv[1:] + [""]):
        if word == "--model":
            models.append(following)
        elif word.startswith("--model="):
            models.append(word.split("=", 1)[1])
        elif word in ("--config", "--config-file"):
            config = following
    if config:
        try:
            with open(config) as stream:
                models.append(str(json.load(stream).get("model", "")))
        except (OSError, ValueError, AttributeError):
            pass
    return models


def stop() -> None:
    """Ends the forkserver and the resource tracker multiprocessing started beside it, once the
    launcher has no more ranks to start (its ranks have ended), and reaps both: left to end when
    the launcher exits, they would wait for init to collect them. The forkserver is killed, not
    asked: it may still be importing torch (bad input ends a run within a second). ``_stop`` is
    what CPython's own tests use; where a Python lacks it, both still end with the launcher."""
    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is not None:
        try:
            os.kill(server._forkserver_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for helper in (server, getattr(resource_tracker, "_resource_tracker", None)):
        if hasattr(helper, "_stop"):
            helper._stop()


def starts_ranks(argv: list[str]) -> bool:
    """Whether this command line will start local ranks: a run (its words are all options; a
    subcommand's first word is its name) or ``emulate``, not under torchrun, not --help,
    --dry-run or --version. Judged
    from the words alone, before they are parsed: a wrong guess costs an idle forkserver for a
    moment, never a wrong result."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return False
    words = argv[1:] if argv[:1] in (["run"], *([name] for name in RUNNING_SUBCOMMANDS)) else argv
    if words and not words[0].startswith("-"):
        return False
    return not any(word in RUN_ONLY_FLAGS for word in words)
