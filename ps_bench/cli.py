"""Command line: options come from ``RunConfig``; errors in the input exit with status 2."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from ps_bench.config import OPTIONS, ConfigError, build_config, field_type, validate
from ps_bench.failures import Terminated

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143
# Upstream launcher flags with nothing left to choose: accepted so old command lines run.
UPSTREAM_IGNORED = ("filestore", "preprocess_data", "iteration_step", "hook_state", "ddp_model", "criterion")

DESCRIPTION = """\
Benchmark gradient synchronisation for data-parallel PyTorch training: DDP all-reduce,
parameter servers over TensorPipe RPC, and hooks that combine them. One job is
trainers + servers + 1 master processes; the master runs warmup rounds, then timed rounds,
prints per-role statistics (ms) and writes a JSON results file.
"""

EPILOG = """\
subcommands (each has --help):
  bench.py [run] [options]     one run (the default)
  bench.py sweep FILE --out DIR   every point of a sweep file, one process tree each
  bench.py report DIR|FILE...     compare runs: table, speedups, CSV, plot

examples:
  python bench.py                                          # 2 trainers, 1 server, CPU
  python bench.py --ntrainer 3 --nserver 2 --mapping group --hook ps
  python bench.py --hook allreduce --ntrainer 4 --nserver 0
  python bench.py --config configs/runs/upstream_ps.json --rounds 5
  python bench.py --dry-run --ntrainer 3 --nserver 2       # ranks, roles, mapping; no run
  torchrun --nproc-per-node 4 bench.py --ntrainer 2 --nserver 1   # one process per rank

precedence: command line > --config JSON > defaults. Every option also has an
underscore spelling (--batch_size), so upstream command lines run unchanged.
exit status: 0 ok, 1 a rank failed (named by role and rank), 2 bad input, 130/143 interrupted.
"""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(EXIT_USAGE)


def typed(kind: type, flag: str):
    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None

    convert.__name__ = kind.__name__
    return convert


def flags(name: str) -> list[str]:
    out = []
    for spelling in (name, *OPTIONS[name].metadata["aliases"]):
        for variant in (spelling.replace("_", "-"), spelling):
            if f"--{variant}" not in out:
                out.append(f"--{variant}")
    return out


class KeyValue(argparse.Action):
    """Collects ``KEY=VALUE`` pairs into a dict; VALUE is parsed as JSON when it can be."""

    def __call__(self, parser, namespace, value, option_string=None):
        key, sep, text = value.partition("=")
        if not sep or not key:
            parser.error(f"argument {option_string}: expected KEY=VALUE, got {value!r}")
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = text
        options = dict(getattr(namespace, self.dest, None) or {})
        options[key] = parsed
        setattr(namespace, self.dest, options)


def describe_registry(registry) -> str:
    entries = []
    for name in registry.names():
        doc = (registry.get(name).__doc__ or "").strip().splitlines()
        entries.append(f"{name}: {doc[0].rstrip('.')}" if doc else name)
    return "; ".join(entries)


def _hooks() -> str:
    from ps_bench.trainers.hooks import HOOKS

    return describe_registry(HOOKS)


def _servers() -> str:
    from ps_bench.servers import SERVERS

    return describe_registry(SERVERS)


REGISTRY_HELP = {"hook": _hooks, "server": _servers}


def metavar(name: str, kind: type) -> str:
    if name.endswith("_path") or name in ("out",):
        return "PATH"
    if name == "rpc_timeout":
        return "SECONDS"
    if name == "profile":
        return "DIR"
    return {int: "N", float: "X"}.get(kind, "NAME")


def build_parser() -> Parser:
    parser = Parser(
        prog="bench.py", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--config", "--config-file", metavar="FILE",
                        help="run options as a JSON object whose keys are these option names")
    groups = {
        "topology": parser.add_argument_group("topology"),
        "strategy": parser.add_argument_group("strategy and workload"),
        "run": parser.add_argument_group("rounds, rendezvous and output"),
    }
    topology = {"ntrainer", "ncudatrainer", "nserver", "ncudaserver", "mapping", "backend"}
    strategy = {"hook", "server", "trainer", "epochs", "batch_size", "lr", "data", "model",
                "data_config_path", "model_config_path", "bucket_cap_mb", "torch_seed", "cuda_seed"}
    for name, field in OPTIONS.items():
        group = groups["topology" if name in topology else "strategy" if name in strategy else "run"]
        meta = field.metadata
        default = field.default
        kind = field_type(name)
        help_text = meta["help"] if default is None or kind is bool else f"{meta['help']} (default: {default})"
        if name in REGISTRY_HELP:
            help_text += "; " + REGISTRY_HELP[name]()
        if kind is dict:  # hook_options: --hook-option KEY=VALUE, repeated
            group.add_argument("--hook-option", "--hook_option", dest=name, action=KeyValue, metavar="KEY=VALUE",
                               help="an option of the hook (repeat for more); VALUE is JSON (4, true, 0.5) "
                                    "or text; in a JSON run file: \"hook_options\": {...}")
        elif kind is bool:
            group.add_argument(*flags(name), dest=name, action="store_true", help=help_text)
        else:
            group.add_argument(
                *flags(name), dest=name, type=typed(kind, name), choices=meta["choices"] or None,
                metavar=None if meta["choices"] else metavar(name, kind), help=help_text,
            )
    compat = parser.add_argument_group("accepted for upstream command lines, no effect")
    for name in UPSTREAM_IGNORED:
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
        compat.add_argument(*spellings, dest=f"ignored_{name}", metavar="X",
                            help=argparse.SUPPRESS if name != "filestore" else "rendezvous uses a TCP store")
    return parser


def dry_run_table(cfg, topology, device_of) -> str:
    from tabulate import tabulate

    rows = []
    for info in topology.ranks:
        device = device_of(info.rank)
        rows.append([
            info.rank, info.role, info.name,
            "cuda" if info.cuda_rpc else "cpu",
            "cpu" if device is None else f"cuda:{device}",
            topology.describe_mapping(info),
        ])
    header = (f"{topology.world_size} processes: {plural(topology.num_trainers, 'trainer')}, "
              f"{plural(topology.num_servers, 'server')}, 1 master; hook {cfg.hook}, server {cfg.server}, mapping {cfg.mapping}, backend {cfg.backend}")
    return header + "\n" + tabulate(rows, headers=["rank", "role", "rpc name", "rpc tensors", "device", "mapping"])


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def sweep_parser() -> Parser:
    parser = Parser(prog="bench.py sweep", description=(
        "Run every point of a sweep file, each in its own process tree, appending one JSON line per "
        "point to OUT/results.jsonl (logs in OUT/logs/). A sweep file is {\"name\": ..., \"base\": {options}, "
        "\"grid\": {option: [values]}, \"variants\": [{\"name\": ..., option: value}]}: the points are the "
        "cartesian product of grid (times each variant), each base plus its overrides."),
        epilog="example: python bench.py sweep configs/sweeps/hooks.json --out results/hooks && "
               "python bench.py report results/hooks")
    parser.add_argument("file", metavar="FILE", help="sweep file (JSON)")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for results.jsonl, logs and point files")
    parser.add_argument("--resume", action="store_true",
                        help="skip points already recorded ok in OUT (same resolved configuration); re-run the rest")
    parser.add_argument("--point-timeout", type=typed(float, "point-timeout"), default=900.0, metavar="SECONDS",
                        help="stop a point that runs longer than this and record it as failed (default: 900)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors in the input")
    return parser


def report_parser() -> Parser:
    parser = Parser(prog="bench.py report", description=(
        "Compare runs: one row per point, with the options that vary across points, p50 and p90 of a "
        "metric, samples/s, bytes per iteration, gradient error (runs with --verify) and the speedup "
        "against a baseline point."),
        epilog="example: python bench.py report results/hooks --baseline hook=allreduce --csv hooks.csv "
               "--plot hooks.png")
    parser.add_argument("sources", nargs="+", metavar="DIR|FILE",
                        help="sweep folders (their results.jsonl), .jsonl files or results files")
    parser.add_argument("--baseline", metavar="KEY=VALUE", help="the point speedups are measured against "
                        "(default: the first point)")
    parser.add_argument("--metric", default="batch", metavar="NAME",
                        help="summary metric to compare, e.g. batch, comm, backward, round (default: batch)")
    parser.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the comparison (needs the 'plot' extra)")
    parser.add_argument("--scaling", action="store_true",
                        help="per-iteration time for each trainers x servers point next to the analytic "
                             "parameter-server bound and BytePS's optimum (bandwidth: --link-gbps, else each "
                             "point's memcpy floor from --limits)")
    parser.add_argument("--link-gbps", type=typed(float, "link-gbps"), metavar="X",
                        help="bandwidth B in GB/s for --scaling (default: each point's memcpy floor)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors in the input")
    return parser


def run_subcommand(command: str, argv: list[str]) -> int:
    args = (sweep_parser() if command == "sweep" else report_parser()).parse_args(argv)
    try:
        if command == "sweep":
            from ps_bench.sweep import run_sweep

            signal.signal(signal.SIGINT, signal.default_int_handler)
            return run_sweep(args.file, args.out, args.resume, args.point_timeout,
                             bench=Path(__file__).resolve().parent.parent / "bench.py")
        from ps_bench.report import run_report

        if args.link_gbps is not None and args.link_gbps <= 0:
            raise ConfigError(f"--link-gbps must be positive; got {args.link_gbps}")
        return run_report(args.sources, args.baseline, args.metric, args.csv, args.plot, args.scaling,
                          args.link_gbps)
    except ConfigError as error:
        if args.debug:
            traceback.print_exc()
        sys.stderr.write(f"ps_bench: error: {error}\n")
        return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        argv = argv[1:]
    if argv[:1] in (["sweep"], ["report"]):
        return run_subcommand(argv[0], argv[1:])
    args = vars(build_parser().parse_args(argv))
    config_path = args.pop("config", None)
    cli_values = {k: v for k, v in args.items() if not k.startswith("ignored_")}
    debug = bool(cli_values.get("debug"))
    try:
        from ps_bench.config import cuda_device_count
        from ps_bench.launch import LaunchSpec, run_torchrun_rank, spawn, under_torchrun
        from ps_bench.metrics.results import default_results_path

        cfg = build_config(cli_values, config_path)
        debug = cfg.debug
        torchrun = under_torchrun()
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size)) if torchrun else cfg.world_size
        node = int(os.environ.get("GROUP_RANK", 0)) if torchrun else 0
        node_ranks = range(node * local_world_size, (node + 1) * local_world_size)
        model, data = validate(cfg, trainers_on_node=sum(r < cfg.num_trainers for r in node_ranks))
        results_path = cfg.out or str(default_results_path(cfg.hook, cfg.num_trainers, cfg.num_servers))
        spec = LaunchSpec(cfg, model, data, ["bench.py", *argv], "", results_path, local_world_size,
                          cuda_device_count(), torchrun)
        if cfg.dry_run:
            print(dry_run_table(cfg, spec.topology(), spec.device_of))
            return EXIT_OK
        if torchrun:
            return run_torchrun_rank(spec)
        signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
        print(f"ps_bench: {cfg.world_size} processes ({plural(cfg.num_trainers, 'trainer')}, "
              f"{plural(cfg.num_servers, 'server')}, 1 master), hook {cfg.hook}, server {cfg.server}, "
              f"mapping {cfg.mapping}, backend {cfg.backend}", flush=True)
        return spawn(spec)
    except ConfigError as error:
        if debug:
            traceback.print_exc()
        sys.stderr.write(f"ps_bench: error: {error}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("ps_bench: interrupted by SIGINT; every process was stopped\n")
        return EXIT_SIGINT
    except Terminated:
        sys.stderr.write("ps_bench: terminated by SIGTERM; every process was stopped\n")
        return EXIT_SIGTERM
    except Exception as error:  # JobFailed, or a bug in the launcher itself
        from ps_bench.launch import JobFailed

        if isinstance(error, JobFailed):
            if error.detail:
                sys.stderr.write(error.detail.rstrip() + "\n")
        else:
            traceback.print_exc()
        sys.stderr.write(f"ps_bench: error: {error}\n")
        return EXIT_FAILED


def entry_point() -> NoReturn:
    sys.exit(main())
