"""``bench.py emulate``: a cluster's network on one machine, every rank behind a shaped link.

The job runs as ``bench.py`` runs it, from this machine's launcher and its preloaded
forkserver, but each rank first enters the network namespace of its emulated host, and every
host reaches the others only through its own link, shaped both ways to ``--link`` (see
``ps_bench.runtime.network``): ``bench.py`` runs the job that ``run_argv`` describes. This is
the launcher entering each rank's namespace rather than a torchrun agent per host: it is as faithful
(every byte between hosts crosses the shaped veth links, RPC over TCP as gloo is), starts in the
time a local job does, and keeps ps_bench's own supervision, failure naming and cleanup, down to a
launcher killed by SIGKILL. The options here are the run options ``--emulate-link``,
``--emulate-hosts``, ``--emulate-delay`` and ``--emulate-keep``, which run files and sweeps use.
"""

from __future__ import annotations

import argparse

from ps_bench.config import ConfigError
from ps_bench.options import flags, typed

BENCH_OPTIONS = True
DESCRIPTION = (
    "Run this benchmark on an emulated cluster network on this machine: every host a network "
    "namespace (hostname emulated-hN, address 10.231.0.N+1) behind its own link to one switch, "
    "shaped in both directions with tc's token bucket to --link; by default every trainer and "
    "every server on a host of its own and the master beside the last server, so every gradient "
    "crosses a link. RPC goes over TCP (TensorPipe would otherwise move tensors through shared "
    "memory), the results record the network (env.emulated), and every namespace, link and process "
    "is gone when the run ends, however it ends. Needs root, iproute2 and util-linux.")
EPILOG = ("""\
examples:
  sudo $(which python) bench.py emulate --link 1gbit -- --model DummyModel --data DummyData """
          """--hook fp16
  sudo $(which python) bench.py emulate --link 10gbit --hosts 2 -- --ntrainer 4 --nserver 1 --limits
  sudo $(which python) bench.py sweep configs/sweeps/network.json --out results/network """
          """  # links in a sweep

--link takes a rate in bits: bit, kbit, mbit, gbit, tbit (per second); bps, kbps, mbps, gbps
are refused (tc reads them as bytes a second, network specifications as bits). --limits inside
an emulated run measures its floors across the links.
""")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link", required=True, metavar="RATE",
                        help="every host's link, each way, e.g. 1gbit, 10gbit, 500mbit")
    parser.add_argument("--hosts", type=typed(int, "hosts"), metavar="N",
                        help="pack the ranks onto N hosts in rank order (default: every trainer "
                             "and server on its own host, the master beside the last server)")
    parser.add_argument("--delay", metavar="TIME",
                        help="added one-way delay per link, e.g. 100us (needs netem)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the network after the run, for a look inside "
                             "(prints how to enter and remove it)")


RUN_FLAGS = {"--link": "emulate_link", "--hosts": "emulate_hosts", "--delay": "emulate_delay",
             "--keep": "emulate_keep"}  # each of this command's flags, and the run option it sets


def run_argv(args: argparse.Namespace, bench_argv: list[str]) -> list[str]:
    """The run's own command line: the bench options and the emulation."""
    for own, option in RUN_FLAGS.items():
        given = [word for word in bench_argv if word.split("=", 1)[0] in flags(option)]
        if given:
            raise ConfigError(f"{given[0]} after --: this command's {own} sets it; give it once, "
                              f"as {own}")
    emulation = ["--emulate-link", args.link]
    emulation += ["--emulate-hosts", str(args.hosts)] if args.hosts is not None else []
    emulation += ["--emulate-delay", args.delay] if args.delay is not None else []
    emulation += ["--emulate-keep"] if args.keep else []
    return [*bench_argv, *emulation]
