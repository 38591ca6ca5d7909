"""Tokens a second and model FLOPs utilisation (MFU), as language-model trainers report them.

A model's FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over a forward of one sample of its
data on the meta device (nothing is allocated), times three: backward's two matrix products for
each of the forward's, the model FLOPs MFU counts (Chowdhery et al., "PaLM", 2022, appendix B:
6N + 12·L·H·Q·T a token for a transformer, N the parameters that multiply, L layers of H heads
of size Q, T tokens). A recomputed unit's forward again (``--activation-checkpointing``) is not
counted: MFU is the model's FLOPs, not the hardware's. FlopCounterMode counts matrix products
and attention in full (a causal mask's skipped half too, as 12·L·H·Q·T does), not elementwise
operations.

MFU is the model FLOPs a second of one trainer over its GPU's dense peak in the run's precision:
``--peak-tflops``, else the table below (each vendor's data sheet, dense: without the 2:4
sparsity its headline figures double), for the GPU the run's CUDA trainers ran on; on a CPU
without ``--peak-tflops`` there is none."""

from __future__ import annotations

import torch

from ps_bench.models.entries import Entry, construct
from ps_bench.models.huggingface import unpacked_on_meta

# dense TFLOP/s a GPU: (bf16 and fp16 on tensor cores, fp32 without TF32: torch's default for
# matrix products), by a name torch.cuda.get_device_name contains, the more specific first
PEAK_TFLOPS = (
    ("H200", (989.4, 66.9)),  # H200 SXM data sheet
    ("H100 PCIe", (756.5, 51.2)),  # H100 PCIe data sheet
    ("H100", (989.4, 66.9)),  # H100 SXM data sheet
    ("A100", (312.0, 19.5)),  # A100 data sheet
    ("L40S", (362.1, 91.6)),  # L40S data sheet
    ("L4", (121.0, 30.3)),  # L4 data sheet
    ("V100", (125.0, 15.7)),  # V100 SXM2 data sheet: fp16 (no bf16)
)


def sequence_length(data: Entry) -> int | None:
    """The tokens in one sample of a data entry (None: its samples are not sequences)."""
    length = data.kwargs.get("sequence_length")
    return int(length) if length else None


def model_flops_per_sample(model: Entry, data: Entry, registry, data_registry) -> int:
    """Three times a forward's FLOPs over one sample of ``data``, on the meta device."""
    # imported here: 0.2 s of torch's on every command's path, which only a model of sequences needs
    from torch.utils.flop_counter import FlopCounterMode

    network = construct(model, registry)
    kwargs = {**network.fitted_data(data.kwargs), "sample_count": 1}
    batch = data_registry.get(data.class_name)(**kwargs).build(0)
    inputs = tuple(tensor.to("meta") for tensor in batch.inputs)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), unpacked_on_meta(network):
        network(*inputs)
    return 3 * counter.get_total_flops()


def peak_tflops(given: float | None, devices: list[str],
                precision: str) -> tuple[float, str] | None:
    """The dense peak one trainer's GPU reaches in ``precision``, and where it comes from:
    ``given`` (``--peak-tflops``), else the table's entry for the first of ``devices`` (None: no
    peak known, a CPU run)."""
    if given is not None:
        return given, "--peak-tflops"
    for name, (half, single) in PEAK_TFLOPS:
        if devices and name in devices[0]:
            return (half if precision in ("bf16", "fp16") else single,
                    f"{devices[0]}, dense {precision}")
    return None


def throughput_of(samples_per_s: float, trainers: int, tokens: int | None, flops: int | None,
                  peak: tuple[float, str] | None) -> dict:
    """What a run's throughput adds for a model of sequences: tokens a second (all the trainers,
    and a trainer's), its model FLOPs a token, and with a peak, the MFU of a trainer."""
    if not tokens:
        return {}
    per_trainer = samples_per_s / max(1, trainers)
    out = {"tokens_per_s": samples_per_s * tokens, "tokens_per_s_per_trainer": per_trainer * tokens}
    if flops:
        out["model_flops_per_token"] = flops / tokens
        out["model_tflops_per_s_per_trainer"] = per_trainer * flops / 1e12
        if peak is not None:
            out["mfu"] = per_trainer * flops / 1e12 / peak[0]
            out["peak_tflops"], out["peak_from"] = peak
    return out
