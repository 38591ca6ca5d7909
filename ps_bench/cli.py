"""``bench.py``: one run (options from ``RunConfig``), or a subcommand from ``SUBCOMMANDS``.

Errors in the input exit with status 2 and one line; a failed rank with status 1, named by
role and rank; Ctrl-C and SIGTERM with 130 and 143, once every process is stopped.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import platform
import shutil
import signal
import sys
import textwrap
import time
import traceback
from types import ModuleType
from typing import NoReturn

from tabulate import tabulate

import ps_bench
from ps_bench.registry import did_you_mean
from ps_bench.runtime import network, preload, streams
from ps_bench.config import ConfigError, RunConfig
from ps_bench.runfiles import build_config
from ps_bench.places import check_results_file
from ps_bench.runtime.failures import Terminated, raise_terminated
from ps_bench.job import cuda_device_count, default_servers, validate
from ps_bench.processes.launch import (JobFailed, LaunchSpec, run_torchrun_rank, spawn,
                                       under_torchrun)
from ps_bench.results.files import results_path
from ps_bench.options import (EXIT_FAILED, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE,
                              HelpFormatter, Parser, add_run_options, parse_run_options, plural,
                              usage_error)
from ps_bench.runtime.topology import Topology

# name -> (module, usage, summary, docs page). Each module has DESCRIPTION and EPILOG (its --help),
# add_arguments(parser) and either main(args, bench_argv) -> exit status, raising ConfigError for
# bad input, or run_argv(args, bench_argv) -> the run's own command line, which this module runs
# (a subcommand that is one run of this machine's launcher, set up another way); BENCH_OPTIONS =
# True: it takes run options after "--", handed to it as bench_argv; an optional
# check(args, bench_argv) checks what main would before it starts or writes anything. A new
# subcommand is its module and one line here.
SUBCOMMANDS = {
    "sweep": ("ps_bench.sweep", "FILE --out DIR",
              "every point of a sweep file, fresh ranks for each", "docs/sweeps.md"),
    "report": ("ps_bench.report", "DIR|FILE...", "compare runs: table, speedups, CSV, plot",
               "docs/sweeps.md"),
    "compare": ("ps_bench.compare", "BASE NEW",
                "did it get faster? changes, 95 % intervals, verdicts, a CI gate",
                "docs/compare.md"),
    "slurm": ("ps_bench.cluster.slurm", "--nodes N -- [options]",
              "an sbatch script: one torchrun per node (--submit runs it)", "docs/clusters.md"),
    "launch": ("ps_bench.cluster.hosts", "--hosts H1,H2 -- [options]",
               "one torchrun per host of your own, over ssh", "docs/clusters.md"),
    "cloud": ("ps_bench.cluster.cloud", "--nodes N -- [options]",
              "a SkyPilot task YAML for cloud machines", "docs/clusters.md"),
    "emulate": ("ps_bench.cluster.emulate", "--link RATE -- [options]",
                "a cluster's network on this machine: every rank behind a shaped link",
                "docs/clusters.md"),
    "predict": ("ps_bench.predict.command", "RESULTS.json... --trainers N,...",
                "batch time at scale, calibrated on runs you made", "docs/predict.md"),
}
DESCRIPTION = """\
Benchmark gradient synchronisation for data-parallel PyTorch training: DDP all-reduce,
parameter servers over TensorPipe RPC, and hooks that combine them. One job is
trainers + servers + 1 master processes; the master runs warmup rounds, then timed rounds,
prints per-role statistics (ms) and writes a JSON results file.
"""

EXAMPLES = """\
examples:
  python bench.py                                          # 2 trainers, 1 server, CPU
  python bench.py --ntrainer 3 --nserver 2 --mapping group --hook ps
  python bench.py --hook allreduce --ntrainer 4
  python bench.py --config configs/runs/upstream_ps.json --rounds 5
  python bench.py --dry-run --ntrainer 3 --nserver 2       # ranks, roles, mapping; no run
  torchrun --nproc-per-node 4 bench.py --ntrainer 2 --nserver 1   # one process per rank
  torchrun --standalone --nproc-per-node 4 --max-restarts 1 bench.py \\
      --inject-fault trainer:1:5:exit:first       # a worker lost once; torchrun restarts the job

precedence: command line > --config JSON > defaults. Every option also has an
underscore spelling (--batch_size), so upstream command lines run unchanged.
exit status: 0 ok, 1 a rank failed (named by role and rank), 2 bad input, 130/143 interrupted.

read next: docs/running.md (every option, a job, its output); README.md says which page of docs/
answers which question.
"""


def epilog() -> str:
    """The subcommands, each with its usage and summary, then the run's examples."""
    usages = {"[run]": ("[options]", "one run (the default)")}
    usages.update({name: (usage, summary) for name, (_, usage, summary, _) in SUBCOMMANDS.items()})
    width = max(len(f"bench.py {name} {usage}") for name, (usage, _) in usages.items())
    lines = [f"  {f'bench.py {name} {usage}':{width}}  {summary}"
             for name, (usage, summary) in usages.items()]
    return "subcommands (each has --help):\n" + "\n".join(lines) + "\n\n" + EXAMPLES


def build_parser() -> Parser:
    """The run's parser: every ``RunConfig`` option, and only the given ones set."""
    parser = Parser(prog="bench.py", description=DESCRIPTION, epilog=epilog(),
                    formatter_class=HelpFormatter, argument_default=argparse.SUPPRESS)
    add_run_options(parser)
    parser.add_argument("--version", action="version", version=version(),
                        help="print ps_bench's version, torch's and Python's, and exit")
    return parser


def version() -> str:
    import torch  # loaded by then: the launcher's imports need it

    return (f"ps_bench {ps_bench.__version__} (torch {torch.__version__}, "
            f"Python {platform.python_version()})")


def unknown_command(word: str) -> str | None:
    """The error for a first word that is neither a command nor an option nor a run file."""
    if word.startswith("-") or word.endswith(".json"):
        return None
    commands = ["run", *SUBCOMMANDS]
    return (f"unknown command {word!r}; {did_you_mean(word, commands)}commands: "
            f"{', '.join(commands)} (a run's options start with --)")


def subcommand_parser(name: str) -> tuple[ModuleType, Parser]:
    """A subcommand's module and its parser, whose --help ends with the docs page to read next."""
    module_name, _, _, page = SUBCOMMANDS[name]
    module = importlib.import_module(module_name)
    # as argparse wraps; the epilog keeps its own lines
    width = shutil.get_terminal_size().columns - 2
    parser = Parser(prog=f"bench.py {name}", description=textwrap.fill(module.DESCRIPTION, width),
                    epilog=f"{module.EPILOG.rstrip()}\n\nread next: {page}\n",
                    formatter_class=HelpFormatter)
    module.add_arguments(parser)
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks for errors in the input")
    return module, parser


def split_bench_argv(module: ModuleType, argv: list[str]) -> tuple[list[str], list[str]]:
    """A subcommand's own arguments, and the run options after its ``--`` (if it takes them)."""
    if getattr(module, "BENCH_OPTIONS", False) and "--" in argv:
        at = argv.index("--")
        return argv[:at], argv[at + 1:]
    return argv, []


def run_subcommand(name: str, argv: list[str], launched_at: float) -> int:
    module, parser = subcommand_parser(name)
    own, bench_argv = split_bench_argv(module, argv)
    if getattr(module, "BENCH_OPTIONS", False):
        misplaced = run_flag_among(own, parser)
        if misplaced:
            parser.error(f"{misplaced} is a run option: give run options after --, e.g. "
                         f"bench.py {name} {SUBCOMMANDS[name][1].replace('[options]', misplaced)}")
    args = parser.parse_args(own)
    args.launched_at = launched_at  # a subcommand that runs a job counts its start-up from here
    try:
        if hasattr(module, "run_argv"):
            return run(module.run_argv(args, bench_argv), launched_at, time.time())
        return module.main(args, bench_argv)
    except ConfigError as error:
        return usage_error(error, args.debug)


def spellings(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def run_flag_among(words: list[str], parser: argparse.ArgumentParser) -> str | None:
    """The first of ``words`` that is a run option and not one of ``parser``'s own flags."""
    own, run_flags = spellings(parser), spellings(build_parser())
    return next((word.split("=", 1)[0] for word in words
                 if word.split("=", 1)[0] in run_flags - own), None)


def check_run(argv: list[str], gpus: int) -> RunConfig:
    """A run's options, validated as they would be on a machine with ``gpus`` GPUs that can run
    what they ask for (root and tc for an emulated network)."""
    cfg = build_config(*parse_run_options(argv, build_parser()))
    validate(cfg, gpus=gpus, machine=False)
    return cfg


def check(argv: list[str], gpus: int = 8) -> None:
    """Checks a ``bench.py`` command line as far as it can be checked without running it or
    touching the files it names: the run's options as for ``--dry-run`` (on a machine that has
    ``gpus`` GPUs), or a subcommand's arguments, its own check and the run options after its
    ``--``. Raises ConfigError, or SystemExit as argparse does (0 for --help)."""
    if argv[:1] == ["run"]:
        argv = argv[1:]
    if not argv[:1] or argv[0] not in SUBCOMMANDS:
        check_run(argv, gpus)
        return
    module, parser = subcommand_parser(argv[0])
    own, bench_argv = split_bench_argv(module, argv[1:])
    args = parser.parse_args(own)
    if hasattr(module, "check"):
        module.check(args, bench_argv)
    elif hasattr(module, "run_argv"):
        check_run(module.run_argv(args, bench_argv), gpus=0)
    elif bench_argv:
        check_run(bench_argv, gpus)


def strategy_words(cfg: RunConfig) -> str:
    """The hook, the servers' aggregation and mapping where the job has servers, the backend."""
    servers = f", server {cfg.server}, mapping {cfg.mapping}" if cfg.num_servers else ""
    return f"hook {cfg.hook}{servers}, backend {cfg.backend}"


def job_line(cfg: RunConfig) -> str:
    """What a job is, its first line: its processes and strategy."""
    return (f"ps_bench: {cfg.world_size} processes ({plural(cfg.num_trainers, 'trainer')}, "
            f"{plural(cfg.num_servers, 'server')}, 1 master), {strategy_words(cfg)}")


def dry_run_table(cfg: RunConfig, topology: Topology, spec: LaunchSpec) -> str:
    # a strategy that sends nothing to servers leaves them idle
    idle = {} if spec.job.strategy.needs_servers else {
        "trainer": "-", "server": f"idle: --hook {cfg.hook} sends it nothing"}
    rows = []
    for info in topology.ranks:
        device = spec.device_of(info.rank)
        rows.append([
            info.rank, info.role, info.name,
            "cuda" if info.cuda_rpc else "cpu",
            "cpu" if device is None else f"cuda:{device}",
            idle.get(info.role) or topology.describe_mapping(info),
        ])
    header = (f"{topology.world_size} processes: {plural(topology.num_trainers, 'trainer')}, "
              f"{plural(topology.num_servers, 'server')}, 1 master; {strategy_words(cfg)}")
    headers = ["rank", "role", "rpc name", "rpc tensors", "device", "mapping"]
    if cfg.emulate_link is not None:  # which host each rank is on, as the run will place it
        emulated = network.planned(cfg)
        header += "\n" + emulated.describe().removeprefix("ps_bench: ")
        headers.insert(3, "host")
        for row in rows:
            row.insert(3, network.host_name(emulated.host_of(row[0])))
    return header + "\n" + tabulate(rows, headers=headers)


def launch_spec(cfg: RunConfig, argv: list[str], launched_at: float, imported: float) -> LaunchSpec:
    """Validates ``cfg`` for the node this process runs on (all of the job, or torchrun's share)."""
    torchrun = under_torchrun()
    default_servers(cfg)  # the world's size counts them
    if torchrun and cfg.emulate_link is not None:
        raise ConfigError("--emulate-link emulates a network on this machine with ps_bench's own "
                          "launcher: run python bench.py emulate, not under torchrun")
    local_world_size = (int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size)) if torchrun
                        else cfg.world_size)
    node = int(os.environ.get("GROUP_RANK", 0)) if torchrun else 0
    node_ranks = range(node * local_world_size, (node + 1) * local_world_size)
    job = validate(cfg, trainers_on_node=sum(r < cfg.num_trainers for r in node_ranks))
    results = results_path(cfg.out, cfg.hook, cfg.num_trainers, cfg.num_servers)
    if cfg.world_size - 1 in node_ranks:  # the master writes it: checked before any process starts
        check_results_file(str(results), "--out")
    return LaunchSpec(job, ["bench.py", *argv], "", str(results), local_world_size,
                      cuda_device_count(), torchrun, launched_at,
                      milestones={"imported": imported, "validated": time.time()})


def run(argv: list[str], launched_at: float, imported: float) -> int:
    """One run: validated, then started here (or this rank of it, under torchrun); the forkserver
    bench.py may have started early is stopped however it ends."""
    try:
        return run_job(argv, launched_at, imported)
    finally:
        preload.stop()


def run_job(argv: list[str], launched_at: float, imported: float) -> int:
    values, config_path = parse_run_options(argv, build_parser())
    debug = bool(values.get("debug"))
    try:
        cfg = build_config(values, config_path)
        debug = cfg.debug
        spec = launch_spec(cfg, argv, launched_at, imported)
        if cfg.dry_run:
            print(dry_run_table(cfg, spec.topology(), spec))
            for note in spec.job.notes:
                print(f"ps_bench: note: {note}")
            return EXIT_OK
        if spec.torchrun:
            if int(os.environ["RANK"]) == cfg.world_size - 1:  # the master's: the job's one line
                print(job_line(cfg), flush=True)
            return run_torchrun_rank(spec)
        signal.signal(signal.SIGTERM, raise_terminated)
        # even if started with SIGINT ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(job_line(cfg), flush=True)
        for note in spec.job.notes:
            print(f"ps_bench: note: {note}", flush=True)
        return spawn(spec)
    except ConfigError as error:
        return usage_error(error, debug)
    except KeyboardInterrupt:
        sys.stderr.write("ps_bench: interrupted by SIGINT; every process was stopped\n")
        return EXIT_SIGINT
    except Terminated:
        sys.stderr.write("ps_bench: terminated by SIGTERM; every process was stopped\n")
        return EXIT_SIGTERM
    except JobFailed as error:
        if error.detail:
            sys.stderr.write(error.detail.rstrip() + "\n")
        sys.stderr.write(f"ps_bench: error: {error}\n")
        return EXIT_FAILED
    except Exception as error:  # a bug in the launcher itself
        traceback.print_exc()
        sys.stderr.write(f"ps_bench: error: {error}\n")
        return EXIT_FAILED


def main(argv: list[str] | None = None, launched_at: float | None = None) -> int:
    """``launched_at``: when the command started (``bench.py`` notes it before its imports)."""
    imported = time.time()
    streams.outlive_reader()  # `bench.py | head` ends the output, not the job
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        argv = argv[1:]
    elif argv[:1] and argv[0] in SUBCOMMANDS:
        return run_subcommand(argv[0], argv[1:], imported if launched_at is None else launched_at)
    elif argv[:1] and (unknown := unknown_command(argv[0])):
        sys.stderr.write(f"bench.py: error: {unknown} (see --help)\n")
        return EXIT_USAGE
    return run(argv, imported if launched_at is None else launched_at, imported)


def finish(code: int | None) -> NoReturn:
    """Ends the command with ``code`` as ``sys.exit`` would (exit handlers run, the standard
    streams flushed), without then tearing down every module: with torch loaded that alone takes
    about 0.35 s of every command. Every file a command writes is closed by the time it returns."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            pass
    os._exit(code or 0)


def entry_point() -> NoReturn:
    """The ``ps-bench`` command."""
    launched_at = time.time()
    if preload.starts_ranks(sys.argv[1:]):
        preload.start(debug="--debug" in sys.argv, models=preload.named_models(sys.argv[1:]))
    finish(main(launched_at=launched_at))
