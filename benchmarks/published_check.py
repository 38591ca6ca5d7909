"""Checks ``bench.py predict`` against published scaling tables where communication matters:
slow or shared networks, many nodes, a large model, parameter servers.

Each case is one published table: its source (title, table, year), its setup (model, batch per
GPU, GPUs per node, links) and the throughput it measured at each GPU count. ps_bench is given
only what a user would have: the 1-GPU throughput from the same table (the batch time
``t1 = batch / throughput``, split as ``DEFAULTS`` says), the model (DDP's buckets built on the
meta device), the GPUs per node and the links' line rates. Where the source also publishes the same instance
trained on all its GPUs with no network (a single-node table), the batch time is taken from that
one instead, per GPU (``Case.node``): a node's own losses when all its GPUs run (clocks shared
by a board's GPUs, its PCIe switches, the framework's copies) are measured there, and none of
them is communication between nodes. ``bench.py predict --compute-ms`` is run as a user runs
it, and its predicted throughput is compared with the measured one.

No number is set per case: every case reads ``DEFAULTS`` (the links' achievable fraction of
their line rate, the latency per message, the compute split, the local link of a node whose
GPUs share PCIe). What a case says of its own setup (its network's line rate, GPUs per node,
the strategy it ran, the fusion buffer it used) is from its source.

Prints every point (predicted and measured images/s, the error, the measured scaling efficiency
and the predicted communication share of the batch), then the median and largest |error| over
every point beyond one GPU.

    python benchmarks/published_check.py [--case NAME] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent

# One set of defaults for every case (docs/predict.md, "Checked against published measurements").
DEFAULTS = {
    # A TCP stream reaches this fraction of an Ethernet link's line rate (headers, the kernel's
    # copies); the same fraction of PCIe's for a node's local link.
    "achievable": 0.8,
    # Per message step of a collective or a push (TCP over Ethernet, through the kernel).
    "latency_us": 50.0,
    # The 1-GPU batch time split: backward twice forward (each layer's backward computes the
    # gradients of its input and of its weights, each as costly as its forward), the optimizer
    # step inside them (SGD: one pass over the parameters, under 1 % of a CNN's batch).
    "forward_share": 1 / 3,
    # GPUs in a node with neither NVLink nor a named fabric reach each other over PCIe 3.0 x16.
    "pcie_gbit": 126.0,
}


@dataclass(frozen=True)
class Case:
    name: str
    source: str  # title, table, year: where a reader finds every number below
    model: str  # a ps_bench zoo model of the same architecture (its parameters, its layer order)
    batch: int  # per GPU
    per_node: int
    link_gbit: float  # the network's line rate, each way
    hook: str  # the ps_bench strategy that does what the system did
    measured: dict[int, float] = field(default_factory=dict)  # GPUs -> images/s; 1: the single-GPU baseline
    servers_on: str | None = None  # parameter servers: "colocated", one on each node
    bucket_cap_mb: float = 25.0  # what the system fused gradients into (DDP: 25 MB)
    setup: str = ""
    # the same instance's throughput on all per_node GPUs with no network, from the source's
    # single-node table (img/s; None: the source has none): the compute ps_bench is given
    node: float | None = None
    node_source: str = ""

    def t1_ms(self) -> float:
        """The batch time ps_bench is given: per GPU of a full node where the source measured
        one, else of the single GPU."""
        per_gpu = self.node / self.per_node if self.node else self.measured[1]
        return self.batch / per_gpu * 1000.0


HOROVOD_A = ("Horovod README, first benchmark table, 'TCP Horovod (allreduce on GPU with NCCL)' row "
             "(github.com/horovod/horovod, commit d54e3a8, 2017-09-05)")
HOROVOD_B = ("Horovod README, second benchmark table, 'TCP Horovod (allreduce on GPU with NCCL)' row "
             "(github.com/horovod/horovod, commit d54e3a8, 2017-09-05)")
TF_K80 = ("TensorFlow r1 'Benchmarks' guide, 'Details for Amazon EC2 Distributed (NVIDIA Tesla K80)', "
          "'Training synthetic data' table (tensorflow/docs, site/en/r1/guide/performance/benchmarks.md; "
          "tested May 2017)")
HOROVOD_SETUP = ("4 Pascal GPUs per server, NCCL 2 ring all-reduce over TCP, Tensor Fusion (64 MB buffer), "
                 "fp32, batch 64 per GPU, synthetic data")
TF_K80_NODE = ("the same guide, 'Details for Amazon EC2 (NVIDIA Tesla K80)', 'Training synthetic data' "
               "table, row '8' (one p2.8xlarge, no network; tested May 2017)")
TF_SETUP = ("p2.8xlarge (8 K80 GPUs, 10 Gbit/s), distributed_replicated: each worker sums its 8 GPUs' "
            "gradients and pushes the sum to parameter servers run on the worker instances, one per instance")

# Horovod's two tables: (source, line rate, servers' network, GPUs) and each model's (1-GPU, all-GPU) images/s
HOROVOD_TABLES = [
    (HOROVOD_A, 25.0, "4 servers, 25 Gbit/s RoCE-capable network", 16,
     {"vgg16": (130.9, 1308.7), "resnet101": (119.4, 1685.1), "inception_v3": (134.4, 1990.7)}),
    (HOROVOD_B, 40.0, "16 servers, plain 40 Gbit/s network", 64,
     {"vgg16": (149.6, 6084.2), "resnet101": (136.0, 7741.6), "inception_v3": (148.8, 7932.1)}),
]
SHORT = {"vgg16": "vgg16", "resnet101": "resnet101", "inception_v3": "inception3"}

CASES = [
    Case(f"horovod-{link:g}g-{SHORT[model]}", source, model, 64, 4, link, "allreduce", {1: one, gpus: many},
         bucket_cap_mb=64.0, setup=f"{HOROVOD_SETUP}, {network}")
    for source, link, network, gpus, models in HOROVOD_TABLES for model, (one, many) in models.items()
] + [
    Case("tf-k80-resnet50", TF_K80, "resnet50", 64, 8, 10.0, "ps_node",
         {1: 52.4, 8: 378, 16: 751, 32: 1388, 64: 2744}, servers_on="colocated", setup=TF_SETUP,
         node=384, node_source=TF_K80_NODE),
    Case("tf-k80-resnet152", TF_K80, "resnet152", 32, 8, 10.0, "ps_node",
         {1: 19.4, 8: 146, 16: 291, 32: 565}, servers_on="colocated", node=149, node_source=TF_K80_NODE,
         setup=TF_SETUP + " (at 64 GPUs it ran 4 servers on 8 instances: not a layout ps_bench predicts)"),
    Case("tf-k80-inception3", TF_K80, "inception_v3", 64, 8, 10.0, "ps_node",
         {1: 29.7, 8: 229, 16: 459, 32: 902}, servers_on="colocated", node=230, node_source=TF_K80_NODE,
         setup=TF_SETUP + " (at 64 GPUs it ran 6 servers on 8 instances: not a layout ps_bench predicts)"),
]


def predict_case(case: Case, scratch: Path) -> list[dict]:
    """``bench.py predict`` for the case's GPU counts, as a user would run it; its rows by GPUs."""
    t1 = case.t1_ms()
    forward = t1 * DEFAULTS["forward_share"]
    nodes = sorted({gpus // case.per_node for gpus in case.measured if gpus > 1})
    out = scratch / f"{case.name}.json"
    command = [sys.executable, str(ROOT / "bench.py"), "predict", "--model", case.model, "--batch-size", str(case.batch),
               "--compute-ms", f"forward={forward:.3f},backward={t1 - forward:.3f},optimizer=0",
               "--link", f"{case.link_gbit * DEFAULTS['achievable']:g}gbit", "--latency", f"{DEFAULTS['latency_us']:g}us",
               "--per-node", str(case.per_node), "--intra-link", f"{DEFAULTS['pcie_gbit'] * DEFAULTS['achievable']:g}gbit",
               "--nodes", ",".join(map(str, nodes)), "--hooks", case.hook, "--bucket-cap-mb", f"{case.bucket_cap_mb:g}",
               "--out", str(out)]
    if case.servers_on:
        command += ["--servers-on", case.servers_on]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{case.name}: bench.py predict failed: {done.stderr.strip() or done.stdout.strip()}")
    predictions = json.loads(out.read_text())["predictions"]
    rows = []
    for row in predictions:
        gpus = row["trainers"]
        measured = case.measured[gpus]
        predicted = row["samples_per_s"]
        rows.append({"case": case.name, "model": case.model, "gpus": gpus, "nodes": row["nodes"],
                     "measured": measured, "predicted": predicted,
                     "error_pct": (predicted - measured) / measured * 100.0,
                     "efficiency": measured / (gpus * case.measured[1]),
                     "communication_share": 1.0 - t1 / row["batch_ms"],
                     "given": f"{case.per_node}-GPU node" if case.node else "1 GPU", "given_ms": t1})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=[case.name for case in CASES], action="append",
                        help="run only these cases (default: all)")
    parser.add_argument("--out", metavar="FILE.json", help="write every point and the defaults as JSON")
    parser.add_argument("--sources", action="store_true", help="print each case's source and setup, then stop")
    args = parser.parse_args(argv)
    cases = [case for case in CASES if not args.case or case.name in args.case]
    if args.sources:
        for case in cases:
            print(f"{case.name}: {case.source}\n    {case.setup}")
            if case.node:
                print(f"    compute given: {case.node:g} img/s on {case.per_node} GPUs, from {case.node_source}")
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        rows = [row for case in cases for row in predict_case(case, Path(scratch))]
    print(f"defaults: {DEFAULTS}")
    print(tabulate([[row["case"], row["gpus"], row["nodes"], f"{row['measured']:.1f}", f"{row['predicted']:.1f}",
                     f"{row['error_pct']:+.1f} %", f"{row['efficiency']:.1%}", f"{row['communication_share']:.0%}",
                     f"{row['given']}, {row['given_ms']:.0f} ms"]
                    for row in rows],
                   headers=["case", "GPUs", "nodes", "measured img/s", "predicted img/s", "error", "measured efficiency",
                            "predicted comm. share", "compute given"], tablefmt="github"))
    errors = [abs(row["error_pct"]) for row in rows]
    print(f"\n{len(rows)} points: median |error| {statistics.median(errors):.1f} %, largest {max(errors):.1f} %")
    if args.out:
        Path(args.out).write_text(json.dumps({"defaults": DEFAULTS, "points": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
