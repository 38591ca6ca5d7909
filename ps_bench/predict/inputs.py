"""What ``bench.py predict`` is asked for, read from its command line: counts, rates and
latencies, the compute phases of ``--compute-ms``, and DDP's buckets for a model built on the
meta device (sizes only), with their ready times spread over backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ps_bench.runtime.network import parse_delay, parse_rate
from ps_bench.config import ConfigError, RunConfig
from ps_bench.models import MODELS, model_entry
from ps_bench.models.entries import construct

PHASES = ("forward", "backward", "optimizer")


def count_list(text: str, name: str, allow_auto: bool = False) -> list[int | str]:
    values: list[int | str] = []
    for item in text.split(","):
        item = item.strip()
        if allow_auto and item == "auto":
            values.append("auto")
            continue
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"--{name}: expected whole numbers separated by commas"
                              f"{' or auto' if allow_auto else ''}; got {text!r}") from None
        if value < 1:
            raise ConfigError(f"--{name} must be at least 1; got {value}")
        values.append(value)
    return values


def parse_target_rate(text: str, name: str = "--link") -> float:
    try:
        return parse_rate(text)
    except ConfigError:
        raise ConfigError(f"{name}: expected a rate with its unit, above 0, e.g. 25gbit, 100gbit, "
                          f"500mbit; got {text!r}") from None


def parse_target_latency(text: str) -> float:
    try:
        return parse_delay(text)
    except ConfigError:
        raise ConfigError(f"--latency: expected a time with its unit, e.g. 5us, 1ms; "
                          f"got {text!r}") from None


def parse_phases(text: str) -> dict[str, float]:
    """``forward=F,backward=B,optimizer=O`` (ms) as a dict; every phase, each at least 0."""
    phases = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            phases[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--compute-ms: expected forward=F,backward=B,optimizer=O in ms; "
                              f"got {text!r}") from None
    missing = [name for name in PHASES if name not in phases]
    extra = [name for name in phases if name not in PHASES]
    if missing or extra:
        raise ConfigError(
            f"--compute-ms: "
            f"{'missing ' + ', '.join(missing) if missing else 'unknown ' + ', '.join(extra)}"
            f"; expected forward=F,backward=B,optimizer=O in ms")
    if any(value < 0 for value in phases.values()):
        raise ConfigError(f"--compute-ms: a phase cannot take less than 0 ms; got {text!r}")
    return phases


def meta_buckets(network: torch.nn.Module, bucket_cap_mb: float) -> list[tuple[int, bool]]:
    """DDP's buckets for ``network`` (built on the meta device: sizes only), in the order backward
    makes them ready: ``(bytes, sparse)``. DDP assigns the parameters in reverse order (the
    last layer's gradient is ready first) to buckets of at most 1 MiB first, then
    ``bucket_cap_mb``, as ``torch.distributed._compute_bucket_assignment_by_size`` does for it."""
    parameters = [p for p in network.parameters() if p.requires_grad][::-1]
    sparse = {id(module.weight) for module in network.modules() if getattr(module, "sparse", False)}
    indices, _ = dist._compute_bucket_assignment_by_size(
        parameters, [dist._DEFAULT_FIRST_BUCKET_BYTES, int(bucket_cap_mb * 1024 * 1024)],
        [id(p) in sparse for p in parameters])
    return [(sum(parameters[i].numel() * parameters[i].element_size() for i in bucket),
             any(id(parameters[i]) in sparse for i in bucket)) for bucket in indices]


def model_buckets(model: str, bucket_cap_mb: float,
                  options: dict | None = None) -> list[tuple[int, bool]]:
    """``meta_buckets`` of what ``--model`` names (a zoo model, one of the model configuration
    file, or a Hugging Face config), with ``--model-option``s."""
    entry = model_entry(model, options or {}, RunConfig().model_config_path)
    return meta_buckets(construct(entry, MODELS), bucket_cap_mb)


def spread(backward_ms: float, buckets: list[tuple[int, bool]]) -> list[tuple[float, int, bool]]:
    """``(ready ms, bytes, sparse)``: each bucket ready when backward has made its share of the
    gradients, in proportion to their bytes (layers' backward time taken as proportional to
    their gradients)."""
    total, made, timed = sum(nbytes for nbytes, _ in buckets) or 1, 0, []
    for nbytes, sparse in buckets:
        made += nbytes
        timed.append((backward_ms * made / total, nbytes, sparse))
    return timed
