"""Gradient accumulation and mixed precision beside each other, on a shrunk Llama: allreduce,
fsdp, deepspeed_zero2, ps and diloco at ``--grad-accum 1`` and ``8``, in fp32 and bf16.

Every run: 2 trainers on this machine, Llama 3's architecture shrunk to 4 layers of hidden 256
(``--model hf:llama3-8b`` with ``SHRUNK``, 7.1 M parameters, 28.4 MB of float32 gradients),
micro-batches of 2 sequences, SGD, 1 warmup and 2 timed rounds. bf16 is ``--precision bf16``
(autocast for forward and backward; DeepSpeed: its config's bf16, which also makes its wire
bf16); fsdp's reduce dtype stays the parameters' float32 unless ``--reduce-dtype`` is given,
as FSDP2's is.

Prints, for each configuration, the time of an optimizer step and per sample (p50 over the
timed steps of both trainers, over the 2 samples x accumulation of a step), and the bytes a
trainer sends per optimizer step.

    python benchmarks/training_modes.py [--out results/training_modes] [--hooks allreduce,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tabulate import tabulate

from ps_bench.results.load import load_file
from running import ROOT, batch_p50, bench

SHRUNK = ("num_hidden_layers=4,hidden_size=256,intermediate_size=688,num_attention_heads=4,"
          "num_key_value_heads=2,vocab_size=8192")
MICRO = 2  # sequences a micro-batch
RUN = ["--model", "hf:llama3-8b", "--model-option", SHRUNK, "--batch-size", str(MICRO),
       "--ntrainer", "2", "--warmup-rounds", "1", "--rounds", "2"]
HOOKS = {"allreduce": ["--nserver", "0"], "fsdp": ["--nserver", "0"],
         "deepspeed_zero2": ["--nserver", "0"], "ps": ["--nserver", "1"],
         "diloco": ["--nserver", "0", "--hook-option", "period=8"]}


def run(out: Path, hook: str, accum: int, precision: str) -> Path:
    path = out / f"{hook}-ga{accum}-{precision}.json"
    if path.exists():
        return path
    bench("training_modes", f"{hook} --grad-accum {accum} --precision {precision}",
          [*RUN, "--hook", hook, *HOOKS[hook], "--grad-accum", str(accum), "--precision", precision,
           "--out", str(path)])
    print(f"  ran {path.stem}", flush=True)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "results" / "training_modes"),
                        help="folder for the runs (runs already there are reused)")
    parser.add_argument("--hooks", default=",".join(HOOKS), help="which strategies")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for hook in args.hooks.split(","):
        for precision in ("fp32", "bf16"):
            for accum in (1, 8):
                results = load_file(run(out, hook, accum, precision))
                step = batch_p50(results)
                rows.append([hook, precision, accum, f"{step:.1f}", f"{step / (MICRO * accum):.2f}",
                             f"{results['bytes']['trainer_sent_per_iter'] / 1e6:.2f}",
                             f"{results['replicas'].get('param_norm', float('nan')):.4f}"])
    print(tabulate(rows, headers=["strategy", "precision", "grad-accum", "step ms (p50)",
                                  "ms per sample", "MB sent per step", "param_norm"],
                   tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
