"""What each GPU holds under a strategy: the model states (parameters, gradients, optimizer
state) from its record's ``Holds``, the activations saved for backward counted on the meta
device, and whether the sum fits ``--gpu-memory``.

Bytes a parameter, before any sharding:

- parameters: 4 (float32); 2 where an engine with a master copy trains in 16 bits (the
  model cast). torch's strategies under ``--precision bf16|fp16`` run autocast over float32
  parameters, so 4.
- gradients: as the parameters; 0 where 16-bit gradients are reduced into float32 partitions
  as they are made (ZeRO stage 3).
- optimizer: the moments (AdamW 8 and a float32 step count a tensor, SGD with momentum 4,
  without 0); with a master copy its
  float32 weights (4 more: DeepSpeed copies them in float32 training too), and in 16 bits their
  float32 gradients (4 more), as DeepSpeed's estimators count them
  (``estimate_zero2_model_states_mem_needs``: 2 bytes of 16-bit parameters on every GPU and 18
  over the GPUs; ``estimate_zero3_model_states_mem_needs``: 18 over the GPUs).
- ZeRO-3 holds the largest layer's parameters twice whole besides its shard (the layer
  computing and the next, prefetched), in the type it computes in: 4 bytes a parameter of the
  largest layer in 16 bits, DeepSpeed's figure. FSDP2 holds its root unit whole from forward to
  backward (FSDP2 does not reshard the root after forward) and the largest other unit twice, as
  ps_bench wraps the model (a Hugging Face model's blocks, the embeddings and head in the root).
- DiLoCo keeps two more float32 copies (the start point and the outer momentum); a strategy
  whose servers own the parameters keeps no optimizer state on its trainers.

Activations: the bytes of the tensors a forward of one micro-batch saves for backward (its
autograd graph, through ``torch.autograd.graph.saved_tensors_hooks``), each storage once and the
parameters left out, on the meta device, in the model's dtype under ``--precision`` (autocast
keeps some in float32, so a lower bound there), attention counted as a fused kernel saves it
(its inputs, output and a float32 log-sum-exp a row, as torch's flash attention on a GPU). Not
counted: temporary buffers, the allocator's fragmentation, the communication buffers, the CUDA
context. With ``--activation-checkpointing``, a recomputed unit counts its input in place of what
its forward saves (``strategies.recompute``), and one unit's recomputation at a time is not."""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ps_bench.config import ConfigError
from ps_bench.metrics.memory import SavedActivations
from ps_bench.metrics.messages import ELEMENT_BYTES, bucket_factors, square_side
from ps_bench.models.huggingface import unpacked_on_meta
from ps_bench.results.printed import format_bytes
from ps_bench.strategies import HOOKS, hook_options, recompute
from ps_bench.strategies.record import (GRADIENTS, OPTIMIZER, PARAMETERS, SERVER_OWNED, Holds,
                                        Strategy)

HALF = ("bf16", "fp16")
DTYPES = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)  # --precision
UNITS = {"": None, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


@dataclass
class ModelFacts:
    """What the memory model needs of a model: its parameters, its largest layer's (the most any
    one module holds itself, as DeepSpeed's estimators take it), and the activations one
    micro-batch saves for backward (None where its forward cannot run on the meta device); and,
    for a low-rank strategy's payload, the shapes in DDP's buckets."""

    parameters: int
    largest_layer: int
    activations_bytes: int | None
    activations_from: str
    tensors: int = 0  # parameter tensors: AdamW keeps a float32 step count for each
    # FSDP2's units as ps_bench wraps them (strategies.sharded.shard_units): the root's own
    # parameters and the largest other unit's
    root_unit: int = 0
    largest_unit: int = 0
    # the gradient shapes in each of DDP's dense buckets (a low-rank strategy's factors follow
    # them; a sparse bucket is all-reduced as it is, with no error feedback)
    bucket_shapes: list[list[list[int]]] = field(default_factory=list)
    # forward's module calls, (starts, the (parameter, elements) it holds itself): the trace
    # ZeRO-3 gathers and releases them by (``inputs.module_calls``)
    modules: list[tuple[bool, list[tuple[int, int]]]] = field(default_factory=list)
    # the elements of the weights a forward's matrix products and convolutions take: autocast
    # casts them to 16 bits and saves the copies for backward (``saved_activations``)
    cast_weights: int = 0
    # --activation-checkpointing: the mode the activations were counted under, and the share of
    # a forward's FLOPs its recomputed units do again inside backward (``inputs.recomputed_share``)
    checkpointing: str = "none"
    recomputed: float = 0.0
    model_flops: int | None = None  # a sample's model FLOPs, for MFU (``metrics.flops``)


def moments_bytes(optimizer: str, momentum: float) -> int:
    """Optimizer state a parameter, float32: AdamW's two moments; SGD's momentum buffer."""
    return 8 if optimizer == "adamw" else 4 if momentum else 0


def model_states(record: Strategy, facts: ModelFacts, trainers: int, per_node: int,
                 precision: str = "fp32", optimizer: str = "sgd",
                 momentum: float = 0.0, gathered: str = "float32") -> dict[str, int]:
    """The model states one trainer (GPU) holds, bytes, by kind, and their sum; the layers it
    gathers whole in the dtype it gathers them in, ``gathered`` (``Calibration.wire``'s)."""
    holds: Holds = record.holds
    p = facts.parameters
    engine_half = holds.master_copy and precision in HALF
    parameter_bytes = 2 if engine_half else 4
    gradient_bytes = 0 if engine_half and not holds.half_gradients else parameter_bytes
    optimizer_bytes = (0 if record.wrap == SERVER_OWNED
                       else moments_bytes(optimizer, momentum) + (4 if holds.master_copy else 0)
                       + (4 if engine_half else 0))
    shards = per_node if holds.over == "host" else trainers

    def held(kind: str, per_parameter: int) -> int:
        return -(-p * per_parameter // shards) if kind in holds.sharded else p * per_parameter

    # AdamW's step counts: one a tensor it steps (DeepSpeed's: one a flat partition; sharded
    # optimizer state: its share of the tensors; FSDP2's: every tensor's shard)
    steps = (0 if optimizer != "adamw" or record.wrap == SERVER_OWNED else 1 if holds.master_copy
             else -(-facts.tensors // shards) if OPTIMIZER in holds.sharded and not holds.gathers
             else facts.tensors)
    out = {"parameters_bytes": held(PARAMETERS, parameter_bytes) + p * 4 * holds.copies,
           "gradients_bytes": held(GRADIENTS, gradient_bytes),
           "optimizer_bytes": held(OPTIMIZER, optimizer_bytes) + 4 * steps,
           # whole besides the shard: ZeRO-3 the layer computing and the next; FSDP2 its root
           # unit from forward to backward, and a unit and the next
           "gathered_bytes": 0 if not holds.gathers else ELEMENT_BYTES[gathered] * (
               2 * facts.largest_layer if holds.gathers == "layer" else
               facts.root_unit + 2 * facts.largest_unit)}
    out["model_states_bytes"] = sum(out.values())
    return out


def kept_bytes(hook: str, facts: ModelFacts, given: dict | None = None) -> int:
    """What the strategy keeps on the GPU between iterations besides the model states, at its
    default options, then those ``given`` (a run's ``buffers_bytes``): error feedback's residual,
    a float32 copy of each bucket (the compressors); PowerSGD's error of each bucket
    (``batched_powersgd``'s padded to a square) and, with warm start, its P and Q. The parameter
    servers' CPU-only copies are not kept on a GPU."""
    record, options = HOOKS.record(hook), hook_options(hook, given or {})
    sizes = [sum(math.prod(shape) for shape in shapes) for shapes in facts.bucket_shapes]
    if record.factors is not None:
        kept = 0
        for shapes, elements in zip(facts.bucket_shapes, sizes):
            _, p, q = bucket_factors(record.factors, shapes, elements, options)
            kept += ((elements if record.factors == "tensor" else square_side(elements) ** 2)
                     if options["use_error_feedback"] else 0)
            kept += p + q if options["warm_start"] else 0
        return 4 * kept
    feedback = options.get("error_feedback")
    if feedback is None and record.compressor is not None:
        feedback = record.compressor(options).error_feedback
    return 4 * sum(sizes) if feedback else 0


def memory(record: Strategy, facts: ModelFacts, trainers: int, per_node: int,
           precision: str, optimizer: str, momentum: float,
           gpu_memory: int | None, kept: int = 0, gathered: str = "float32") -> dict:
    """A prediction row's memory: the model states, the activations, what the strategy keeps
    between iterations besides (``kept_bytes``), their sum and, with ``gpu_memory``, whether it
    fits."""
    states = model_states(record, facts, trainers, per_node, precision, optimizer, momentum,
                          gathered)
    activations = (None if facts.activations_bytes is None else facts.activations_bytes
                   + autocast_copies(record, facts, precision, gathered))
    total = None if activations is None else states["model_states_bytes"] + activations + kept
    out = {**states, "activations_bytes": activations, "kept_bytes": kept, "memory_bytes": total}
    if gpu_memory is not None:
        out["fits"] = (total if total is not None
                       else states["model_states_bytes"] + kept) <= gpu_memory
    return out


def autocast_copies(record: Strategy, facts: ModelFacts, precision: str, gathered: str) -> int:
    """In 16 bits, a strategy whose trainers autocast float32 parameters (not an engine that
    casts the model, nor one that gathers them in 16 bits) holds autocast's copies of the weights
    its matrix products take, saved for backward: 2 bytes a weight element, whole however the
    parameters are sharded."""
    casts = (precision in HALF and not record.holds.master_copy
             and not (record.holds.gathers and ELEMENT_BYTES.get(gathered, 4) == 2))
    return 2 * facts.cast_weights if casts else 0


def parse_memory(text: str) -> int:
    """``--gpu-memory``: a size with its unit (80GB, 80GiB, 141GB); bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    unit = UNITS.get(match.group(2)) if match else None
    if match is None or unit is None:
        raise ConfigError(f"--gpu-memory must be a size with its unit, e.g. 80GB or 80GiB; got "
                          f"{text!r}")
    size = float(match.group(1)) * unit
    if size < 1:
        raise ConfigError(f"--gpu-memory must be above 0; got {text!r}")
    return int(size)


def largest_layer(network: torch.nn.Module) -> int:
    """The most parameters one module holds itself (not its children's)."""
    return max((sum(p.numel() for p in module.parameters(recurse=False))
                for module in network.modules()), default=0)


# the operators autocast runs in 16 bits whose operands include weights (torch.amp's list, as
# they reach aten: linear as addmm or mm of the weight's transpose, conv as convolution)
CAST_OPS = ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "convolution", "matmul")


class CastWeights(TorchDispatchMode):
    """The parameters (through their views) that reach the operators autocast casts."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: dict[int, int] = {}
        self.recomputing = 0  # inside units recomputed in backward: their copies are not kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in CAST_OPS and not self.recomputing:
            for arg in tree_leaves((args, kwargs or {})):
                base = arg._base if isinstance(arg, torch.Tensor) and arg._base is not None else arg
                if isinstance(base, torch.nn.Parameter):
                    self.elements[id(base)] = base.numel()
        return func(*args, **(kwargs or {}))


def saved_activations(network: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                      precision: str = "fp32", targets: torch.Tensor | None = None,
                      checkpointing: str = "none") -> tuple[int, int]:
    """The bytes of the tensors one forward (and, with ``targets``, the trainers' loss of it)
    saves for backward, each storage once, the parameters left out: on the meta device, so
    nothing is allocated (see the module). The loss in float32, as autocast computes it: a
    language model's log-probabilities of every token of its vocabulary. ``checkpointing``: the
    units ``--activation-checkpointing`` recomputes keep their inputs alone (the network is
    wrapped in place, as a trainer wraps it)."""
    recompute.apply(network, checkpointing)
    dtype = DTYPES[precision]
    if dtype != torch.float32:
        network = network.to(dtype)
        inputs = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
    cast = CastWeights()
    hooks = [hook for unit in network.modules() if isinstance(unit, recompute.CheckpointWrapper)
             for hook in (unit.register_forward_pre_hook(lambda *_: cast_depth(cast, 1)),
                          unit.register_forward_hook(lambda *_: cast_depth(cast, -1)))]
    try:
        with (SavedActivations() as saved, torch.enable_grad(),
              meta_friendly(network, fused=True), cast):
            output = network(*inputs)
            if targets is not None:
                torch.nn.functional.cross_entropy(output.float(), targets)
    finally:
        for hook in hooks:
            hook.remove()
    return saved.nbytes, sum(cast.elements.values())


def cast_depth(cast: CastWeights, step: int) -> None:  # into (1) or out of a recomputed unit
    cast.recomputing += step


class FusedAttention(torch.autograd.Function):
    """Scaled dot-product attention as a fused kernel runs it on a GPU (torch's flash and
    memory-efficient ones): it saves the query, key, value, output and the log-sum-exp of each
    row, never the sequence-by-sequence scores, which the meta device's decomposition would."""

    @staticmethod
    def forward(ctx, query, key, value):  # noqa: D102 - the kernel's saved tensors, no values
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102 - never run: memory is counted on forward
        query, key, value, _, _ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


def fused_attention(query, key, value, *args, **kwargs):
    return FusedAttention.apply(query, key, value)


@contextlib.contextmanager
def meta_friendly(network: torch.nn.Module, fused: bool = False):
    """Around a forward on the meta device: a Hugging Face causal mask told the data is never
    packed (``unpacked_on_meta``); with ``fused``, attention saves what a fused kernel saves
    (``FusedAttention``)."""
    functional = torch.nn.functional
    attention = functional.scaled_dot_product_attention
    if fused:
        functional.scaled_dot_product_attention = fused_attention
    try:
        with unpacked_on_meta(network):
            yield
    finally:
        functional.scaled_dot_product_attention = attention


def add_arguments(parser) -> None:
    """predict's memory options."""
    parser.add_argument("--gpu-memory", metavar="SIZE", help="each GPU's memory, e.g. 80GB or "
                        "80GiB: every row says whether its memory fits, and the table marks "
                        "what does not")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default=None,
                        help="the optimizer whose state the memory counts, as a run's "
                        "--optimizer (default: the runs', else sgd)")
    parser.add_argument("--momentum", type=float, default=None, metavar="M",
                        help="SGD's momentum, as a run's (default: the runs', else 0)")
    parser.add_argument("--precision", choices=tuple(DTYPES), default=None,
                        help="what the model trains in, as a run's --precision: DeepSpeed casts "
                        "the model, keeps float32 master weights and communicates in it, torch's "
                        "strategies run autocast over float32 (default: the runs', else fp32)")
    parser.add_argument("--sequence-length", type=int, metavar="T",
                        help="with --compute-ms: the tokens a sample of the model's data "
                        "(default: the data's own)")
    parser.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                        help="a GPU's dense peak TFLOP/s in the precision predicted: each row's "
                        "MFU, its model FLOPs a second over it (needs the model's forward on the "
                        "meta device: --compute-ms, or --gpu-memory with runs)")
    parser.add_argument("--activation-checkpointing", choices=recompute.MODES, default=None,
                        help="the units whose activations backward recomputes, as a run's "
                        "option: their inputs kept in place of what they save, and with "
                        "--compute-ms their forward again in the backward time (default: the "
                        "runs', else none)")


def in_float32(hook: str) -> str:
    """Where no calibration says otherwise: every strategy gathers in float32."""
    return "float32"


@dataclass
class MemoryTarget:
    """What predict's memory is counted for: the model, its options, the GPU's memory."""

    facts: ModelFacts
    precision: str
    optimizer: str
    momentum: float
    gpu_memory: int | None
    # strategy -> the hook options it is predicted at, where not its defaults
    options: dict[str, dict] = field(default_factory=dict)
    # strategy -> the dtype it gathers the parameters in (Calibration.gathered)
    gathered: Callable[[str], str] = in_float32

    def row(self, hook: str, trainers: int, per_node: int) -> dict:
        return memory(HOOKS.record(hook), self.facts, trainers, per_node, self.precision,
                      self.optimizer, self.momentum, self.gpu_memory,
                      kept_bytes(hook, self.facts, self.options.get(hook)), self.gathered(hook))

    def describe(self) -> str:
        facts = self.facts
        activations = ("unknown" if facts.activations_bytes is None
                       else format_bytes(facts.activations_bytes))
        return (f"  memory: {count(facts.parameters)} parameters, the largest layer "
                f"{count(facts.largest_layer)}; {self.optimizer}"
                f"{f' (momentum {self.momentum:g})' if self.optimizer == 'sgd' else ''}, "
                f"{self.precision}; activations {activations} ({facts.activations_from})"
                + (f", and {format_bytes(2 * facts.cast_weights)} more under a strategy whose "
                   f"trainers autocast: the 16-bit copies of the weights its matrix products take"
                   if self.precision in HALF and facts.cast_weights else "")
                + (f"; each GPU {self.gpu_memory / 2 ** 30:.1f} GiB" if self.gpu_memory else "")
                + "\n")


def count(number: float) -> str:
    """A count in thousands, millions or billions, four figures: 124.4 M, 70.55 B, 512."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= scale:
            return f"{number / scale:.4g} {unit}"
    return f"{number:g}"


def check_arguments(args) -> int | None:
    """The memory options' values (before anything is read); ``--gpu-memory`` in bytes."""
    if args.sequence_length is not None and args.sequence_length < 1:
        raise ConfigError(f"--sequence-length must be at least 1; got {args.sequence_length}")
    if args.momentum is not None and not 0 <= args.momentum < 1:
        raise ConfigError(f"--momentum must be in [0, 1); got {args.momentum}")
    return None if args.gpu_memory is None else parse_memory(args.gpu_memory)


def target(args, facts: ModelFacts, run_configs: list[dict], gpu_memory: int | None,
           options: dict[str, dict] | None = None,
           gathered: Callable[[str], str] = in_float32) -> MemoryTarget:
    """The options the memory is counted with: the command line's, else the runs' (the first
    run's), else fp32 SGD without momentum; each strategy's kept memory at its hook ``options``
    (those its runs had, ``Calibration.options``), its gathered layers in ``gathered``'s dtype
    (``Calibration.gathered``)."""
    first = run_configs[0] if run_configs else {}
    return MemoryTarget(facts, args.precision or first.get("precision", "fp32"),
                        args.optimizer or first.get("optimizer", "sgd"),
                        args.momentum if args.momentum is not None
                        else first.get("momentum", 0.0), gpu_memory, dict(options or {}),
                        gathered)
