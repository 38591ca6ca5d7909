"""Llama-3-8B and Llama-3-70B on nodes of 8 GPUs, 8 to 16,384 GPUs, under failures: each
strategy's predicted step time, goodput and effective training time ratio, and the checkpoint
interval of the strategies that restart, from ``bench.py predict --mtbf`` alone (no run), as
docs/predict.md shows them.

The inputs, one set for every row: the model, node, links and compute of
``benchmarks/memory_table.py`` (bf16, AdamW, one sequence of 4096 tokens a GPU, forward at 40 % of
an H100's dense bf16); one GPU's mean time between failures of 7.9 h x 1,024 (Meta's measured
7.9 h at 1,024 GPUs, Kokolis et al., arXiv 2410.21680), so 29.6 minutes at 16,384 GPUs; a
checkpoint of 5 minutes and a restart of 10 minutes. Those are stated assumptions, not
measurements.

    python benchmarks/goodput_table.py [--out results/goodput_table]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate

from memory_table import MODELS, compute_ms

ROOT = Path(__file__).resolve().parent.parent
HOOKS = "allreduce,fsdp,torchft_diloco,ps_node"
NODES = "1,16,128,1024,2048"
GPU_MTBF = "8090h"  # 7.9 h at 1,024 GPUs
CHECKPOINT, RESTART = "5min", "10min"
TOKENS = 4096


def predict(model: str, out: Path) -> dict:
    command = [sys.executable, str(ROOT / "bench.py"), "predict", "--model", model,
               "--batch-size", "1", "--sequence-length", str(TOKENS),
               "--compute-ms", compute_ms(MODELS[model], TOKENS), "--nodes", NODES,
               "--per-node", "8", "--hooks", HOOKS, "--optimizer", "adamw",
               "--precision", "bf16", "--reduce-dtype", "bf16",
               "--link", "3200gbit", "--link-kind", "infiniband",
               "--intra-link", "3600gbit", "--intra-link-kind", "nvlink",
               "--mtbf", GPU_MTBF, "--checkpoint-time", CHECKPOINT, "--restart-time", RESTART,
               "--out", str(out)]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/goodput_table")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        predicted = predict(model, out / f"{model.split(':')[-1]}.json")
        rows = [[row["trainers"], row["strategy"] + (f" ({row['servers']} server)" if row["servers"] else ""),
                 f"{row['batch_ms']:.0f}", f"{row['samples_per_s']:.1f}",
                 f"{row['mtbf_s'] / 60:.1f}", f"{row['ettr']:.3f}", f"{row['goodput_samples_per_s']:.1f}",
                 "-" if row.get("checkpoint_interval_s") is None else f"{row['checkpoint_interval_s'] / 60:.1f}"]
                for row in predicted["predictions"]]
        print(f"\n{model}, {TOKENS} tokens a GPU, one GPU's MTBF {GPU_MTBF}, checkpoint {CHECKPOINT}, "
              f"restart {RESTART}")
        print(tabulate(rows, headers=["GPUs", "strategy", "step ms", "samples/s", "cluster MTBF min",
                                      "ETTR", "goodput samples/s", "checkpoint every min"],
                       tablefmt="github"))
        fastest = {w["trainers"]: w["strategy"] for w in predicted["winners"]}
        for w in predicted["goodput_winners"]:
            same = "the same" if w["strategy"] == fastest.get(w["trainers"]) else \
                f"where the fastest is {fastest.get(w['trainers'])}"
            print(f"  {w['trainers']} GPUs: most goodput {w['strategy']} ({same})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
