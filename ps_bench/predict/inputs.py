"""What ``bench.py predict`` is asked for, read from its command line: counts, rates and
latencies, the compute phases of ``--compute-ms``, and DDP's buckets for a model built on the
meta device (sizes only), with when backward makes each ready, from the FLOPs of its layers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ps_bench.config import ConfigError, RunConfig
from ps_bench.metrics.costs import Link
from ps_bench.models import DATA, DATA_PRESETS, MODELS, default_data, model_entry
from ps_bench.models.entries import Entry, construct, load_entry
from ps_bench.options import plural
from ps_bench.predict.memory import (ModelFacts, largest_layer, meta_friendly,
                                     saved_activations)
from ps_bench.strategies import recompute
from ps_bench.strategies.sharded import shard_units
from ps_bench.runtime.network import parse_delay, parse_rate

PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class LinkKind:
    """What a kind of link achieves of its line rate, and what each message step costs: predict's
    defaults for ``--link`` and ``--intra-link`` (docs/predict.md, "Links: line rates in")."""

    efficiency: float  # the share of the line rate a large transfer achieves
    latency_us: float  # per message step of a collective, or per push
    why: str


LINK_KINDS = {
    "ethernet": LinkKind(0.8, 50.0, "TCP through the kernel: framing leaves 0.94 of the line, the "
                                    "kernel's copies and the libraries' socket transports less"),
    "roce": LinkKind(0.9, 5.0, "RDMA over Converged Ethernet: no kernel copy; RoCEv2's headers and "
                               "the collective library's protocol take the rest"),
    "infiniband": LinkKind(0.9, 5.0, "RDMA: EDR's 64b/66b encoding leaves 0.97 of the line, the "
                                     "collective library's protocol less"),
    "nvlink": LinkKind(0.8, 5.0, "GPU to GPU: a collective's rings use most of the links' rate"),
    "pcie": LinkKind(0.8, 5.0, "128b/130b encoding and transaction headers leave about 0.85 of the "
                               "line to large copies"),
}
NETWORK_KINDS, LOCAL_KINDS = ("ethernet", "roce", "infiniband"), ("nvlink", "pcie", "ethernet")


@dataclass(frozen=True)
class TargetLink:
    """A link to predict for, as the user gave it: its line rate and kind, and what predict makes
    of them (``LINK_KINDS``, or the options that override them)."""

    flag: str
    line_bps: float
    kind: str
    efficiency: float
    latency_s: float

    def link(self) -> Link:
        return Link.of(self.latency_s * 1e6, self.line_bps * self.efficiency / 1e9)

    def describe(self) -> str:
        return (f"{self.flag} {self.line_bps / 1e9:g} Gbit/s {self.kind}, {self.efficiency:g} of "
                f"it: {self.line_bps * self.efficiency / 1e9:g} Gbit/s, latency "
                f"{self.latency_s * 1e6:g} us")


def target_link(flag: str, rate: str, kind: str, efficiency: float | None,
                latency: str | None) -> TargetLink:
    """A ``TargetLink`` from the command line: the line rate, its kind's defaults, and the
    efficiency and latency where given; ConfigError for anything out of range."""
    line_bps = parse_rate(rate, flag)
    if efficiency is not None and not 0 < efficiency <= 1:
        raise ConfigError(f"{flag}-efficiency must be a share of the line rate, above 0 and at "
                          f"most 1; got {efficiency}")
    defaults = LINK_KINDS[kind]
    latency_s = (parse_delay(latency, "--latency") if latency is not None
                 else defaults.latency_us / 1e6)
    return TargetLink(flag, line_bps, kind,
                      defaults.efficiency if efficiency is None else efficiency, latency_s)


def target_links(args) -> tuple[TargetLink | None, TargetLink | None]:
    """``--link``'s and ``--intra-link``'s ``TargetLink``, each of its kind (by default
    Ethernet's and PCIe's); a kind or efficiency given without the rate it describes is refused,
    where it was passed over."""
    links = []
    for flag, name, kind, latency in (("--link", "link", "ethernet", args.latency),
                                      ("--intra-link", "intra_link", "pcie", None)):
        described = [f"{flag}-{word}" for word in ("kind", "efficiency")
                     if getattr(args, f"{name}_{word}") is not None]
        if getattr(args, name) is None and described:
            raise ConfigError(f"{' and '.join(described)} describe{'s' * (len(described) == 1)} "
                              f"{flag}: give {flag} RATE too (neither applies to a link fitted "
                              f"to runs)")
        links.append(None if getattr(args, name) is None else target_link(
            flag, getattr(args, name), getattr(args, f"{name}_kind") or kind,
            getattr(args, f"{name}_efficiency"), latency))
    return links[0], links[1]


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
    if not all(0 <= value < math.inf for value in phases.values()):
        raise ConfigError(f"--compute-ms: each phase takes a number of ms, 0 or more; got {text!r}")
    return phases


def bucket_parameters(network: torch.nn.Module,
                      bucket_cap_mb: float) -> list[list[torch.nn.Parameter]]:
    """The parameters of each of DDP's buckets for ``network``, in the order backward makes them
    ready. DDP assigns the parameters in reverse order (the last layer's gradient is ready first)
    to buckets of ``bucket_cap_mb``, as ``torch.distributed._compute_bucket_assignment_by_size``
    does for it. Its first bucket is of 1 MiB only where ``bucket_cap_mb`` is not given; a
    trainer gives it (``RunConfig.bucket_cap_mb``), and so does a user who sets the cap."""
    parameters = [p for p in network.parameters() if p.requires_grad][::-1]
    sparse = {id(module.weight) for module in network.modules() if getattr(module, "sparse", False)}
    indices, _ = dist._compute_bucket_assignment_by_size(
        parameters, [int(bucket_cap_mb * 1024 * 1024)], [id(p) in sparse for p in parameters])
    return [[parameters[i] for i in bucket] for bucket in indices]


def meta_buckets(network: torch.nn.Module, bucket_cap_mb: float) -> list[tuple[int, bool, int]]:
    """DDP's buckets for ``network`` (built on the meta device: sizes only), in the order backward
    makes them ready (``bucket_parameters``): ``(bytes, sparse, tensors)``."""
    sparse = {id(module.weight) for module in network.modules() if getattr(module, "sparse", False)}
    return [(sum(p.numel() * p.element_size() for p in bucket),
             any(id(p) in sparse for p in bucket), len(bucket))
            for bucket in bucket_parameters(network, bucket_cap_mb)]


class FirstUses(TorchDispatchMode):
    """Under ``counter`` (a ``FlopCounterMode`` entered before it), the FLOPs counted before each
    of ``parameters`` is first an operand of an operation: ``first`` maps its id to that count."""

    def __init__(self, counter: FlopCounterMode, parameters: set[int]) -> None:
        super().__init__()
        self.counter, self.parameters, self.first = counter, parameters, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for operand in tree_leaves((args, kwargs or {})):
            if id(operand) in self.parameters:
                self.first.setdefault(id(operand), self.counter.get_total_flops())
        return func(*args, **(kwargs or {}))


def backward_shares(network: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                    recomputed: list[torch.nn.Module] = ()
                    ) -> tuple[dict[int, float], float, int]:
    """Parameter id -> the share of backward done when its gradient is ready, from the FLOPs of
    a forward pass on the meta device (``torch.utils.flop_counter.FlopCounterMode``): backward
    runs the forward's operations in reverse, each taken to cost in proportion to its forward
    FLOPs, so a parameter's gradient is ready once backward has undone everything from the
    first operation that used it on (its first use is its gradient's last contribution: a tied
    embedding is ready at its earlier use; a weight that its module's parent uses itself, as
    ``nn.MultiheadAttention`` uses its ``out_proj``, where the parent uses it). A parameter no
    operation used is ready at the end. Also the share of the forward's FLOPs done inside
    ``recomputed`` (the units ``--activation-checkpointing`` runs again inside backward), and the
    forward's FLOPs. Raises
    where the model's forward cannot run on the meta device (a step whose shape depends on the
    data, as a mixture of experts' routing)."""
    counter = FlopCounterMode(display=False)
    uses = FirstUses(counter, {id(parameter) for parameter in network.parameters()})
    inside = [0.0]
    hooks = [hook for unit in recomputed for hook in (
        unit.register_forward_pre_hook(lambda *_: inside.append(-counter.get_total_flops())),
        unit.register_forward_hook(lambda *_: inside.append(counter.get_total_flops())))]
    try:
        with counter, uses, torch.no_grad(), meta_friendly(network):
            network(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    total = counter.get_total_flops() or 1
    return ({id(parameter): (total - uses.first[id(parameter)]) / total
             if id(parameter) in uses.first else 1.0 for parameter in network.parameters()},
            sum(inside) / total, counter.get_total_flops())


def module_calls(network: torch.nn.Module, called: list[tuple[bool, torch.nn.Module]] | None = None
                 ) -> list[tuple[bool, list[tuple[int, int]]]]:
    """Forward's module calls, ``(True, parameters)`` as each module starts and ``(False,
    parameters)`` as it ends, with the ``(parameter index, elements)`` it holds itself: those
    ``called`` recorded (a forward on the meta device), else each module with parameters of its
    own started and ended in the order the model registered them. The trace ZeRO-3 gathers and
    releases its parameters by (``deepspeed_config.zero3_gathers``)."""
    index = {id(parameter): place for place, parameter in enumerate(network.parameters())}

    def own(module: torch.nn.Module) -> list[tuple[int, int]]:
        return [(index[id(parameter)], parameter.numel())
                for parameter in module.parameters(recurse=False)]

    if called:
        return [(starts, own(module)) for starts, module in called]
    holding = [held for held in map(own, network.modules()) if held]
    return [(starts, held) for held in holding for starts in (True, False)]


def fsdp_units(network: torch.nn.Module) -> tuple[int, int]:
    """The parameters of FSDP2's root unit and of its largest other unit, as ``fsdp`` wraps the
    model: each parameter belongs to the innermost unit that holds it, the rest to the root."""
    owner: dict[int, int] = {}
    units = shard_units(network)
    for place, unit in enumerate(units):  # outer units come first: the innermost one wins
        for parameter in unit.parameters():
            owner[id(parameter)] = place
    sizes = [0] * len(units)
    root = 0
    for parameter in network.parameters():
        if id(parameter) in owner:
            sizes[owner[id(parameter)]] += parameter.numel()
        else:
            root += parameter.numel()
    return root, max(sizes, default=0)


def model_buckets(model: str, bucket_cap_mb: float, options: dict | None = None,
                  batch_size: int | None = None, sequence_length: int | None = None,
                  precision: str = "fp32", data_entry: dict | None = None,
                  checkpointing: str = "none",
                  ) -> tuple[list[tuple[int, bool, int]], list[float] | None, str, ModelFacts]:
    """``meta_buckets`` of what ``--model`` names (a zoo model, one of the model configuration
    file, or a Hugging Face config), with ``--model-option``s; with ``batch_size``, when each is
    ready, as a share of backward (``backward_shares`` over a batch of the model's own data, of
    ``sequence_length`` where it has sequences, on the meta device; None where the forward cannot
    run there), and how that was found; and what predict's memory needs of it
    (``predict.memory``), its activations under ``checkpointing`` (``--activation-checkpointing``).
    The data: ``data_entry`` (a run's, as its results file resolved it), else the model's own."""
    entry = model_entry(model, options or {}, RunConfig().model_config_path)
    network = construct(entry, MODELS)
    buckets = bucket_parameters(network, bucket_cap_mb)
    sizes = meta_buckets(network, bucket_cap_mb)
    parameters = sum(p.numel() for p in network.parameters())
    facts = ModelFacts(parameters, largest_layer(network), None, "no batch given",
                       sum(1 for _ in network.parameters()), *fsdp_units(network),
                       [[list(p.shape) for p in bucket]
                        for bucket, (_, sparse, _) in zip(buckets, sizes) if not sparse],
                       module_calls(network))
    if batch_size is None:
        return sizes, None, "no batch given", facts
    data = (Entry(data_entry["id"], data_entry["class"], dict(data_entry["configurations"]),
                  data_entry["source"]) if data_entry else
            load_entry(RunConfig().data_config_path, default_data(entry), "data_class", DATA,
                       "data", DATA_PRESETS))
    kwargs = {**network.fitted_data(data.kwargs), "sample_count": batch_size}
    if sequence_length is not None:
        if "sequence_length" not in kwargs:
            raise ConfigError(f"--sequence-length: the data of {model} ({data.id}) has no "
                              f"sequences")
        kwargs["sequence_length"] = sequence_length
    called: list[tuple[bool, torch.nn.Module]] = []
    hooks = [hook for module in network.modules() for hook in (
        module.register_forward_pre_hook(lambda module, _: called.append((True, module))),
        module.register_forward_hook(lambda module, *_: called.append((False, module))))]
    try:
        batch = DATA.get(data.class_name)(**kwargs).build(0)
        inputs = tuple(t.to("meta") for t in batch.inputs)
        recomputed = recompute.recomputed_units(network, checkpointing)
        shares, facts.recomputed, forward = backward_shares(network, inputs, recomputed)
        facts.model_flops = 3 * forward // batch_size  # a sample's, as MFU counts (metrics.flops)
        facts.modules = module_calls(network, called)
    except Exception as error:  # noqa: BLE001 - any op without a meta kernel: said, and passed over
        facts.activations_from = "the model's forward did not run on the meta device"
        return sizes, None, (f"the model's forward did not run on the meta device "
                             f"({type(error).__name__}), so by bytes"), facts
    finally:
        for hook in hooks:
            hook.remove()
    shape = "x".join(str(n) for n in inputs[0].shape)
    named = (data.id if sequence_length is None
             else f"{data.id} at --sequence-length {sequence_length}")
    facts.activations_bytes, facts.cast_weights = saved_activations(
        network, inputs, precision, batch.targets.to("meta"), checkpointing)
    facts.checkpointing = checkpointing
    recomputing = (f", activation checkpointing {checkpointing}" if checkpointing != "none"
                   else "")
    facts.activations_from = (f"saved for backward by a forward of {shape} {named} and its "
                              f"loss ({precision}{recomputing}) on the meta device")
    return sizes, [max(shares.get(id(p), 1.0) for p in bucket) for bucket in buckets], (
        f"FLOPs of a forward of {plural(batch_size, 'sample')} of --data {named} on the meta "
        f"device"), facts


def spread(backward_ms: float, buckets: list[tuple]) -> list[tuple]:
    """Each bucket (``(bytes, sparse[, tensors])``) with, first, when it is ready: when backward
    has made its share of the gradients, in proportion to their bytes (layers' backward time
    taken as proportional to their gradients)."""
    total, made, timed = sum(bucket[0] for bucket in buckets) or 1, 0, []
    for bucket in buckets:
        made += bucket[0]
        timed.append((backward_ms * made / total, *bucket))
    return timed
