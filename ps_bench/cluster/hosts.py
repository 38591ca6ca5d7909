"""``bench.py launch``: one torchrun agent per host of your own, started over OpenSSH's ``ssh``.

OpenSSH's client is on every machine that has hosts to reach, reads the user's own keys,
agents and ``~/.ssh/config``, and needs nothing installed on our side. Each agent runs under
``ssh -tt``: with a terminal, closing the connection hangs up the remote session, so
stopping the local ``ssh`` stops torchrun there, and torchrun stops its ranks (without a
terminal, sshd leaves the remote command running). torchrun supervises the ranks; this
module only watches the ``ssh`` clients: the first host whose agent fails ends the run on
every host.
"""

from __future__ import annotations

import argparse
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Sequence

from ps_bench.cluster.ssh import (HostJob, HostsFailed, SshOptions, Target, agent_command,
                                  preflight, preflight_command, run)
from ps_bench.cluster.torchrun import (UNKNOWN_GPUS, NodeLayout, add_engine_arguments, cluster_job,
                                       with_iface)
from ps_bench.config import ConfigError, RunConfig, not_text
from ps_bench.options import EXIT_FAILED, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, plural, typed
from ps_bench.places import check_port
from ps_bench.runtime.failures import Terminated, raise_terminated
from ps_bench.runtime.topology import Topology

BENCH_OPTIONS = True
DESCRIPTION = (
    "Run this benchmark on your own hosts: one torchrun agent per host, started over OpenSSH's ssh "
    "(static rendezvous; node ranks in host order), each host's output prefixed with its name.")
EPILOG = ("""\
examples:
  python bench.py launch --hosts node1,node2 -- --ntrainer 6 --nserver 1
  python bench.py launch --hostfile hosts.txt --ssh-key ~/.ssh/bench --iface eth1 \\
      --python /opt/venv/bin/python --workdir /srv/ps_bench -- --ntrainer 6 --nserver 1 """
          """--out results/r.json
  python bench.py launch --hosts alice@10.0.0.1,alice@10.0.0.2 """
          """--ssh-option StrictHostKeyChecking=accept-new -- --rounds 3

A hostfile lists one [user@]host per line, optionally with slots=N (DeepSpeed's and MPI's
format; N must be the processes per host). Every host must be reachable with ssh without a
password, and have ps_bench and torch at this machine's versions (checked first). The first
host hosts torchrun's store (--port); the last host runs the master and writes the results
file (--out, relative to --workdir). Ctrl-C or a failed host stops every host's processes.
""")


# -- reading hosts ------------------------------------------------------------------------------
def parse_hosts(text: str) -> list[Target]:
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ConfigError("--hosts: expected [user@]host[,[user@]host...]; got none")
    if not all(items):
        raise ConfigError(f"--hosts {text!r}: a host between two commas, or after the last, is "
                          f"empty")
    return [Target(item) for item in items]


def read_hostfile(path: str) -> list[Target]:
    """One host per line, ``[user@]host [slots=N]`` (DeepSpeed's and MPI's format); # comments."""
    try:
        lines = Path(path).read_text().splitlines()
    except UnicodeDecodeError as error:
        raise ConfigError(f"--hostfile {path!r} is {not_text(error)}") from None
    except OSError as error:
        raise ConfigError(f"--hostfile {path!r} cannot be read: {error.strerror}") from None
    targets = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = None
        for word in words[1:]:
            match = re.fullmatch(r"slots=(\d+)", word)
            if match is None:
                raise ConfigError(f"--hostfile {path}:{number}: expected '[user@]host [slots=N]'; "
                                  f"got {line.strip()!r}")
            slots = int(match.group(1))
        targets.append(Target(words[0], slots))
    if not targets:
        raise ConfigError(f"--hostfile {path!r} lists no hosts")
    return targets


def check_targets(targets: Sequence[Target], layout: NodeLayout) -> None:
    seen = set()
    for target in targets:
        if target.destination in seen:
            raise ConfigError(f"host {target.destination} is listed twice; list each host once")
        seen.add(target.destination)
        if target.slots is not None and target.slots != layout.nproc_per_node:
            raise ConfigError(f"the hostfile gives {target.destination} slots={target.slots}, "
                              f"but this job runs {plural(layout.nproc_per_node, 'process')} on "
                              f"each of its {plural(layout.nodes, 'host')}")


# -- the command line --------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    hosts = parser.add_mutually_exclusive_group(required=True)
    hosts.add_argument("--hosts", metavar="[USER@]H1,H2,...",
                       help="the hosts, the first one is the head")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="the hosts, one per line ([user@]host [slots=N])")
    parser.add_argument("--ssh-key", metavar="FILE",
                        help="private key for ssh -i (default: ssh's own choice)")
    parser.add_argument("--ssh-port", type=typed(int, "ssh-port"), metavar="P",
                        help="sshd's port on every host")
    parser.add_argument("--ssh-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to ssh as -o KEY=VALUE (repeat for more)")
    add_engine_arguments(parser, node="host")
    parser.add_argument("--python", default="python3", metavar="PATH",
                        help="interpreter on the hosts; an ssh session has a bare PATH, so prefer "
                             "an absolute path (default: python3)")
    parser.add_argument("--workdir", metavar="DIR",
                        help="folder to run in on every host (default: the login folder)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the job on every host (repeat for more)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the ssh commands for each host (the version check, then the "
                             "torchrun agent) and run none; reaches no host")
    parser.add_argument("--master-addr", metavar="ADDR",
                        help="address the hosts reach the first host at "
                             "(default: the first host's name as given)")


def parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"--env: expected KEY=VALUE, KEY a variable's name (letters, digits "
                              f"and _, not first a digit); got {item!r}")
        env[key] = value
    return env


def check_ssh(args: argparse.Namespace) -> None:
    """What ssh would refuse only once it runs, refused before any host is reached."""
    if args.ssh_port is not None:
        check_port("--ssh-port", args.ssh_port)
    for option in args.ssh_option:
        key, sep, _ = option.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z]+", key):
            raise ConfigError(f"--ssh-option: expected KEY=VALUE, KEY an ssh_config keyword (e.g. "
                              f"StrictHostKeyChecking=accept-new); got {option!r}")
    if not args.python.strip():
        raise ConfigError("--python: expected the interpreter on the hosts, e.g. "
                          "/opt/venv/bin/python; got an empty one")


def check(args: argparse.Namespace,
          bench_argv: list[str]) -> tuple[list[Target], RunConfig, NodeLayout]:
    """The hosts (the hostfile read), the engine's options and the bench options, before any host
    is reached."""
    targets = parse_hosts(args.hosts) if args.hostfile is None else read_hostfile(args.hostfile)
    parse_env(args.env)
    check_ssh(args)
    cfg, layout = cluster_job(args, bench_argv, len(targets), UNKNOWN_GPUS, hosts=True)
    check_targets(targets, layout)
    return targets, cfg, layout


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    targets, cfg, layout = check(args, bench_argv)
    env = parse_env(args.env)
    job = HostJob(targets, layout, with_iface(bench_argv, args.iface),
                  SshOptions(args.ssh_key, args.ssh_port, args.ssh_option), python=args.python,
                  workdir=args.workdir, env=env, iface=args.iface, port=args.port,
                  master_addr=args.master_addr)
    if args.dry_run:  # what would run on each host; no host is reached
        for node, target in enumerate(targets):
            print(f"# {target.host} (node {node}): the check, then the agent")
            print(shlex.join(preflight_command(job, target)))
            print(shlex.join(agent_command(job, node)))
        return EXIT_OK
    preflight(job)
    topology = Topology(cfg.ntrainer, cfg.ncudatrainer, cfg.nserver, cfg.ncudaserver, cfg.mapping,
                        cuda_collectives=cfg.backend != "gloo")
    names = ", ".join(target.host for target in targets)
    print(f"ps_bench: {layout.world_size} processes on {plural(layout.nodes, 'host')} ({names}), "
          f"{layout.nproc_per_node} each; the master and the results file are on "
          f"{targets[-1].host}", flush=True)
    signal.signal(signal.SIGTERM, raise_terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return run(job, lambda rank: topology.info(rank).describe())
    except HostsFailed as error:
        sys.stderr.write(f"ps_bench: error: {error}; the run was stopped on every host "
                         f"({names})\n")
        return EXIT_FAILED
    except KeyboardInterrupt:
        sys.stderr.write(f"ps_bench: interrupted by SIGINT; the run was stopped on every host "
                         f"({names})\n")
        return EXIT_SIGINT
    except Terminated:
        sys.stderr.write(f"ps_bench: terminated by SIGTERM; the run was stopped on every host "
                         f"({names})\n")
        return EXIT_SIGTERM
