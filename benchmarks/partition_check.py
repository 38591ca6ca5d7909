"""Partitioned parameter servers on emulated hosts: ``ps_node`` with more servers than trainers a
host, its pieces dealt over all of them, against all-reduce's parameters and against ``ps_node``
as an earlier ps_bench ran it (whole slices, 2 servers).

Each configuration runs ``--runs`` times on 2 emulated hosts of 2 trainers joined by ``--link``
(``bench.py emulate``, root and tc), DummyModel (32 MiB of gradients), with ``--verify``:

- allreduce (the parameters every strategy must end with);
- ``ps_node`` with 4 servers, dedicated (hosts of their own) and co-located (2 on each trainer
  host), pieces of 4 MiB; and with 2 servers, dedicated and co-located;
- with ``--baseline DIR`` (a checkout of an earlier ps_bench), that ps_bench's ``ps_node`` with 2
  servers, dedicated and co-located.

The runs go in turns (one of each configuration, then the next round), so that a drift in the
machine's speed moves every configuration alike. Prints each configuration's batch p50 (median
over the runs, and the spread), whether its replicas ended with all-reduce's parameters (rel
1e-5) and its gradients with the exact mean (``--verify``), and how much the busiest server
received against the mean of the servers.

    sudo $(which python) benchmarks/partition_check.py [--baseline DIR] [--runs 3] [--link 1gbit]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from ps_bench.results.load import load_file
from running import ROOT, batch_p50, bench

RUN = ["--model", "DummyModel", "--data", "DummyData", "--ntrainer", "4", "--per-host", "2",
       "--verify", "--warmup-rounds", "1", "--rounds", "2"]
CONFIGS = {
    "allreduce": ["--hook", "allreduce", "--nserver", "0"],
    "ps_node, 4 dedicated": ["--hook", "ps_node", "--nserver", "4"],
    "ps_node, 4 co-located": ["--hook", "ps_node", "--nserver", "4", "--servers-on", "colocated"],
    "ps_node, 2 dedicated": ["--hook", "ps_node", "--nserver", "2"],
    "ps_node, 2 co-located": ["--hook", "ps_node", "--nserver", "2", "--servers-on", "colocated"],
}
BASELINE = {
    "earlier ps_node, 2 dedicated": ["--hook", "ps_node", "--nserver", "2"],
    "earlier ps_node, 2 co-located": ["--hook", "ps_node", "--nserver", "2", "--servers-on", "colocated"],
}


def run(checkout: Path, link: str, flags: list[str], out: Path) -> dict:
    if out.exists():  # kept from an earlier call (--keep)
        return load_file(out)
    bench("partition_check", " ".join(flags),
          ["emulate", "--link", link, "--", *RUN, *flags, "--out", str(out)], checkout)
    return load_file(out)


def server_spread(results: dict) -> float | None:
    """The busiest server's bytes received over the servers' mean (1: even), from the links of
    the emulated hosts that hold a server alone (dedicated servers); None for co-located ones."""
    placement = results["env"]["emulated"]["placement"]
    trainers = results["config"]["ntrainer"]
    servers = trainers + results["config"]["nserver"]
    received = [link["in_per_iter"] for link, ranks in zip(results["bytes"]["host_links"], placement)
                if ranks and all(trainers <= rank < servers for rank in ranks if rank < servers)
                and not any(rank < trainers for rank in ranks)]
    if not received or len(received) != results["config"]["nserver"] or not statistics.mean(received):
        return None
    return max(received) / statistics.mean(received)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="a checkout of an earlier ps_bench to run ps_node from")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--keep", type=Path, help="keep every run's results file in this folder "
                        "(a run whose file is there already is not run again)")
    args = parser.parse_args()
    configs = [(name, ROOT, flags) for name, flags in CONFIGS.items()]
    if args.baseline:
        configs += [(name, args.baseline, flags) for name, flags in BASELINE.items()]
    with tempfile.TemporaryDirectory() as scratch:
        # absolute: an earlier checkout's runs start in that checkout
        folder = (args.keep or Path(scratch)).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        results: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
        for repeat in range(args.runs):  # one run of each in turn: a drift moves them alike
            for index, (name, checkout, flags) in enumerate(configs):
                results[name].append(run(checkout, args.link, flags, folder / f"{index}-{repeat}.json"))
    reference = statistics.median(r["replicas"]["param_norm"] for r in results["allreduce"])
    print(f"{args.runs} runs each, 2 emulated hosts of 2 trainers at {args.link}, DummyModel\n")
    print(f"{'configuration':32} {'batch p50 ms':>14} {'spread':>16} {'norm = allreduce':>17} "
          f"{'grad err max':>12} {'busiest server':>14}")
    for name, runs in results.items():
        batch = [batch_p50(r) for r in runs]
        same = all(abs(r["replicas"]["param_norm"] - reference) <= 1e-5 * reference and r["replicas"]["identical"]
                   for r in runs)
        error = max(r["verify"]["grad_rel_error_max"] for r in runs)
        spread = [server_spread(r) for r in runs]
        busiest = "-" if None in spread else f"{max(spread):.3f} x mean"  # dedicated servers only
        print(f"{name:32} {statistics.median(batch):14.1f} {min(batch):7.1f} - {max(batch):6.1f} {str(same):>17} "
              f"{error:12.2e} {busiest:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
