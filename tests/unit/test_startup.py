"""Start-up bookkeeping without ranks: which command lines start ranks (and so warm the
forkserver early), how rank milestones become phases, and what the default job imports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ps_bench.processes.master import ready_words, short_warmup_warning
from ps_bench.processes.rendezvous import crowded_warning
from ps_bench.processes.supervision import supervise
from ps_bench.metrics.startup import render_startup, startup_phases
from ps_bench.runtime.preload import LONGEST_TMPDIR, PRELOAD, starts_ranks
from ps_bench.strategies import HOOKS
from ps_bench.strategies.stale import STALE_SYNCHRONOUS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, starts", [
    ([], True),
    (["--ntrainer", "4", "--hook", "allreduce"], True),
    (["run", "--rounds", "3"], True),
    (["--dry-run"], False),
    (["--version"], False),
    (["--ntrainer", "4", "--help"], False),
    (["sweep", "configs/sweeps/hooks.json", "--out", "r"], False),
    (["report", "r"], False),
    (["slurm", "--nodes", "2", "--", "--ntrainer", "2"], False),
    (["emulate", "--link", "1gbit", "--", "--ntrainer", "2"], True),
    (["emulate", "--help"], False),
])
def test_which_command_lines_start_ranks(argv, starts, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert starts_ranks(argv) is starts


def test_under_torchrun_no_forkserver_is_started(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert starts_ranks([]) is False


def test_phases_follow_the_last_rank_to_reach_each_milestone():
    launcher = {"launched": 100.0, "imported": 102.0, "validated": 102.25}
    ranks = [{"started": 103.0, "joined": 103.1, "grouped": 103.5, "connected": 104.0},
             {"started": 102.5, "joined": 103.3, "grouped": 103.3, "connected": 104.25}]
    phases = startup_phases(launcher, ranks, servers_at=104.5, ready_at=105.0)
    assert phases == {"launcher imports": 2.0, "validation": 0.25, "ranks started": 0.75, "rendezvous": 0.3,
                      "trainers' process group": 0.2, "RPC": 0.75, "servers created": 0.25,
                      "trainers built (DDP)": 0.5, "total": 5.0}
    assert sum(seconds for phase, seconds in phases.items() if phase != "total") == pytest.approx(phases["total"])
    assert render_startup(phases).endswith("trainers built (DDP) 0.50; ready after 5.00")


def test_without_a_launcher_of_ours_the_phases_start_at_the_ranks():
    """Under torchrun each rank is its own launcher: only the rank milestones are known."""
    phases = startup_phases({"launched": 10.0}, [{"started": 11.0, "joined": 11.5, "grouped": 11.5,
                                                  "connected": 12.0}], servers_at=12.0, ready_at=12.5)
    assert "launcher imports" not in phases and phases["ranks started"] == 1.0 and phases["total"] == 2.5


class EndsBetweenReadings:
    """A rank that has ended by the second time its exit code is read: the window real processes
    hit only now and then (the last ranks of a job end together), held open on purpose."""

    def __init__(self) -> None:
        self.reads = 0
        read, self.write_end = os.pipe()
        self.sentinel = read
        os.write(self.write_end, b"x")  # its sentinel is ready: it has ended

    @property
    def exitcode(self) -> int | None:
        self.reads += 1
        return None if self.reads == 1 else 0


def test_supervise_returns_when_the_last_ranks_end_between_two_readings():
    processes = [EndsBetweenReadings(), EndsBetweenReadings()]
    started = time.monotonic()
    supervise(None, processes, watchdog=(30.0, "--timeout"))
    assert time.monotonic() - started < 5  # not the watchdog's 30 s, nor for ever without one


def test_more_cpu_trainers_than_a_machines_cpus_is_said_once_per_machine():
    def host(name, ranks, machine, cpus=2):
        return {"hostname": name, "address": "10.0.0.1", "ranks": ranks, "cpus": cpus, "machine": machine}

    # three trainers on two CPUs; the master and the server do not count
    assert crowded_warning([host("vm", [0, 1, 2, 3, 4], "m1")], {0, 1, 2}) == (
        "ps_bench: warning: 3 CPU trainers on 2 CPUs (vm): batch times include waiting for a CPU, beside compute "
        "and communication; give each trainer a CPU of its own for times that hold elsewhere")
    # emulated hosts are one machine: counted together
    emulated = [host("emulated-h0", [0, 1], "m1"), host("emulated-h1", [2, 3, 4], "m1")]
    assert "4 CPU trainers on 2 CPUs (emulated-h0, emulated-h1)" in crowded_warning(emulated, {0, 1, 2, 3})
    # two machines of two trainers each, or trainers on GPUs: nothing to say
    assert crowded_warning([host("a", [0, 1], "m1"), host("b", [2, 3, 4], "m2")], {0, 1, 2, 3}) is None
    assert crowded_warning([host("vm", [0, 1, 2, 3, 4], "m1")], set()) is None


def test_a_warmup_of_fewer_than_two_iterations_is_named_with_the_rounds_that_cover_them():
    """DDP rebuilds its buckets in the second iteration (DummyModel's ps run here: 334, 197, then
    about 110 ms): a warmup that leaves it timed says so, and how many rounds leave it out."""
    assert short_warmup_warning(1, 1) == (
        "ps_bench: warning: --warmup-rounds 1 of 1 iteration each leaves iteration 2 among the timed ones, "
        "where DDP rebuilds its buckets and the optimizer and hooks make what they keep; --warmup-rounds 2 "
        "times only what follows")
    assert "leaves iterations 1 and 2 among" in short_warmup_warning(0, 32)
    assert short_warmup_warning(0, 32).endswith("--warmup-rounds 1 times only what follows")
    assert short_warmup_warning(0, 3).endswith("--warmup-rounds 1 times only what follows")
    assert short_warmup_warning(0, 1).endswith("--warmup-rounds 2 times only what follows")
    assert short_warmup_warning(1, 2) is None and short_warmup_warning(2, 1) is None
    assert short_warmup_warning(0, 0) is None  # no iteration at all: refused elsewhere


@pytest.mark.parametrize("hook, servers, words", [
    ("ps", 1, "every rank started, servers created, DDP built on every trainer"),
    ("allreduce", 0, "every rank started, DDP built on every trainer"),
    ("fsdp", 0, "every rank started, every trainer's model sharded (FSDP2)"),
    (STALE_SYNCHRONOUS, 1, "every rank started, servers created, every trainer's model built"),
    ("deepspeed_zero2", 0, "every rank started, every trainer's engine built"),
])
def test_ready_names_what_the_job_built(hook, servers, words):
    """"ready after N s" said "servers created, DDP built on every trainer" of every job: of
    --hook allreduce, which starts no server, and of fsdp, which builds no DDP."""
    record = HOOKS.record(hook) if isinstance(hook, str) else hook
    assert ready_words(record, servers) == words


# What only some runs need, and what it costs every command that imports it (development machine)
LAUNCHER_NEVER = ("torch.distributed.checkpoint",  # DCP: --checkpoint-every (0.7 s, with DTensor)
                  "torch.distributed.tensor", "sympy",  # FSDP2, DCP and the compiler's
                  "torch._dynamo", "torch._inductor",  # a rank's DDP and --compile: the forkserver's
                  "torch.utils.flop_counter",  # a model of sequences' FLOPs (0.2 s)
                  "transformers", "deepspeed", "torchft", "matplotlib", "skypilot", "sky")
RANKS_NEVER = ("torch.distributed.checkpoint", "transformers", "deepspeed", "torchft", "matplotlib")


def loaded_after(*statements: str) -> list[set[str]]:
    """The modules loaded after each statement in turn, in one interpreter."""
    probe = "import sys\n" + "".join(f"{statement}\nprint(' '.join(sys.modules))\n"
                                      for statement in statements)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, check=True)
    return [set(line.split()) for line in done.stdout.splitlines()]


def test_the_default_jobs_imports_take_nothing_only_some_runs_need():
    """The module list, not a time: the launcher's imports (``bench.py`` before it starts ranks)
    and the forkserver's preload, which every local rank starts from, hold no package that only
    some feature needs; that feature imports it where it runs."""
    launcher, ranks = loaded_after("import ps_bench.cli, ps_bench.job",
                                   "; ".join(f"import {module}" for module in PRELOAD))
    assert not {name for name in launcher for heavy in LAUNCHER_NEVER
                if name == heavy or name.startswith(heavy + ".")}
    assert not {name for name in ranks for heavy in RANKS_NEVER
                if name == heavy or name.startswith(heavy + ".")}
    assert "torch._dynamo" in ranks  # what DDP's constructor imports, once for every rank


def test_a_temporary_folder_too_long_for_the_forkservers_socket_still_starts_it():
    """A TMPDIR one byte longer than the forkserver's socket path allows (a cluster job's own, a
    test's): the forkserver starts all the same, its socket in a folder under /tmp that is gone
    once the launcher ends; a TMPDIR that fits keeps it. (Under /tmp: a test's own folder may be
    longer than either.)"""
    base = Path(tempfile.mkdtemp(prefix="psb-", dir="/tmp"))
    try:
        for extra in (0, 1):
            folder = base / f"{extra}-".ljust(LONGEST_TMPDIR + extra - len(str(base)) - 1, "x")
            folder.mkdir()
            assert len(str(folder)) == LONGEST_TMPDIR + extra
            probe = ("from multiprocessing import util; from ps_bench.runtime import preload; preload.start(); "
                     "print(util.get_temp_dir()); preload.stop()")
            done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                                  cwd=Path(__file__).resolve().parents[2], env={**os.environ, "TMPDIR": str(folder)})
            assert done.returncode == 0, done.stderr
            used = Path(done.stdout.strip())
            assert used.parent == (Path("/tmp") if extra else folder) and not used.exists()
    finally:
        shutil.rmtree(base)
