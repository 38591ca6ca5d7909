"""Llama-3-8B and Llama-3-70B on nodes of 8 GPUs of 80 GB, 8 to 1024 GPUs: each strategy's
memory per GPU and predicted step time, from ``bench.py predict`` alone (no run: the compute is
given, see ``compute_ms``), as docs/memory.md shows them.

The inputs, one set for every row: bf16 with AdamW (DeepSpeed casts the model and keeps float32
master weights; torch's strategies run autocast over float32 parameters), FSDP2 and HSDP
gathering and reducing in bf16 (``--reduce-dtype bf16``, as DeepSpeed does), a micro-batch of one
sequence of ``--sequence-length`` tokens a GPU, ``--activation-checkpointing`` as given (default
none; with it, backward also runs the recomputed units' forward again). The node: 8 GPUs on
NVLink at 3600 Gbit/s each way (an H100's 900 GB/s, both ways together) and 3200 Gbit/s of
InfiniBand (8 x 400 Gbit/s) as its one network link. The compute: forward 2 x parameters x
tokens FLOPs at 40 % of an H100's 989 TFLOP/s of dense bf16, backward twice that, the
optimizer 10 ms. Those are assumptions, not measurements; the memory is what predict counts
(``ps_bench.predict.memory``).

    python benchmarks/memory_table.py [--sequence-length 4096] [--activation-checkpointing full]
        [--out results/memory_table]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"hf:llama3-8b": 8.030e9, "hf:llama3-70b": 70.554e9}  # parameters
HOOKS = "allreduce,zero1,fsdp,hsdp,deepspeed_zero2,deepspeed_zero3"
NODES = "1,4,16,64,128"
FLOPS = 989e12 * 0.40  # an H100's dense bf16, at 40 % of it
GIB = 2 ** 30


def compute_ms(parameters: float, tokens: int) -> str:
    forward = 2 * parameters * tokens / FLOPS * 1e3
    return f"forward={forward:.1f},backward={2 * forward:.1f},optimizer=10"


def predict(model: str, tokens: int, out: Path, checkpointing: str = "none") -> dict:
    command = [sys.executable, str(ROOT / "bench.py"), "predict", "--model", model,
               "--batch-size", "1", "--sequence-length", str(tokens),
               "--compute-ms", compute_ms(MODELS[model], tokens), "--nodes", NODES,
               "--per-node", "8", "--hooks", HOOKS, "--optimizer", "adamw",
               "--precision", "bf16", "--reduce-dtype", "bf16", "--gpu-memory", "80GB",
               "--link", "3200gbit", "--link-kind", "infiniband",
               "--intra-link", "3600gbit", "--intra-link-kind", "nvlink", "--out", str(out),
               "--activation-checkpointing", checkpointing]
    printed = subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    for line in printed.splitlines():  # what the recomputation costs
        if "activation checkpointing" in line and "recomputes" in line:
            print(line.strip())
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--activation-checkpointing", default="none",
                        choices=("none", "full", "selective"))
    parser.add_argument("--out", default="results/memory_table")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        predicted = predict(model, args.sequence_length, out / f"{model[3:]}.json",
                            args.activation_checkpointing)
        rows = predicted["predictions"]
        each = sorted({row["activations_bytes"] for row in rows})  # autocast's copies, or none
        copies = f" ({each[-1] / GIB:.1f} where the trainers autocast)" if len(each) > 1 else ""
        print(f"\n{model}, {args.sequence_length} tokens a GPU, activation checkpointing "
              f"{args.activation_checkpointing}: activations {each[0] / GIB:.1f} GiB "
              f"a GPU{copies}; states and memory GiB a GPU (parameters + gradients + optimizer + "
              f"gathered layers; + activations), step ms, fits 80 GB\n")
        table = [[row["trainers"], row["strategy"],
                  f"{row['model_states_bytes'] / GIB:.1f}", f"{row['memory_bytes'] / GIB:.1f}",
                  f"{row['batch_ms']:.0f}", "yes" if row["fits"] else "no"] for row in rows]
        print(tabulate(table, headers=["GPUs", "strategy", "states GiB", "memory GiB",
                                       "step ms", "fits"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
