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

No number is set per case: every case reads ``DEFAULTS`` (the compute split, the local link of a
node whose GPUs share PCIe), and predict's own defaults for each kind of link (the share of the
line rate a transfer achieves, the latency per message: ``bench.py predict --help``). What a case
says of its own setup (its network's line rate and kind, GPUs per node and how they are linked,
the strategy it ran, the fusion buffer it used) is from its source.

Prints every point (predicted and measured throughput in its table's own unit, images,
sentences or sequences a second; the error, the measured scaling efficiency, the predicted
communication share of the batch and the share of the line rate the measurement allows,
``line_share_allowed``), then the median and largest |error| over every point beyond one GPU, and
beside it over the points on more than one node alone: a point on one node crosses no network,
and where its compute is given from its own measurement (``Case.node``) its error is the
modelled all-reduce within the node alone.

    python benchmarks/published_check.py [--case NAME] [--out FILE.json]

``--ethernet SHARE,LATENCY`` is a what-if, not the check: the Ethernet cases are predicted with
that share of the line and latency per message in place of predict's defaults (``bench.py
predict --link-efficiency SHARE --latency LATENCY``), to see what one setting of the Ethernet
link does to every Ethernet table at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ps_bench.config import ConfigError  # noqa: E402
from ps_bench.metrics.costs import Link, byteps_bound_ms, ring_share  # noqa: E402
from ps_bench.metrics.messages import ELEMENT_BYTES  # noqa: E402
from ps_bench.predict.inputs import LINK_KINDS  # noqa: E402
from ps_bench.predict.tables import ETHERNET_CHECKED_NODES  # noqa: E402
from ps_bench.runtime.network import parse_delay  # noqa: E402
from ps_bench.strategies import HOOKS  # noqa: E402
from ps_bench.strategies.record import COLLECTIVE  # noqa: E402

# One set of defaults for every case (docs/predict.md, "Checked against published measurements").
DEFAULTS = {
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
    # parameter servers: "colocated", one on each node; "dedicated", on as many machines of
    # their own as there are nodes
    servers_on: str | None = None
    bucket_cap_mb: float = 25.0  # what the system fused gradients into (DDP: 25 MB)
    setup: str = ""
    # the same instance's throughput on all per_node GPUs with no network, from the source's
    # single-node table (img/s; None: the source has none): the compute ps_bench is given
    node: float | None = None
    node_source: str = ""
    intra_gbit: float | None = None  # a node's local link, each way, where the source names it
    # cases of one cluster, model and GPU count ran side by side: the faster is that point's winner
    cluster: str = ""
    unit: str = "images/s"
    link_kind: str = "ethernet"  # the network: ethernet (TCP), roce or infiniband (RDMA)
    intra_kind: str = "pcie"  # a node's local link: pcie or nvlink
    table: str = ""  # the table the source's row or column is in, where a table holds several cases
    system: str = ""  # what the cluster's winner is called where two cases ran one strategy (default: hook)
    # the model's configuration where the source's differs from the zoo entry's: predict's
    # --model-option KEY=VALUE,... and --sequence-length, as a user gives them
    model_options: str = ""
    sequence_length: int | None = None
    # the sharded engines' cases: what the model trains and communicates in (predict's
    # --precision and --reduce-dtype), and whether the table gives tokens a second per GPU
    # (measured and node then in that unit; predict's sequences a second converted)
    precision: str | None = None
    reduce_dtype: str | None = None
    tokens_per_gpu: bool = False

    @property
    def table_name(self) -> str:
        return self.table or self.source

    def samples_per_gpu(self, gpus: int, value: float) -> float:
        """A throughput of the table's, ``value`` at ``gpus`` GPUs, in samples a second per GPU."""
        return value / self.sequence_length if self.tokens_per_gpu else value / gpus

    def in_unit(self, gpus: int, samples_per_s: float) -> float:
        """Predict's samples a second at ``gpus`` GPUs in the table's own unit."""
        return samples_per_s / gpus * self.sequence_length if self.tokens_per_gpu else samples_per_s

    def t1_ms(self) -> float:
        """The batch time ps_bench is given: per GPU of a full node where the source measured
        one, else of the single GPU."""
        per_gpu = (self.samples_per_gpu(self.per_node, self.node) if self.node
                   else self.samples_per_gpu(1, self.measured[1]))
        return self.batch / per_gpu * 1000.0


HOROVOD = ("Horovod README, {table} benchmark table, '{row} Horovod (allreduce on GPU with NCCL)' row "
           "(github.com/horovod/horovod, commit d54e3a8, 2017-09-05)")
TF_K80 = ("TensorFlow r1 'Benchmarks' guide, 'Details for Amazon EC2 Distributed (NVIDIA Tesla K80)', "
          "'Training synthetic data' table (tensorflow/docs, site/en/r1/guide/performance/benchmarks.md; "
          "tested May 2017)")
HOROVOD_SETUP = ("4 Pascal GPUs per server, NCCL 2 ring all-reduce over {transport}, Tensor Fusion (64 MB "
                 "buffer), fp32, batch 64 per GPU, synthetic data")
TF_K80_NODE = ("the same guide, 'Details for Amazon EC2 (NVIDIA Tesla K80)', 'Training synthetic data' "
               "table, row '8' (one p2.8xlarge, no network; tested May 2017)")
TF_SETUP = ("p2.8xlarge (8 K80 GPUs, 10 Gbit/s), distributed_replicated: each worker sums its 8 GPUs' "
            "gradients and pushes the sum to parameter servers run on the worker instances, one per instance")

# Horovod's two tables, the rows of all-reduce on the GPUs with NCCL: (table, row, line rate, link kind, the
# servers' network, GPUs) and each model's (1-GPU, all-GPU) images/s. The first table's cluster ran NCCL both over
# TCP sockets and over RDMA (RoCE); the second's network is plain Ethernet, TCP alone
HOROVOD_ROWS = [
    ("first", "TCP", 25.0, "ethernet", "4 servers, 25 Gbit/s RoCE-capable network", 16,
     {"vgg16": (130.9, 1308.7), "resnet101": (119.4, 1685.1), "inception_v3": (134.4, 1990.7)}),
    ("first", "RDMA", 25.0, "roce", "4 servers, 25 Gbit/s RoCE-capable network", 16,
     {"vgg16": (130.9, 1787.4), "resnet101": (119.4, 1746.2), "inception_v3": (134.4, 2022.6)}),
    ("second", "TCP", 40.0, "ethernet", "16 servers, plain 40 Gbit/s network", 64,
     {"vgg16": (149.6, 6084.2), "resnet101": (136.0, 7741.6), "inception_v3": (148.8, 7932.1)}),
]
SHORT = {"vgg16": "vgg16", "resnet101": "resnet101", "inception_v3": "inception3"}

DLPERF = ("OneFlow DLPerf benchmark report v1, 'BERT base pretrain' FP32 table, batch size {batch} per device "
          "(github.com/Oneflow-Inc/DLPerf, reports/dlperf_benchmark_test_report_v1.md, commit 9c9d9e2, "
          "2020-11-03), {column} column")
# the same report's second FP32 table, 'FP32, batch size = max': each framework at the largest batch its 16 GB held
DLPERF_MAX = DLPERF.replace("batch size {batch} per device", "'batch size = max' ({batch} per device)")
DLPERF_SETUP = ("4 nodes of 8 V100-SXM2-16GB (NVLink 2.0: 6 links of 25 GB/s a GPU), InfiniBand 100 Gb/s (4X EDR), "
                "one NIC a node; BERT-base, sequence 128, fp32, no gradient accumulation; {system}")
DLPERF_SYSTEMS = {  # each column's system, as the report and the column's own README name it
    "pytorch": "NGC PyTorch 20.03, apex DDP (message_size 250,000,000), NCCL 2.5.6",
    "tensorflow": "NGC TensorFlow 20.03, Horovod 0.19.0 (Tensor Fusion, 64 MB)",
}
# (column, short name, the system's fusion buffer, {batch: {GPUs: sentences/s}}): both FP32 tables
DLPERF_COLUMNS = [
    # NVIDIA's BERT in PyTorch wraps the model in apex's DDP with message_size=250000000 elements
    # (run_pretraining.py at DeepLearningExamples 5cc03ca, the commit DLPerf ran): every gradient
    # in one bucket, all-reduced once backward is over
    ("NGC PyTorch", "pytorch", 250e6 * 4 / 2 ** 20,
     {32: {1: 119.60, 8: 921.32, 16: 1499.40, 32: 2885.81}, 48: {1: 121.94, 8: 928.01, 16: 1584.32, 32: 3039.30}}),
    ("NGC TensorFlow 1.x", "tensorflow", 64.0,
     {32: {1: 107.33, 8: 790.03, 16: 1404.04, 32: 2727.90}, 48: {1: 112.76, 8: 855.45, 16: 1576.88, 32: 3089.74}}),
]
MEGATRON = ("OneFlow DLPerf GPT benchmark report (github.com/Oneflow-Inc/DLPerf, "
            "reports/GPT/dlperf_gpt_test_report_210512.md, commit c86f9b9, 2021-05-19), 'Data Parallelism Test' "
            "table, Megatron-LM column (cases DP_1x1x1_2_1536x16 to DP_32x1x1_64_1536x16)")
MEGATRON_SETUP = ("the DLPerf cluster above (4 nodes of 8 V100-SXM2-16GB, NVLink, one 100 Gb/s EDR InfiniBand NIC a "
                  "node), NGC PyTorch 20.12, NCCL 2.8.3; Megatron-LM at 8aa4619 (DLPerf's Megatron-LM/README.md "
                  "and scripts/mutil_perf_pretrain_gpt_dp_mp_pp.sh): a GPT of hidden size 1536, 16 layers, 16 heads, "
                  "vocabulary 51,200, sequence 2048, micro-batch 2 a GPU, --fp16 (the model cast to half: "
                  "FP16Module), --checkpoint-activations, pure data parallelism; its DDP (--DDP-impl local, "
                  "megatron/model/distributed.py) flattens every half gradient into one buffer and all-reduces "
                  "it once backward is over: ps_bench's fp16 with one bucket")
MEGATRON_NODE = "the same table, DP_8x1x1_16_1536x16 (one node of 8 GPUs, no network)"
DLPERF_NODE = "the same table, its 1-node 8-GPU row (no network)"
NVLINK_V100_GBIT = 6 * 25 * 8  # NVLink 2.0 on a V100-SXM2: 6 links of 25 GB/s each way
BYTEPS = ("BytePS README.md, section 'Performance' (github.com/bytedance/byteps, commit cc77f49, 2019-11-15; the "
          "same text is docs/performance.md's 'NVLink + TCP' from commit c1b20f8, 2019-11-29): the bar charts "
          "docs/images/perf_tcp_{model}.png (commit d72cfd4), read off the image to the pixel (about 1 % of the "
          "axis); the text prints the 64-GPU gains, 44 % for ResNet-50 and 100 % for VGG-16")
BYTEPS_SETUP = ("cloud VMs of 8 V100 16GB with NVLink, 20 Gbit/s TCP/IP between them, batch 64 per GPU, fp32; "
                "{system}")
BYTEPS_NODE = "the same chart, 8 GPUs (one VM, no network), the faster of the two systems"
# GPUs -> images/s read off BytePS's charts (docs/images/perf_tcp_*.png): (Horovod, BytePS)
BYTEPS_CHARTS = {
    "resnet50": {8: (2409, 2546), 16: (3909, 4727), 32: (7591, 8818), 64: (11408, 16590)},
    "vgg16": {8: (1618, 1727), 16: (1564, 2436), 32: (2055, 4182), 64: (3309, 6636)},
}


# The sharded engines: published tables of FSDP on language models, in tokens a second per GPU
TORCHTITAN = ("torchtitan docs/performance.md (github.com/pytorch/torchtitan, commit eaea6f6a, the runs of "
              "arXiv 2410.06511), Table 1 (8 GPUs) and Table 3 (128 GPUs), row '{row}', TPS/GPU at iteration 90")
TORCHTITAN_SETUP = ("Grand Teton hosts of 8 H100 (96 GB HBM2e, 500 W) fully connected with NVLink (NVLink 4: 450 "
                    "GB/s each way a GPU), a backend RDMA network of 400 Gb/s per GPU (3,200 Gb/s a host); Llama "
                    "3.1 8B, FSDP2 (torchtitan's 1D), bf16 parameters (their float32 reduce-scatter is not "
                    "expressed: predict's fsdp gathers and reduces in one dtype), selective activation "
                    "checkpointing (in the compute given, measured with it), local batch 2, sequence 8192 (the doc "
                    "states none: torchtitan's train_configs/llama3_8b.toml, seq_len 8192), AdamW")
TORCHTITAN_NODE = "the same doc's Table 1 (one host of 8 GPUs)"
NVLINK_H100_GBIT = 450 * 8
NVLINK_A100_GBIT = 300 * 8  # NVLink 3 on an A100-SXM4: 12 links of 25 GB/s each way
LLM_FOUNDRY = ("llm-foundry scripts/train/benchmarking/README.md (github.com/mosaicml/llm-foundry, commit "
               "061f2c7c), table 'A100 40GB with 1600 Gbps node-node interconnect (RoCE)', the {model} rows at "
               "SeqLen 2048, Throughput (T/s/GPU)")
LLM_FOUNDRY_SETUP = ("A100 40GB, 1600 Gbps node-node interconnect (RoCE); 8 GPUs a node with NVLink 3 (the "
                     "table's smallest row is 8 GPUs; the README names neither the node nor its links: an "
                     "HGX A100's), Composer's FSDP FULL_SHARD, bf16 PURE (parameters, gradients and their "
                     "collectives in bf16), activation checkpointing {checkpointing} (in the compute given), MPT-"
                     "{model}: a GPT of {layers} layers of width {width}, learned positions, vocabulary 50,368 "
                     "(ps_bench's gpt2 at that size), sequence 2048, micro-batch {batch} a GPU; the rows at other "
                     "micro-batches are left out, the 8-GPU row (its own micro-batch, accumulating) is the "
                     "compute given, per token")
LLM_FOUNDRY_NODE = "the same table's 8-GPU row of the model (one node, no network)"
# MPT model: (layers, width, heads, micro-batch of the rows kept, activation checkpointing,
#             {GPUs: T/s/GPU}, the 8 GPU row's T/s/GPU)
LLM_FOUNDRY_ROWS = {
    "125m": (12, 768, 12, 26, False, {16: 130535, 32: 127122, 64: 125234, 128: 123936}, 136334),
    "350m": (24, 1024, 16, 18, False, {16: 55413, 32: 53811, 64: 52689, 128: 51934}, 55995),
    "760m": (24, 1536, 12, 12, False, {16: 29607, 32: 29648, 64: 29344, 128: 28940}, 30173),
    "3b": (32, 2560, 20, 6, False, {32: 9914, 64: 9736, 128: 9538}, 10065),
    "7b": (32, 4096, 32, 18, True, {32: 3725, 64: 3665, 128: 3623}, 3679),
}


def llm_foundry_case(model: str) -> Case:
    layers, width, heads, batch, checkpointing, rows, node = LLM_FOUNDRY_ROWS[model]
    return Case(f"llm-foundry-mpt-{model}", LLM_FOUNDRY.format(model=model), "hf:gpt2", batch, 8, 1600.0, "fsdp",
                {8: node, **rows}, setup=LLM_FOUNDRY_SETUP.format(
                    checkpointing="full (every block)" if checkpointing else "none", model=model, layers=layers, width=width, batch=batch),
                node=node, node_source=LLM_FOUNDRY_NODE, intra_gbit=NVLINK_A100_GBIT, unit="tokens/s/GPU",
                link_kind="roce", intra_kind="nvlink", table=LLM_FOUNDRY.format(model="each"),
                model_options=f"n_embd={width},n_layer={layers},n_head={heads},vocab_size=50368,n_positions=2048",
                sequence_length=2048, precision="bf16", reduce_dtype="bf16", tokens_per_gpu=True)


def torchtitan_case(row: str, measured: dict[int, float]) -> Case:
    return Case(f"torchtitan-llama3-8b-{row.lower().replace(' + ', '-').replace('.', '')}",
                TORCHTITAN.format(row=row), "hf:llama3-8b", 2, 8, 3200.0, "fsdp", measured,
                setup=TORCHTITAN_SETUP + (", torch.compile" if "compile" in row else ""), node=measured[8],
                node_source=TORCHTITAN_NODE, intra_gbit=NVLINK_H100_GBIT, unit="tokens/s/GPU", link_kind="roce",
                intra_kind="nvlink", table=TORCHTITAN.format(row="each"), sequence_length=8192,
                precision="bf16", reduce_dtype="bf16", tokens_per_gpu=True)


def dlperf_case(batch: int, column: str, short: str, fusion_mb: float, measured: dict[int, float]) -> Case:
    """One column of a DLPerf BERT-Base FP32 table: batch 32's, or the largest batch's (48)."""
    source = DLPERF if batch == 32 else DLPERF_MAX
    return Case(f"dlperf-{short}-bert{'' if batch == 32 else f'-b{batch}'}", source.format(batch=batch, column=column),
                "hf:bert-base", batch, 8, 100.0, "allreduce", measured, bucket_cap_mb=fusion_mb,
                setup=DLPERF_SETUP.format(system=DLPERF_SYSTEMS[short]), node=measured[8], node_source=DLPERF_NODE,
                intra_gbit=NVLINK_V100_GBIT, unit="sentences/s", link_kind="infiniband", intra_kind="nvlink",
                table=source.format(batch=batch, column="each"))


CASES = [
    Case(f"horovod-{link:g}g-{'rdma-' if kind == 'roce' else ''}{SHORT[model]}", HOROVOD.format(table=table, row=row),
         model, 64, 4, link, "allreduce", {1: one, gpus: many}, bucket_cap_mb=64.0,
         setup=f"{HOROVOD_SETUP.format(transport=row)}, {network}", link_kind=kind,
         table=HOROVOD.format(table=table, row="each"), cluster=f"horovod-{link:g}g-{SHORT[model]}",
         system=f"allreduce, {row}")
    for table, row, link, kind, network, gpus, models in HOROVOD_ROWS for model, (one, many) in models.items()
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
] + [
    dlperf_case(batch, column, short, fusion_mb, tables[batch])
    for batch in (32, 48) for column, short, fusion_mb, tables in DLPERF_COLUMNS
] + [
    # 51,200 x 1536 embeddings, 16 layers of 12·1536² and their biases and norms: 2.0 GiB of float32
    # gradients, all in one bucket under a cap of 4096 MB
    Case("dlperf-megatron-gpt", MEGATRON, "hf:gpt2", 2, 8, 100.0, "fp16",
         {1: 4.31, 8: 33.27, 16: 48.16, 32: 93.63}, bucket_cap_mb=4096.0, setup=MEGATRON_SETUP, node=33.27,
         node_source=MEGATRON_NODE, intra_gbit=NVLINK_V100_GBIT, unit="sequences/s", link_kind="infiniband",
         intra_kind="nvlink", model_options="n_embd=1536,n_layer=16,n_head=16,vocab_size=51200,n_positions=2048",
         sequence_length=2048),
] + [
    Case(f"byteps-20g-{model}-{system}", BYTEPS.format(model=model), model, 64, 8, 20.0, hook,
         {gpus: pair[index] for gpus, pair in BYTEPS_CHARTS[model].items()}, servers_on=place,
         bucket_cap_mb=64.0 if hook == "allreduce" else 25.0,
         setup=BYTEPS_SETUP.format(system=system_setup), node=max(BYTEPS_CHARTS[model][8]),
         node_source=BYTEPS_NODE, intra_gbit=NVLINK_V100_GBIT, cluster=f"byteps-20g-{model}",
         intra_kind="nvlink")
    for model in BYTEPS_CHARTS
    for index, (system, hook, place, system_setup) in enumerate((
        ("horovod", "allreduce", None, "Horovod with NCCL (Tensor Fusion, 64 MB)"),
        ("byteps", "ps_node", "dedicated", "BytePS, its servers on as many CPU machines as GPU machines (not "
                                            "stated for this chart: BytePS's best practice asks for the servers' "
                                            "bandwidth to match the workers', and its OSDI artifact runs as many "
                                            "CPU machines as GPU machines)")))
] + [llm_foundry_case(model) for model in LLM_FOUNDRY_ROWS] + [
    torchtitan_case("FSDP", {8: 5762, 128: 5605}),
    torchtitan_case("FSDP + torch.compile", {8: 6667, 128: 6514}),
]


def predict_command(case: Case, nodes: list[int], out: Path, servers: int | None = None,
                    ethernet: tuple[float, str] | None = None) -> list[str]:
    """``bench.py predict`` for the case at these node counts, as a user would run it: each
    link's line rate and kind. Dedicated servers on one node: none (BytePS on one machine sums
    its GPUs' gradients and uses no server), so the node's own link alone. ``ethernet``: the
    what-if's share of the line and latency for a network of that kind (``--ethernet``)."""
    t1 = case.t1_ms()
    forward = t1 * DEFAULTS["forward_share"]
    intra = case.intra_gbit or DEFAULTS["pcie_gbit"]
    command = [sys.executable, str(ROOT / "bench.py"), "predict", "--model", case.model, "--batch-size", str(case.batch),
               "--compute-ms", f"forward={forward:.3f},backward={t1 - forward:.3f},optimizer=0",
               "--link", f"{case.link_gbit:g}gbit", "--link-kind", case.link_kind,
               "--per-node", str(case.per_node), "--intra-link", f"{intra:g}gbit", "--intra-link-kind", case.intra_kind,
               "--nodes", ",".join(map(str, nodes)), "--hooks", case.hook, "--bucket-cap-mb", f"{case.bucket_cap_mb:g}",
               "--out", str(out)]
    if ethernet and case.link_kind == "ethernet":
        command += ["--link-efficiency", f"{ethernet[0]:g}", "--latency", ethernet[1]]
    if case.model_options:
        command += ["--model-option", case.model_options]
    if case.sequence_length:
        command += ["--sequence-length", str(case.sequence_length)]
    if case.precision:
        command += ["--precision", case.precision]
    if case.reduce_dtype:
        command += ["--reduce-dtype", case.reduce_dtype]
    if case.servers_on == "colocated" or (case.servers_on == "dedicated" and nodes == [1]):
        command += ["--servers-on", "colocated"]
    elif servers is not None:
        command += ["--servers", str(servers)]
    return command


def predict_case(case: Case, scratch: Path, ethernet: tuple[float, str] | None = None) -> list[dict]:
    """The case's GPU counts predicted, as a user would ask: its rows by GPUs (dedicated servers:
    one prediction per node count, with as many servers as nodes)."""
    t1 = case.t1_ms()
    nodes = sorted({gpus // case.per_node for gpus in case.measured if gpus > 1})
    runs = [(nodes, None)] if case.servers_on != "dedicated" else [([n], n) for n in nodes]
    predictions = []
    for index, (counts, servers) in enumerate(runs):
        out = scratch / f"{case.name}-{index}.json"
        done = subprocess.run(predict_command(case, counts, out, servers, ethernet), capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"{case.name}: bench.py predict failed: {done.stderr.strip() or done.stdout.strip()}")
        predictions += json.loads(out.read_text())["predictions"]
    per_gpu = case.samples_per_gpu(case.per_node, case.node) if case.node else case.samples_per_gpu(
        1, case.measured[1])
    rows = []
    for row in predictions:
        gpus = row["trainers"]
        measured = case.measured[gpus]
        predicted = case.in_unit(gpus, row["samples_per_s"])
        rows.append({"case": case.name, "model": case.model, "gpus": gpus, "nodes": row["nodes"],
                     "unit": case.unit, "measured": measured, "predicted": predicted,
                     # one node given its own measurement as compute: only the modelled
                     # all-reduce within the node stands between it and the measurement
                     "own_compute": row["nodes"] == 1 and case.node == measured,
                     "error_pct": (predicted - measured) / measured * 100.0,
                     "efficiency": case.samples_per_gpu(gpus, measured) / per_gpu,
                     "communication_share": 1.0 - t1 / row["batch_ms"],
                     "given": f"{case.per_node}-GPU node" if case.node else "1 GPU", "given_ms": t1,
                     "cluster": case.cluster, "strategy": case.system or case.hook,
                     "link_kind": case.link_kind,
                     "line_share_allowed": line_share_allowed(case, gpus, row["nodes"],
                                                              row["gradients_bytes"])})
    return rows


def line_share_allowed(case: Case, gpus: int, nodes: int, gradient_bytes: float) -> float | None:
    """The largest share of the network's line rate a transfer can have achieved for the point's
    measured throughput, had nothing overlapped backward at all: the least time a node's
    network link needs at the full line rate for one iteration (each way, the gradients in the
    strategy's payload: a collective's ring over every GPU, ``2(n-1)/n`` of them; BytePS's bound
    over the nodes for the parameter servers) over the measured batch time beyond the compute
    the case is given. Any overlap makes it smaller. None on one node (no network crossed);
    infinity where the measured batch is no longer than the compute."""
    if nodes == 1:
        return None
    line = Link.of(0.0, case.link_gbit)
    record = HOOKS.record(case.hook)
    sent = gradient_bytes * ELEMENT_BYTES.get(record.payload, 4) / ELEMENT_BYTES["float32"]
    if record.transport == COLLECTIVE:
        least_ms = ring_share(gpus) * line.time(sent)
    else:
        least_ms = byteps_bound_ms(nodes, nodes if case.servers_on == "dedicated" else 0, sent, line)
    beyond_ms = case.batch / case.samples_per_gpu(gpus, case.measured[gpus]) * 1000.0 - case.t1_ms()
    return least_ms / beyond_ms if beyond_ms > 0 else float("inf")


def out_of_reach(row: dict) -> bool:
    """Whether the measurement allows less of the line than the case's link kind achieves in
    predict: with nothing overlapped, the bytes at predict's rate leave measured time that no
    overlap or timeline term gives, only latency per message or a lower achieved rate."""
    allowed = row["line_share_allowed"]
    return allowed is not None and allowed < LINK_KINDS[row["link_kind"]].efficiency


def winners(rows: list[dict]) -> list[dict]:
    """Each point where two systems ran on one cluster: the measured and the predicted winner,
    and the measured gap (the winner's throughput over the other's, less 1)."""
    points: dict[tuple, list[dict]] = {}
    for row in rows:
        if row["cluster"]:
            points.setdefault((row["cluster"], row["gpus"]), []).append(row)
    out = []
    for (cluster, gpus), members in sorted(points.items()):
        if len(members) < 2:
            continue
        measured = max(members, key=lambda row: row["measured"])
        predicted = max(members, key=lambda row: row["predicted"])
        runner_up = max((row for row in members if row is not measured), key=lambda row: row["measured"])
        out.append({"cluster": cluster, "gpus": gpus, "measured_winner": measured["strategy"],
                    "predicted_winner": predicted["strategy"],
                    "gap_pct": (measured["measured"] / runner_up["measured"] - 1.0) * 100.0})
    return out


def summarise(rows: list[dict]) -> dict:
    """The median and largest |error| over every point, over the points on more than one node (those
    that cross the network), and over those on one node, with how many of these are given their own
    measurement as compute."""
    def errors(of: list[dict]) -> dict:
        values = [abs(row["error_pct"]) for row in of]
        return {"points": len(values), "median_pct": statistics.median(values) if values else None,
                "largest_pct": max(values) if values else None}
    single = [row for row in rows if row["nodes"] == 1]
    return {"all": errors(rows), "nodes_over_one": errors([row for row in rows if row["nodes"] > 1]),
            "one_node": {**errors(single), "own_compute": sum(1 for row in single if row["own_compute"])}}


def headline(summary: dict, tables: int) -> str:
    """The summary in words: every point, then those across nodes beside it."""
    every, across, one = summary["all"], summary["nodes_over_one"], summary["one_node"]
    line = (f"{every['points']} points from {tables} tables: median |error| {every['median_pct']:.1f} %, "
            f"largest {every['largest_pct']:.1f} %")
    if across["points"] and one["points"]:
        line += (f"; over the {across['points']} points on more than one node: median |error| "
                 f"{across['median_pct']:.1f} %, largest {across['largest_pct']:.1f} % (the {one['points']} on one "
                 f"node cross no network, median {one['median_pct']:.1f} %, "
                 + (f"{one['own_compute']} of them given its own measurement as compute)" if one["own_compute"] == 1
                    else f"{one['own_compute']} of them given their own measurement as compute)"))
    return line


def allowed(row: dict) -> str:
    share = row["line_share_allowed"]
    if share is None:
        return "- (one node)"
    return ("any" if share == float("inf") else f"{share:.2f}") + (" *" if out_of_reach(row) else "")


def ethernet_check(rows: list[dict]) -> str:
    """Whether predict's note holds: every point over Ethernet from ETHERNET_CHECKED_NODES nodes up
    measured slower than predicted (``predict.tables.ethernet_note``)."""
    far = [row for row in rows if row["link_kind"] == "ethernet" and row["nodes"] >= ETHERNET_CHECKED_NODES]
    faster = [row for row in far if row["error_pct"] < 0]
    return (f"Ethernet (TCP) at {ETHERNET_CHECKED_NODES} nodes or more: {len(far)} points, "
            + ("every one measured slower than predicted (predict's note on such rows holds)" if not faster else
               f"{len(faster)} measured faster than predicted ("
               + ", ".join(f"{row['case']} at {row['gpus']} GPUs" for row in faster)
               + "): predict's note on such rows (predict.tables.ethernet_note) no longer holds"))


def ethernet_setting(text: str) -> tuple[float, str]:
    """``--ethernet SHARE,LATENCY``: a share of the line above 0 and at most 1, and a latency
    as ``bench.py predict --latency`` takes it."""
    share, _, latency = text.partition(",")
    try:
        value = float(share)
        parse_delay(latency, "--ethernet's latency")
    except (ValueError, ConfigError) as error:
        raise argparse.ArgumentTypeError(f"{text!r}: SHARE,LATENCY, e.g. 0.5,1ms ({error})") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the share of the line must be above 0 and at most 1")
    return value, latency


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=[case.name for case in CASES], action="append",
                        help="run only these cases (default: all)")
    parser.add_argument("--out", metavar="FILE.json", help="write every point and the defaults as JSON")
    parser.add_argument("--sources", action="store_true", help="print each case's source and setup, then stop")
    parser.add_argument("--ethernet", metavar="SHARE,LATENCY", type=ethernet_setting,
                        help="a what-if, not the check: predict the Ethernet cases at this share of the line "
                             "and latency per message (e.g. 0.5,1ms) in place of predict's defaults")
    args = parser.parse_args(argv)
    cases = [case for case in CASES if not args.case or case.name in args.case]
    if args.sources:
        for case in cases:
            print(f"{case.name}: {case.source}\n    {case.setup}")
            if case.node:
                print(f"    compute given: {case.node:g} {case.unit} on {case.per_node} GPUs, from {case.node_source}")
        return 0
    started, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as scratch:
        for index, case in enumerate(cases, 1):  # each case's predict is a few seconds
            print(f"[{index}/{len(cases)}] {case.name} (elapsed {time.perf_counter() - started:.0f} s)",
                  file=sys.stderr, flush=True)
            rows += predict_case(case, Path(scratch), args.ethernet)
    print(f"defaults: {DEFAULTS}")
    if args.ethernet:
        print(f"WHAT-IF, not the check: the Ethernet cases at {args.ethernet[0]:g} of the line and "
              f"{args.ethernet[1]} a message, in place of predict's defaults")
    print(tabulate([[row["case"], row["gpus"], row["nodes"], f"{row['measured']:.1f}", f"{row['predicted']:.1f}",
                     row["unit"], f"{row['error_pct']:+.1f} %", f"{row['efficiency']:.1%}",
                     f"{row['communication_share']:.0%}", f"{row['given']}, {row['given_ms']:.0f} ms", allowed(row)]
                    for row in rows],
                   headers=["case", "GPUs", "nodes", "measured", "predicted", "unit", "error", "measured efficiency",
                            "predicted comm. share", "compute given", "line share allowed"], tablefmt="github"))
    summary = summarise(rows)
    tables = len({case.table_name for case in cases})
    print(f"\n{headline(summary, tables)}")
    beyond = [row for row in rows if out_of_reach(row)]
    print("line share allowed: the most of the line rate the gradients' bytes can have crossed a node's link at for "
          "the measured throughput, had nothing overlapped backward; (*) less than the link kind's share in predict: "
          "those bytes at predict's rate leave part of the measured time that only per-message latency or a lower "
          "achieved rate can fill, whatever the overlap: "
          + (", ".join(f"{row['case']} at {row['gpus']} GPUs ({row['error_pct']:+.1f} %)" for row in beyond)
             or "none"))
    print(ethernet_check(rows))
    compared = winners(rows)
    if compared:
        print("\nwhere two systems ran on one cluster, the measured and the predicted winner:")
        print(tabulate([[w["cluster"], w["gpus"], w["measured_winner"], f"{w['gap_pct']:.0f} %",
                         w["predicted_winner"], "yes" if w["measured_winner"] == w["predicted_winner"] else "NO"]
                        for w in compared],
                       headers=["cluster", "GPUs", "measured winner", "by", "predicted winner", "same"],
                       tablefmt="github"))
    if args.out:
        # JSON has no infinity: a point measured no slower than its compute allows any share, "any"
        points = [{**row, "line_share_allowed": "any"} if row["line_share_allowed"] == float("inf") else row
                  for row in rows]
        what_if = {"ethernet_what_if": {"share": args.ethernet[0], "latency": args.ethernet[1]}} if args.ethernet else {}
        Path(args.out).write_text(json.dumps({"defaults": DEFAULTS, **what_if, "summary": summary, "points": points,
                                              "winners": compared}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
