"""A calibration: the compute phases, the buckets' ready times and sizes, the links, the
servers' aggregation throughput and each strategy's own compute that ``predictor.predict``
costs every strategy with; built from runs (``predictor.calibrate``) or from ``--compute-ms``
alone (``from_compute_ms``)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ps_bench.config import ConfigError
from ps_bench.metrics.costs import Link
from ps_bench.metrics.messages import PRECISIONS, bucket_factors
from ps_bench.options import plural
from ps_bench.predict.inputs import model_buckets, spread
from ps_bench.predict.memory import ModelFacts
from ps_bench.predict.pipelines import Phases
from ps_bench.predict.runs import Run, compute_runs
from ps_bench.strategies import HOOKS, LOW_RANK_BUCKETS, Strategy, hook_options


class Bucket(NamedTuple):
    """One of DDP's buckets as predict costs it: when backward had made it (ms), its float32
    bytes, whether its gradients are sparse, and how many tensors it holds (what a per-tensor
    compressor sends a scale for)."""

    ready_ms: float
    nbytes: float
    sparse: bool
    tensors: int = 1


@dataclass
class Calibration:
    model: str
    batch_size: int
    phases: Phases
    # in the order they became ready (tuples of Bucket's fields are made Buckets)
    buckets: list[Bucket]
    link: Link
    link_from: str
    aggregate_bytes_per_ms: float | None
    overlap_from: str
    runs: list[Run]
    intra_link: Link | None = None  # a node's local link, between its trainers
    # the runs' collectives ran on gloo (no reduce-scatter of its own); False: NCCL's
    gloo: bool = False
    intra_from: str = "none"
    # strategy -> its own compute, from its run
    own_ms: dict[str, float] = field(default_factory=dict)
    # low-rank strategies: bytes sent / dense, and where each came from
    payload_ratio: dict[str, float] = field(default_factory=dict)
    payload_from: dict[str, str] = field(default_factory=dict)
    # micro-batches of batch_size an optimizer step (--grad-accum): the compute of each, the
    # hooks' buckets synchronised on the last, each record's sends as often as it says
    micro_batches: int = 1
    # --reduce-dtype: what the strategies that have one communicate in (None: their runs', else
    # their own); --precision: what the model trains in (an engine's wire, ``Cost.wire``)
    reduce_dtype: str | None = None
    precision: str = "fp32"
    # strategy -> the hook options it is predicted at where not its defaults: those every run of
    # it was given (``run_options``), or --hook-option's (``give_options``)
    options: dict[str, dict] = field(default_factory=dict)
    # strategy -> the share of the parameters it gathers again for backward, having released
    # them after forward (ZeRO-3: ``Cost.regathered``), and where that came from
    regathered: dict[str, float] = field(default_factory=dict)
    regathered_from: str = ""
    # strategy -> the elements of the buckets its engine reduces in (``Cost.bucket_elements``),
    # and whether it reduces them as backward goes on (``Cost.overlaps``), at its runs' config
    bucket_elements: dict[str, int] = field(default_factory=dict)
    overlaps: dict[str, bool] = field(default_factory=dict)
    # --ds-config: the DeepSpeed config to cost the deepspeed_zero hooks without a run at (that
    # of its stage, every one where it names none), and its file
    ds_config: dict | None = None
    ds_stage: int | None = None
    ds_config_from: str = ""
    # strategy -> what its engine sends the gradients and gathers the parameters in (``wire``),
    # where not float32
    wires: dict[str, tuple[str, str]] = field(default_factory=dict)
    # what the calibration could not take as measured, said once where it is printed
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buckets = [Bucket(*bucket) for bucket in self.buckets]

    def options_of(self, hook: str) -> dict:
        """The options ``hook`` is predicted at: its defaults, then ``options``."""
        return hook_options(hook, self.options.get(hook, {}))

    def reduces_with_backward(self, hook: str, cost) -> bool:
        """Whether ``hook``'s buckets go through its pipeline as backward makes them (its engine's
        ``overlaps`` at its runs' config, else at the engine's defaults)."""
        return cost.overlaps is None or self.overlaps.get(hook, cost.overlaps(None))

    def engine_config(self, hook: str) -> dict | None:
        """The config ``hook``'s engine was built from in its runs, else ``--ds-config``'s for
        a DeepSpeed hook of its stage (None: the engine's defaults)."""
        ran = next((run.engine_config for run in self.runs
                    if run.hook == hook and run.engine_config), None)
        takes = HOOKS.record(hook).cost.takes_config
        if ran is not None or self.ds_config is None or takes is None:
            return ran
        return self.ds_config if takes(self.ds_stage) else None

    def engine_config_from(self, hook: str) -> str:
        """Where ``engine_config(hook)`` comes from, in words."""
        if any(run.hook == hook and run.engine_config for run in self.runs):
            return "its runs' engine config"
        return self.ds_config_from if self.engine_config(hook) else "the engine's defaults"

    def wire(self, strategy: Strategy, hook: str) -> tuple[str, str]:
        """What ``hook`` moves the gradients and the parameters in: ``--reduce-dtype``'s (else its
        runs') for the gradients of a strategy that has one, and for FSDP2's gathers too (its
        mixed-precision policy's); an engine's own at its runs' config, else at ``precision``
        (``Cost.wire``: DeepSpeed casts the model); else its record's payload."""
        gradients = parameters = strategy.payload
        if strategy.cost.wire is not None:
            gradients, parameters = strategy.cost.wire(self.engine_config(hook), self.precision)
        chosen = self.reduce_dtype or next((run.reduce_dtype for run in self.runs
                                            if run.hook == hook and run.reduce_dtype), None)
        if chosen and strategy.reduce_dtype:
            gradients = PRECISIONS[chosen]
            parameters = parameters if strategy.cost.wire is not None else gradients
        return gradients, parameters

    def gathered(self, hook: str) -> str:
        """The dtype ``hook`` gathers the parameters in (``wire``'s), as memory counts them."""
        return self.wire(HOOKS.record(hook), hook)[1]

    @property
    def gradient_bytes(self) -> float:
        return sum(bucket.nbytes for bucket in self.buckets)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "batch_size": self.batch_size,
            "phases_ms": {"forward": self.phases.forward, "backward": self.phases.backward,
                          "optimizer": self.phases.optimizer},
            "buckets": [{"ready_ms": ready, "bytes": nbytes, "sparse": sparse, "tensors": tensors}
                        for ready, nbytes, sparse, tensors in self.buckets],
            "overlap_from": self.overlap_from,
            "link": {"latency_us": self.link.latency_ms * 1000.0,
                     "bandwidth_gbit_s": self.link.bytes_per_ms * 1000.0 * 8 / 1e9,
                     "from": self.link_from},
            "intra_link": None if self.intra_link is None else {
                "latency_us": self.intra_link.latency_ms * 1000.0,
                "bandwidth_gbit_s": self.intra_link.bytes_per_ms * 1000.0 * 8 / 1e9,
                "from": self.intra_from},
            "aggregate_gbps": (self.aggregate_bytes_per_ms * 1000.0 / 1e9
                               if self.aggregate_bytes_per_ms else None),
            "own_ms": self.own_ms, "payload_ratio": self.payload_ratio,
            "payload_from": self.payload_from, "options": self.options,
            "regathered": self.regathered, "regathered_from": self.regathered_from,
            "bucket_elements": self.bucket_elements, "overlaps": self.overlaps,
            "wires": self.wires,
            "runs": [run.path for run in self.runs], "notes": self.notes,
        }


def low_rank_ratios(bucket_shapes: list[list[list[int]]],
                    given: dict[str, dict] | None = None) -> dict[str, float]:
    """Each low-rank strategy's payload, at its default options (then those ``given`` it), over
    the float32 gradient's bytes, from the gradient shapes in DDP's buckets
    (``messages.bucket_factors``): what a run of it measures, known from the model alone."""
    sizes = [[math.prod(shape) for shape in bucket] for bucket in bucket_shapes]
    total = sum(map(sum, sizes))
    ratios = {}
    for hook in HOOKS.names():
        strategy = HOOKS.record(hook)
        if strategy.cost.pipeline != LOW_RANK_BUCKETS or not total:
            continue
        options = hook_options(hook, (given or {}).get(hook, {}))
        sent = sum(sum(bucket_factors(strategy.factors, shapes, sum(elements), options))
                   for shapes, elements in zip(bucket_shapes, sizes))
        ratios[hook] = sent / total
    return ratios


def add_payloads(calibration: Calibration, bucket_shapes: list[list[list[int]]]) -> None:
    """Each low-rank strategy's payload not measured by a run of it, counted from the gradient
    shapes of the dense buckets (``low_rank_ratios``) at the options it is predicted at."""
    for hook, ratio in low_rank_ratios(bucket_shapes, calibration.options).items():
        if hook not in calibration.payload_ratio:
            calibration.payload_ratio[hook] = ratio
            calibration.payload_from[hook] = ("counted from the model's layers, " + (
                shown(calibration.options.get(hook, {})) or "default options"))


def shown(options: dict) -> str:
    """Hook options as a person writes them: ``ratio=0.1, error_feedback=False``."""
    return ", ".join(f"{key}={value}" for key, value in options.items())


def changed(hook: str, options: dict) -> dict:
    """Of ``hook``'s options (its defaults filled in or not), those that are not its defaults."""
    default = hook_options(hook, {})
    return {key: value for key, value in options.items() if default.get(key) != value}


def run_options(runs: list[Run]) -> tuple[dict[str, dict], list[str]]:
    """The hook options each strategy is predicted at, from its runs: those every run of it was
    given (none: its defaults); where its runs differ, its defaults, and a note that says so."""
    given: dict[str, list[dict]] = {}
    for run in runs:
        given.setdefault(run.hook, []).append(hook_options(run.hook, run.hook_options))
    options, notes = {}, []
    for hook, each in given.items():
        if any(other != each[0] for other in each[1:]):
            notes.append(f"the runs of {hook} ran with different hook options: it is predicted "
                         f"at its defaults, and compared with its runs at those alone")
            continue
        differing = changed(hook, each[0])
        if differing:
            options[hook] = differing
    return options, notes


def give_options(calibration: Calibration, given: dict[str, dict]) -> None:
    """``predict --hook-option``: each strategy named is predicted at those options, over those
    its runs had (else its defaults); where that is not how its runs ran, they do not stand in
    its measured column nor give its payload, its own compute is fitted to them each at its own
    options (``predictor.calibrate``), and a note says so."""
    for hook, options in given.items():
        runs_had = calibration.options_of(hook)
        merged = hook_options(hook, {**calibration.options.get(hook, {}), **options})
        differing = changed(hook, merged)
        if differing:
            calibration.options[hook] = differing
        else:
            calibration.options.pop(hook, None)
        if merged != runs_had and any(run.hook == hook for run in calibration.runs):
            calibration.notes.append(f"{hook} is predicted at {shown(options)} (--hook-option), "
                                     f"where its runs had other options: its own compute is "
                                     f"fitted to them, each at its own options, and taken as the "
                                     f"same at these; they do not stand in its measured column")


def bucket_sizes(buckets: list[dict]) -> dict[int, tuple[int, bool, int]]:
    """Bucket index -> (dense bytes, sparse, tensors), from a results file's DDP buckets (one
    tensor where a file older than their shapes does not say)."""
    return {bucket["index"]: (bucket["bytes"], bucket.get("sparse", False),
                              len(bucket.get("shapes") or [None]))
            for bucket in buckets}


def compute_ready(timeline: list[dict]) -> dict[int, float]:
    """Bucket index -> when backward's own compute had made it: its ``ready_ms`` less how long
    the hooks of the buckets handed over before it held backward's thread (``held_ms``: a CPU
    compressor's encoding delays every later bucket; none on a GPU or in older results files).
    What a hook holds is its strategy's own compute, not the model's. (Medians over iterations
    may not subtract exactly: never before the bucket ready before it, nor before 0.)"""
    ready, held, previous = {}, 0.0, 0.0
    for row in sorted(timeline, key=lambda row: (row["ready_ms"], row["index"])):
        previous = ready[row["index"]] = max(previous, row["ready_ms"] - held)
        held += row.get("held_ms", 0.0)
    return ready


def ready_buckets(ready: dict[int, float],
                  sizes: dict[int, tuple[int, bool, int]]) -> list[Bucket]:
    """Each bucket (``bucket_sizes``) with when it was ready, in the order they became ready."""
    return [Bucket(ready[index], *sizes.get(index, (0, False)))
            for index in sorted(ready, key=ready.get)]


def backward_compute(buckets: list[Bucket], compute_ms: float | None,
                     forward: float, optimizer: float) -> float:
    """Backward's own compute: the compute-only iteration minus forward and optimizer, and at
    least until the last bucket was ready (without a compute-only iteration, just that)."""
    last_ready = max((bucket.ready_ms for bucket in buckets), default=0.0)
    return last_ready if compute_ms is None else max(last_ready, compute_ms - forward - optimizer)


def own_terms(run: Run, calibration: Calibration) -> dict:
    """The compute phases and bucket timeline of one run alone (the calibration's pooled ones
    where the run lacks them), so that its slower or faster compute is not taken for its
    strategy's own cost; the timeline without what its hooks held backward for
    (``compute_ready``), which is. A run whose phases did not give the model's compute
    (``compute_runs``: its forward or step holds its strategy's own communication) takes the
    calibration's."""
    if run not in compute_runs(calibration.runs):
        return {"phases": calibration.phases, "buckets": calibration.buckets}
    ready = compute_ready(run.timeline or [])
    buckets = ready_buckets(ready, bucket_sizes(run.buckets)) if ready else calibration.buckets
    backward = (backward_compute(buckets, run.compute_ms, run.forward_ms, run.optimizer_ms)
                if run.compute_ms is not None or ready else calibration.phases.backward)
    return {"phases": Phases(run.forward_ms, backward, run.optimizer_ms), "buckets": buckets}


def from_compute_ms(model: str, batch_size: int, phases: Phases, buckets: list[tuple],
                    link: Link, link_from: str, shares: list[float] | None = None,
                    shares_from: str = "") -> Calibration:
    """A calibration with no run: compute phases as given; each bucket (``(bytes, sparse[,
    tensors])``) ready when backward has done its ``shares`` (from the layers' FLOPs,
    ``inputs.backward_shares``), else its ready times spread over backward in proportion to
    their bytes (``inputs.spread``)."""
    if shares is not None:
        ready = [Bucket(phases.backward * share, *bucket) for share, bucket in zip(shares, buckets)]
        ready.sort(key=lambda bucket: bucket[0])
        how = (f"--compute-ms: each bucket ready when backward has done its layers' share "
               f"({shares_from})")
    else:
        ready = spread(phases.backward, buckets)
        how = ("--compute-ms: bucket-ready times spread over backward in proportion to their bytes"
               + (f" ({shares_from})" if shares_from else ""))
    return Calibration(model, batch_size, phases, ready, link, link_from, None, how, [])


def runs_model(run: Run, args: argparse.Namespace) -> ModelFacts:
    """What predict needs of the runs' model, built on the meta device, over their data, with
    the runs' activation checkpointing (their times have its recomputation in them)."""
    training = run.training or {}
    theirs = training.get("activation_checkpointing", "none")
    if args.activation_checkpointing not in (None, theirs):
        raise ConfigError(f"--activation-checkpointing {args.activation_checkpointing}: the runs "
                          f"were made with {theirs}, and their times are what they recomputed; "
                          f"give runs made with it, or --compute-ms")
    return model_buckets(run.model, args.bucket_cap_mb, training.get("model_options"),
                         run.batch_size, None,
                         args.precision or training.get("precision", "fp32"), run.data,
                         theirs)[3]


def add_engine_terms(calibration: Calibration, hooks: list[str], facts: ModelFacts) -> None:
    """What each of ``hooks`` does as its engine does it, from the model: the buckets it reduces
    in, and the share of the parameters it gathers again for backward (at the engine config of
    its runs, else the engine's defaults)."""
    configs = {}
    for hook in hooks:
        cost = HOOKS.record(hook).cost
        config = calibration.engine_config(hook)
        wire = calibration.wire(HOOKS.record(hook), hook)
        if wire != ("float32", "float32"):
            calibration.wires[hook] = wire
        if cost.bucket_elements:
            calibration.bucket_elements[hook] = cost.bucket_elements(facts, config)
        if cost.overlaps:
            calibration.overlaps[hook] = cost.overlaps(config)
        if not cost.regathered:
            continue
        calibration.regathered[hook] = cost.regathered(facts.modules, config)
        configs[hook] = calibration.engine_config_from(hook)
    if not configs:
        return
    calibration.regathered_from = (
        f"released and gathered again as the engine's parameter coordinator does over forward's "
        f"{plural(sum(starts for starts, _ in facts.modules), 'module call')} and backward's; "
        + "; ".join(f"{hook} at {source}" for hook, source in configs.items()))


def borrowed(calibration: Calibration, hooks: list[str]) -> list[str]:
    """A note naming the strategies predicted that encode the gradients (their record's payload
    is not the float32 gradient: a cast, a compressor's code, low-rank factors) whose own compute
    no run fitted: what encoding and decoding cost is taken as the one's each costs like,
    which on a slow device can be far less (``own_compute``'s fallback)."""
    unfitted = [hook for hook in hooks if hook not in calibration.own_ms
                and HOOKS.record(hook).payload not in ("float32", "nothing")]
    if not unfitted:
        return []
    likes = dict.fromkeys(HOOKS.record(hook).cost.like for hook in unfitted)
    taken = "; ".join(f"{like} {calibration.own_ms[like]:+.1f} ms" if like in calibration.own_ms
                      else f"{like or 'none'} 0 ms, none fitted" for like in likes)
    one = len(unfitted) == 1
    return [f"{', '.join(unfitted)} encode{'s' if one else ''} the gradients, and no run of "
            f"{'it' if one else 'theirs'} fitted what that costs: {'it' if one else 'each'} is "
            f"predicted with the own compute of the strategy it costs like ({taken}), and where "
            f"encoding is slow runs slower than predicted (give a run of "
            f"{'it' if one else 'each'}, made with --limits or on an emulated link)"]


def other_precision(calibration: Calibration) -> list[str]:
    """A note where the runs computed in another precision than the one predicted: their
    compute phases stand as they were measured."""
    others = sorted({run.precision for run in calibration.runs} - {calibration.precision})
    if not others:
        return []
    return [f"the runs computed in {' and '.join(others)}: their forward, backward and step stand "
            f"in this {calibration.precision} prediction as measured, where a GPU's tensor cores "
            f"compute 16 bits faster (give runs made with --precision {calibration.precision}, or "
            f"--compute-ms)"]
