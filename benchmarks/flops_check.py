"""A model's FLOPs a token as ps_bench counts them for MFU (``ps_bench.metrics.flops``:
``FlopCounterMode`` over a forward on the meta device, times three) against the usual estimate,
6N + 12·L·d·T (Chowdhery et al., "PaLM", 2022, appendix B: N the parameters that multiply, the
embedding lookup's left out; L layers of width d; T tokens a sequence), for the Hugging Face
configs shipped with ps_bench.

    python benchmarks/flops_check.py [--models hf:llama3-8b,hf:llama3-70b] [--sequence-length 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ps_bench.config import RunConfig  # noqa: E402
from ps_bench.metrics.flops import model_flops_per_sample  # noqa: E402
from ps_bench.models import DATA, DATA_PRESETS, MODELS, default_data, model_entry  # noqa: E402
from ps_bench.models.entries import Entry, construct, load_entry  # noqa: E402


def compare(model: str, tokens: int) -> list:
    entry = model_entry(model, {}, RunConfig().model_config_path)
    data = load_entry(RunConfig().data_config_path, default_data(entry), "data_class", DATA, "data",
                      DATA_PRESETS)
    data = Entry(data.id, data.class_name, {**data.kwargs, "sequence_length": tokens}, data.source)
    counted = model_flops_per_sample(entry, data, MODELS, DATA) / tokens
    network = construct(entry, MODELS)
    config = network.model.config
    parameters = sum(p.numel() for p in network.parameters())
    embedding = network.model.get_input_embeddings().weight
    output = network.model.get_output_embeddings().weight
    lookup = 0 if embedding is output else embedding.numel()  # tied: it multiplies, as the head
    estimate = 6 * (parameters - lookup) + 12 * config.num_hidden_layers * config.hidden_size * tokens
    return [model, f"{parameters / 1e9:.3f} B", tokens, f"{counted / 1e9:.3f}", f"{estimate / 1e9:.3f}",
            f"{counted / estimate - 1:+.2%}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="hf:llama3-8b,hf:llama3-70b")
    parser.add_argument("--sequence-length", type=int, default=4096)
    args = parser.parse_args()
    rows = [compare(model.strip(), args.sequence_length) for model in args.models.split(",")]
    print(tabulate(rows, headers=["model", "parameters", "tokens", "counted GFLOP a token",
                                  "6N + 12LdT GFLOP a token", "difference"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
