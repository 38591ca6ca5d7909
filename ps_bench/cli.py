"""Command line: options come from ``RunConfig``; errors in the input exit with status 2."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

from ps_bench.config import OPTIONS, ConfigError, build_config, check_port, field_type, validate
from ps_bench.failures import Terminated

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143
# Upstream launcher flags with nothing left to choose: each takes exactly the values upstream had
# (None: any value), so upstream's command lines run unchanged and a value it never had is refused.
UPSTREAM_FIXED = {
    "filestore": None,
    "create_criterion": ("cel",),
    "create_ddp_model": ("basic_ddp_model",),
    "create_optimizer": ("sgd_optimizer",),
    "preprocess_data": ("preprocess_dummy_data",),
    "iteration_step": ("basic_iteration_step",),
    "hook_state": ("BasicHookState",),
}
# Upstream launcher flags that named JSON files ps_bench does not read: refused with what to do instead.
UPSTREAM_REFUSED = {
    "trainer_config_path": "ps_bench has no trainer configuration file: choose the trainer with --trainer and set "
                           "its options (--batch-size, --lr, --epochs, --hook) on the command line or in a --config run file",
    "server_config_path": "ps_bench has no server configuration file: choose the server with --server and the layout "
                          "with --nserver, --ncudaserver and --mapping, on the command line or in a --config run file",
}


class Refused(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        parser.error(f"{option_string}: {UPSTREAM_REFUSED[self.dest.removeprefix('refused_')]}")

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
  bench.py slurm --nodes N -- [options]   an sbatch script: one torchrun per node (--submit runs it)
  bench.py launch --hosts H1,H2 -- [options]  one torchrun per host of your own, over ssh
  bench.py cloud --nodes N -- [options]   a SkyPilot task YAML for cloud machines

examples:
  python bench.py                                          # 2 trainers, 1 server, CPU
  python bench.py --ntrainer 3 --nserver 2 --mapping group --hook ps
  python bench.py --hook allreduce --ntrainer 4 --nserver 0
  python bench.py --config configs/runs/upstream_ps.json --rounds 5
  python bench.py --dry-run --ntrainer 3 --nserver 2       # ranks, roles, mapping; no run
  torchrun --nproc-per-node 4 bench.py --ntrainer 2 --nserver 1   # one process per rank
  torchrun --standalone --nproc-per-node 4 --max-restarts 1 bench.py --inject-fault trainer:1:5:exit:first
                                                           # a worker lost once; torchrun restarts the job

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
                "data_config_path", "model_config_path", "bucket_cap_mb", "gradient_as_bucket_view", "torch_seed",
                "cuda_seed"}
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
    compat = parser.add_argument_group(
        "upstream launcher flags", "accepted so upstream's experiment command lines run unchanged; ps_bench has one "
        "way to do each, so they choose nothing (the rendezvous uses a TCP store, not --filestore)")
    for name, allowed in UPSTREAM_FIXED.items():
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
        compat.add_argument(*spellings, dest=f"ignored_{name}", choices=allowed,
                            metavar="PATH" if allowed is None else allowed[0],
                            help="ignored" if allowed is None else f"upstream's only value; anything else is refused")
    for name in UPSTREAM_REFUSED:
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
        compat.add_argument(*spellings, dest=f"refused_{name}", action=Refused, metavar="PATH",
                            help="refused, with what to use instead")
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


def usage_error(error: ConfigError, debug: bool) -> int:
    """Bad input: one line on stderr (the traceback too with --debug), and the usage exit status."""
    if debug:
        traceback.print_exc()
    sys.stderr.write(f"ps_bench: error: {error}\n")
    return EXIT_USAGE


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


SLURM_EPILOG = """\
examples:
  python bench.py slurm --nodes 2 -- --ntrainer 6 --nserver 1            # print the script
  python bench.py slurm --nodes 2 --gpus-per-node 4 --partition gpu --time 00:30:00 \\
      --iface eth1 -o job.sbatch -- --ntrainer 6 --nserver 1 --backend nccl
  python bench.py slurm --nodes 2 --submit -- --ntrainer 2 --nserver 1  # sbatch --wait, its status

The bench options after -- are checked here first (bad ones exit 2 before anything queues).
nodes x processes per node must equal the job's trainers + servers + 1; the master (last rank)
runs on the last node, which writes the results file (--out, relative to the submit folder).
The job's log is %x-%j.out (job name, job id).
"""


def slurm_parser() -> Parser:
    parser = Parser(prog="bench.py slurm", description=(
        "Write an sbatch script that runs this benchmark on N nodes: srun starts one task per node, each "
        "starts a torchrun agent (static rendezvous, the first node hosts the store, node rank from "
        "$SLURM_NODEID), and torchrun starts and supervises the ranks."),
        epilog=SLURM_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", required=True, type=typed(int, "nodes"), metavar="N", help="nodes to use")
    parser.add_argument("--gpus-per-node", type=typed(int, "gpus-per-node"), default=0, metavar="G",
                        help="GPUs to ask for on each node (default: 0)")
    parser.add_argument("--partition", metavar="P", help="SLURM partition (default: the cluster's)")
    parser.add_argument("--time", metavar="T", help="time limit, e.g. 00:30:00 (default: the partition's)")
    parser.add_argument("--job-name", default="ps_bench", metavar="J", help="job name (default: ps_bench)")
    parser.add_argument("--iface", metavar="NAME", help="network interface between the nodes: exported as "
                        "TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, checked on each node")
    parser.add_argument("--port", type=typed(int, "port"), default=29500, metavar="P",
                        help="port of torchrun's store on the first node (default: 29500)")
    parser.add_argument("--max-restarts", type=typed(int, "max-restarts"), default=0, metavar="K",
                        help="torchrun restarts the whole job up to K times after a failure (default: 0)")
    parser.add_argument("--python", default=sys.executable, metavar="PATH",
                        help=f"interpreter on the nodes (default: this one, {sys.executable})")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the script here instead of printing it")
    parser.add_argument("--submit", action="store_true", help="submit with sbatch --wait and exit with the "
                        "job's status")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors in the input")
    return parser


def split_bench_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[own options] -- [bench options]``."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def bench_values(argv: list[str]) -> tuple[dict[str, Any], str | None]:
    """Parses bench options (a bad flag exits 2 with one line); returns them and --config."""
    args = vars(build_parser().parse_args(argv))
    config_path = args.pop("config", None)
    return {k: v for k, v in args.items() if not k.startswith("ignored_")}, config_path


UNKNOWN_GPUS = -1


def cluster_job(bench_argv: list[str], nodes: int, gpus_per_node: int, hosts: bool = False):
    """Validates bench options for a job of ``nodes`` nodes as it will run there; returns the
    config and the layout. The interface is checked by each node when its ranks start."""
    from ps_bench.cluster.torchrun import layout_for, trainers_per_node

    values, config_path = bench_values(bench_argv)
    cfg = build_config(values, config_path)
    cfg.iface = None
    layout = layout_for(cfg, nodes, hosts)
    wants_cuda = cfg.backend != "gloo" or cfg.ncudatrainer or cfg.ncudaserver
    if gpus_per_node == UNKNOWN_GPUS:  # hosts of one's own: assume what the options ask for, each host checks
        gpus_per_node = trainers_per_node(cfg, layout) + cfg.ncudaserver if wants_cuda else 0
    if wants_cuda and gpus_per_node < 1:
        raise ConfigError("the bench options use CUDA (--backend nccl/multi, --ncudatrainer or --ncudaserver): "
                          "set --gpus-per-node")
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be 0 or more; got {gpus_per_node}")
    validate(cfg, gpus=gpus_per_node, trainers_on_node=trainers_per_node(cfg, layout))
    return cfg, layout


def run_slurm(argv: list[str]) -> int:
    from ps_bench.cluster import slurm

    own, bench_argv = split_bench_options(argv)
    args = slurm_parser().parse_args(own)
    try:
        check_port("--port", args.port)
        if args.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more; got {args.max_restarts}")
        cfg, layout = cluster_job(bench_argv, args.nodes, args.gpus_per_node)
        job = slurm.SlurmJob(
            layout, slurm.bench_args_with_iface(bench_argv, args.iface), job_name=args.job_name,
            gpus_per_node=args.gpus_per_node, partition=args.partition, time=args.time, iface=args.iface,
            port=args.port, max_restarts=args.max_restarts, python=args.python,
            summary=f"{plural(cfg.num_trainers, 'trainer')}, {plural(cfg.num_servers, 'server')}, 1 master")
        script = slurm.sbatch_script(job)
        if args.submit:
            return slurm.submit(script, args.output)
        slurm.write_or_print(script, args.output)
        return EXIT_OK
    except ConfigError as error:
        return usage_error(error, args.debug)


LAUNCH_EPILOG = """\
examples:
  python bench.py launch --hosts node1,node2 -- --ntrainer 6 --nserver 1
  python bench.py launch --hostfile hosts.txt --ssh-key ~/.ssh/bench --iface eth1 \\
      --python /opt/venv/bin/python --workdir /srv/ps_bench -- --ntrainer 6 --nserver 1 --out results/r.json
  python bench.py launch --hosts alice@10.0.0.1,alice@10.0.0.2 --ssh-option StrictHostKeyChecking=accept-new -- --rounds 3

A hostfile lists one [user@]host per line, optionally with slots=N (DeepSpeed's and MPI's
format; N must be the processes per host). Every host must be reachable with ssh without a
password, and have ps_bench and torch at this machine's versions (checked first). The first
host hosts torchrun's store (--port); the last host runs the master and writes the results
file (--out, relative to --workdir). Ctrl-C or a failed host stops every host's processes.
"""


def launch_parser() -> Parser:
    parser = Parser(prog="bench.py launch", description=(
        "Run this benchmark on your own hosts: one torchrun agent per host, started over OpenSSH's ssh "
        "(static rendezvous; node ranks in host order), each host's output prefixed with its name."),
        epilog=LAUNCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    hosts = parser.add_mutually_exclusive_group(required=True)
    hosts.add_argument("--hosts", metavar="[USER@]H1,H2,...", help="the hosts, the first one is the head")
    hosts.add_argument("--hostfile", metavar="FILE", help="the hosts, one per line ([user@]host [slots=N])")
    parser.add_argument("--ssh-key", metavar="FILE", help="private key for ssh -i (default: ssh's own choice)")
    parser.add_argument("--ssh-port", type=typed(int, "ssh-port"), metavar="P", help="sshd's port on every host")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to ssh as -o KEY=VALUE (repeat for more)")
    parser.add_argument("--iface", metavar="NAME", help="network interface between the hosts: exported as "
                        "TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, checked on each host")
    parser.add_argument("--python", default="python3", metavar="PATH",
                        help="interpreter on the hosts; an ssh session has a bare PATH, so prefer an absolute "
                             "path (default: python3)")
    parser.add_argument("--workdir", metavar="DIR", help="folder to run in on every host (default: the login folder)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job on every host (repeat for more)")
    parser.add_argument("--port", type=typed(int, "port"), default=29500, metavar="P",
                        help="port of torchrun's store on the first host (default: 29500)")
    parser.add_argument("--master-addr", metavar="ADDR", help="address the hosts reach the first host at "
                        "(default: the first host's name as given)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors in the input")
    return parser


def run_launch(argv: list[str]) -> int:
    from ps_bench.cluster import hosts
    from ps_bench.topology import Topology

    own, bench_argv = split_bench_options(argv)
    args = launch_parser().parse_args(own)
    try:
        targets = hosts.parse_hosts(args.hosts) if args.hosts else hosts.read_hostfile(args.hostfile)
        check_port("--port", args.port)
        env = {}
        for item in args.env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ConfigError(f"--env: expected KEY=VALUE; got {item!r}")
            env[key] = value
        cfg, layout = cluster_job(bench_argv, len(targets), UNKNOWN_GPUS, hosts=True)
        hosts.check_targets(targets, layout)
        job = hosts.HostJob(targets, layout, [*bench_argv, *(["--iface", args.iface] if args.iface else [])],
                            hosts.SshOptions(args.ssh_key, args.ssh_port, args.ssh_option), python=args.python,
                            workdir=args.workdir, env=env, iface=args.iface, port=args.port,
                            master_addr=args.master_addr)
        hosts.preflight(job)
    except ConfigError as error:
        return usage_error(error, args.debug)
    topology = Topology(cfg.ntrainer, cfg.ncudatrainer, cfg.nserver, cfg.ncudaserver, cfg.mapping,
                        cuda_collectives=cfg.backend != "gloo")
    names = ", ".join(target.host for target in targets)
    print(f"ps_bench: {layout.world_size} processes on {layout.nodes} hosts ({names}), {layout.nproc_per_node} "
          f"each; the master and the results file are on {targets[-1].host}", flush=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return hosts.run(job, lambda rank: topology.info(rank).describe())
    except hosts.HostsFailed as error:
        sys.stderr.write(f"ps_bench: error: {error}; the run was stopped on every host ({names})\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write(f"ps_bench: interrupted by SIGINT; the run was stopped on every host ({names})\n")
        return EXIT_SIGINT
    except Terminated:
        sys.stderr.write(f"ps_bench: terminated by SIGTERM; the run was stopped on every host ({names})\n")
        return EXIT_SIGTERM


CLOUD_EPILOG = """\
examples:
  python bench.py cloud --nodes 2 --accelerators H100:8 -- --ntrainer 14 --nserver 1 --backend nccl
  python bench.py cloud --nodes 2 --cloud aws --use-spot --name ps-cpu -o cpu.yaml -- --ntrainer 6 --nserver 1
  sky launch -c ps-bench ps_bench-sky.yaml    # what it prints: run it where SkyPilot is installed

The YAML copies this checkout to every node (workdir), installs torch pinned to this
machine's version and ps_bench from the checkout (setup), and starts torchrun on every node
with the static rendezvous from SKYPILOT_NODE_RANK and the first line of SKYPILOT_NODE_IPS
(run). The master runs on the last node, which writes the results file under ~/sky_workdir.
ps_bench does not need SkyPilot installed to write it.
"""


def cloud_parser() -> Parser:
    parser = Parser(prog="bench.py cloud", description=(
        "Write a SkyPilot task YAML that runs this benchmark on N cloud machines, and print the sky launch "
        "command that runs it."), epilog=CLOUD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", required=True, type=typed(int, "nodes"), metavar="N", help="machines to use")
    parser.add_argument("--accelerators", metavar="NAME[:COUNT]", help="GPUs per machine, e.g. H100:8 "
                        "(default: none)")
    parser.add_argument("--cloud", metavar="C", help="aws, gcp, azure, ... (default: SkyPilot's choice)")
    parser.add_argument("--use-spot", action="store_true", help="spot instances")
    parser.add_argument("--name", default="ps-bench", metavar="J", help="task and cluster name (default: ps-bench)")
    parser.add_argument("--iface", metavar="NAME", help="network interface between the machines: exported as "
                        "TP_SOCKET_IFNAME and GLOO_SOCKET_IFNAME, checked on each machine")
    parser.add_argument("--port", type=typed(int, "port"), default=29500, metavar="P",
                        help="port of torchrun's store on the first machine (default: 29500)")
    parser.add_argument("-o", "--output", default="ps_bench-sky.yaml", metavar="FILE",
                        help="where to write the YAML (default: ps_bench-sky.yaml)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors in the input")
    return parser


def run_cloud(argv: list[str]) -> int:
    from ps_bench.cluster import cloud

    own, bench_argv = split_bench_options(argv)
    args = cloud_parser().parse_args(own)
    try:
        check_port("--port", args.port)
        cfg, layout = cluster_job(bench_argv, args.nodes, cloud.gpus_of(args.accelerators))
        job = cloud.CloudJob(
            layout, [*bench_argv, *(["--iface", args.iface] if args.iface else [])], name=args.name,
            accelerators=args.accelerators, cloud=args.cloud, use_spot=args.use_spot, iface=args.iface,
            port=args.port,
            summary=f"{plural(cfg.num_trainers, 'trainer')}, {plural(cfg.num_servers, 'server')}, 1 master")
        Path(args.output).write_text(cloud.task_yaml(job))
    except ConfigError as error:
        return usage_error(error, args.debug)
    except OSError as error:
        sys.stderr.write(f"ps_bench: error: -o {args.output}: {error.strerror}\n")
        return EXIT_USAGE
    print(f"ps_bench: wrote {args.output}; run it with: {cloud.launch_hint(job, args.output)}")
    return EXIT_OK


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
        return usage_error(error, args.debug)


def main(argv: list[str] | None = None) -> int:
    launched_at = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        argv = argv[1:]
    if argv[:1] in (["sweep"], ["report"]):
        return run_subcommand(argv[0], argv[1:])
    if argv[:1] == ["slurm"]:
        return run_slurm(argv[1:])
    if argv[:1] == ["launch"]:
        return run_launch(argv[1:])
    if argv[:1] == ["cloud"]:
        return run_cloud(argv[1:])
    args = vars(build_parser().parse_args(argv))
    config_path = args.pop("config", None)
    cli_values = {k: v for k, v in args.items() if not k.startswith(("ignored_", "refused_"))}
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
                          cuda_device_count(), torchrun, launched_at)
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
        return usage_error(error, debug)
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
