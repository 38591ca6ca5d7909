"""Everything ps_bench knows about a strategy without running it: its ``Strategy`` record (what
it sends over which transport, whether it is lossless, how it wraps the model, how ``predict``
costs it), and ``HOOKS``, the registry users name strategies by. Validation, ``--limits``,
``predict`` and the tests read the record."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ps_bench.metrics.costs import Nodes
from ps_bench.metrics.messages import ELEMENT_BYTES
from ps_bench.metrics.wire import collective_bytes
from ps_bench.registry import Registry

COLLECTIVE, RPC = "collective", "rpc"  # transports
PAYLOADS = ("float32", "float16", "bfloat16", "low-rank factors", "compressed", "nothing")
# What a strategy does with a sparse bucket: all-reduce it as it is on the trainers' group
# (NCCL cannot), all-reduce it through the CPU over gloo (needs gloo in the group: multi), or
# send it to a parameter server.
SPARSE_ALLREDUCE, SPARSE_GLOO, SPARSE_SERVERS = "allreduce", "gloo", "servers"
# Families, one module each.
ALLREDUCE, SERVERS, SHARDED, LOCAL = "allreduce", "servers", "sharded", "local"
FAMILIES = (ALLREDUCE, SERVERS, SHARDED, LOCAL)
# How the model is wrapped: DDP (buckets, a hook), FSDP2's fully_shard (no hook), an engine of its
# own (DeepSpeed's), or not at all: the parameter servers own the parameters, and the trainers push
# gradients and read them (--staleness).
DDP, FSDP, ENGINE, SERVER_OWNED = "ddp", "fsdp", "engine", "server-owned"
# When the replicas are the same model: after every iteration, at each synchronisation point (every
# ``period`` iterations), or as the full parameters gathered from the shards; or there are no
# replicas to compare, the servers holding the one model.
EVERY_ITERATION, AT_SYNCHRONISATION, GATHERED = ("every iteration", "the last synchronisation",
                                                 "gathered full parameters")
SERVERS_MODEL = "the servers' one model"
# The collectives a strategy issues besides (or instead of) its hook, each over the whole model's
# parameter bytes, per iteration (an optimizer step), per micro-batch of one (--grad-accum), or
# once per ``period``.
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
FREQUENCIES = ("iteration", "micro-batch", "period")
# The training engines ps_bench drives besides torch's own, each an optional extra: the line that
# installs it.
ENGINES = {"deepspeed": 'pip install -e ".[deepspeed]"', "torchft": 'pip install -e ".[torchft]"'}
# The pipelines predict runs a strategy's buckets through (ps_bench.predict.pipelines): each
# bucket combined by collectives among the trainers, pushed to parameter servers, pushed once
# per host to them, sent as low-rank factors whose size a run of the strategy gives, or the
# sparse ones pushed to the servers and the dense ones combined by collectives.
COLLECTIVE_BUCKETS, SERVER_BUCKETS, HOST_SERVER_BUCKETS, LOW_RANK_BUCKETS, SPARSE_SERVER_BUCKETS = (
    "collectives", "servers", "servers per host", "low-rank factors", "sparse to servers")
PIPELINES = (COLLECTIVE_BUCKETS, SERVER_BUCKETS, HOST_SERVER_BUCKETS, LOW_RANK_BUCKETS,
             SPARSE_SERVER_BUCKETS)


# How a strategy survives a failure, as its real system does, and, for each, why --checkpoint-every
# refuses it (None: it does not): every rank restarts from the newest checkpoint (DDP and every
# hook around it, FSDP2, ZeRO, DeepSpeed); torchft's replica groups go on while a failed group
# heals from a live peer; replicas that differ between synchronisations (local SGD, DiLoCo) are
# checkpointed at one; parameter servers that own the parameters keep them
RESTART, HEAL, AT_SYNC, SERVERS_KEEP = "restart", "heal", "at synchronisation", "servers keep"
RECOVERIES = {
    RESTART: None,
    HEAL: "torchft's replica groups heal from a live peer rather than restart from a checkpoint "
          "(give --inject-fault or --mtbf without it)",
    AT_SYNC: "its replicas differ between synchronisations, and a checkpoint of each trainer's "
             "own is not written yet",
    SERVERS_KEEP: "the parameter servers own the parameters (--staleness), and their state is not "
                  "checkpointed yet",
}
# the recoveries a strategy goes on by, without a failed trainer, as its real system does (no
# option turns them on)
BY_ITSELF = (HEAL, SERVERS_KEEP)
# The model states a trainer holds (a run's ``memory.trainer.model_states``, predict's memory)
PARAMETERS, GRADIENTS, OPTIMIZER = "parameters", "gradients", "optimizer"
MODEL_STATES = (PARAMETERS, GRADIENTS, OPTIMIZER)


@dataclass(frozen=True)
class Holds:
    """What each trainer keeps of the model states, for predict's memory.

    ``sharded``: the states divided among the trainers (``over`` all of them, or ``"host"``: a
    host's, as HSDP) instead of whole on each; ``gathers``: what it gathers whole besides its
    shard, ``"layer"`` (the largest module's parameters, the one computing and the next,
    prefetched: DeepSpeed's ZeRO-3) or ``"unit"`` (FSDP2's: the root unit's, kept gathered from
    forward to backward, and the largest other unit's twice); ``master_copy``: an engine that
    keeps float32 master weights in its optimizer, and trained in 16 bits casts the model and
    keeps float32 gradient partitions there too (DeepSpeed's); ``half_gradients``: those 16-bit
    gradients stay until the step (False: each is reduced into its float32 partition as it is
    made, ZeRO stage 3); ``copies``: more float32 copies of the parameters it keeps (DiLoCo's
    start point and outer momentum)."""

    sharded: tuple[str, ...] = ()
    over: str = "trainers"
    gathers: str = ""  # "", "layer" or "unit"
    master_copy: bool = False
    half_gradients: bool = True
    copies: int = 0


@dataclass(frozen=True)
class Cost:
    """How ``bench.py predict`` costs a strategy; the defaults follow from the rest of its record.

    ``pipeline``: which of ``PIPELINES`` its buckets go through, None where no bucket is sent
    (the strategy's cost is then its record's ``sends``). ``bucket_ms(nodes, nbytes, gloo)``:
    with the collectives pipeline, what combining one dense bucket of ``nbytes`` takes on the
    nodes' links (default ``costs.flat_ring_ms``, a ring over every trainer), ``nbytes`` being
    what it puts on the wire for the bucket (in its wire dtype; a compressor's message, as its
    ``compressor`` makes it at the hook's options);
    ``micro_batch_ms(nodes, nbytes)``: what it pays each micro-batch over the whole gradient's
    ``nbytes`` (in its wire dtype) besides, not hidden behind compute. ``like``: with no run of
    its own, the strategy whose own compute (what its transfers do not account for) it takes
    (default: the one it compresses). ``overlapped``: the collectives of its ``sends`` that its
    pipeline's buckets carry as backward makes them (FSDP2's reduce-scatter, unit by unit),
    which predict does not add again after backward (made every micro-batch: the last one's);
    ``bucket_elements(model, engine_config)``: with the collectives pipeline, the elements of the
    buckets its engine reduces in (FSDP2's units, DeepSpeed's ``reduce_bucket_size``) for the
    model (``predict.memory.ModelFacts``), made of the calibration's as backward fills them
    (default: DDP's buckets); ``overlaps(engine_config)``: whether its engine reduces as
    backward goes on at that config (None: its defaults); where it does not, no bucket goes
    through the pipeline and every send comes after backward (default: it does);
    ``regathered(modules, engine_config)``: the share of the
    parameters its engine releases after forward and gathers again for backward (ZeRO-3), from
    forward's module calls (``ModelFacts.modules``) and the engine config of its runs (None:
    the engine's defaults); ``wire(engine_config, precision)``: the dtypes its engine moves the
    gradients and the parameters in, at its runs' config (None: its defaults at the run's
    ``--precision``; default: the record's ``payload``); ``takes_config(stage)``: whether a
    user's config for its engine naming that stage (None: none) is its own (``predict
    --ds-config``)."""

    pipeline: str | None = None
    bucket_ms: Callable[[Nodes, float, bool], float] | None = None
    micro_batch_ms: Callable[[Nodes, float], float] | None = None
    like: str | None = None
    overlapped: tuple[str, ...] = ()
    bucket_elements: Callable[[Any, dict | None], int] | None = None
    overlaps: Callable[[dict | None], bool] | None = None
    regathered: Callable[[list, dict | None], float] | None = None
    wire: Callable[[dict | None, str], tuple[str, str]] | None = None
    takes_config: Callable[[int | None], bool] | None = None


@dataclass(frozen=True)
class Strategy:
    """Everything ps_bench knows about a strategy without running it."""

    # COLLECTIVE: collectives among trainers; RPC: buckets to parameter servers; None: nothing
    transport: str | None
    payload: str  # what crosses the transport, one of PAYLOADS
    lossless: bool  # every trainer receives the exact mean gradient
    # SPARSE_ALLREDUCE, SPARSE_GLOO, SPARSE_SERVERS; None: it moves nothing (or no DDP)
    sparse_buckets: str | None
    uncompressed: str | None = None  # a lossy strategy: the lossless one whose bytes it reduces
    # low-rank factors of each "tensor", or of the "bucket" as one square matrix
    factors: str | None = None
    # one of FAMILIES, the module it lives in (default: servers for RPC, else allreduce)
    family: str | None = None
    wrap: str = DDP  # DDP, FSDP, ENGINE or SERVER_OWNED
    # what "replicas identical" is checked at (SERVERS_MODEL: nothing to compare)
    identical: str = EVERY_ITERATION
    # (collective, one of FREQUENCIES): what it issues over the model's parameters besides its
    # hook
    sends: tuple[tuple[str, str], ...] = ()
    # it synchronises within each host before across hosts: needs --per-host, 2 hosts or more
    per_host: bool = False
    # made for sparse gradients: on a model without them it is this strategy
    for_sparse: str | None = None
    # the package that runs it, an optional extra (ENGINES); None: torch's own
    engine: str | None = None
    # its DDP hook sends the gradient buckets (default: the all-reduce and servers families)
    hook_sends: bool | None = None
    cost: Cost | None = None  # how predict costs it (default: from the rest of the record)
    # an engine that communicates in a dtype of its own choosing: --reduce-dtype sets it
    reduce_dtype: bool = False
    holds: Holds = Holds()  # what each trainer keeps of the model states (predict's memory)
    # how it survives a failure (RECOVERIES)
    recovery: str = RESTART
    # its servers can drop a trainer that stops sending and average over the living
    # (--trainer-timeout, ``runtime.membership``)
    elastic: bool = False
    # its servers' buckets can be kept by a replica that answers for a lost server
    # (--server-replicas, ``servers.replicas``)
    replicated: bool = False
    # "compressed": its hook options -> its codec (``strategies.codecs.Codec``), whose
    # ``message_bytes(elements, tensors)`` is what a trainer all-gathers of a bucket
    compressor: Callable | None = None
    # why --compile cannot run with it (an engine that owns the model's modules and compiles
    # them its own way); None: its model's units are compiled before it wraps them
    not_compiled: str | None = None

    def __post_init__(self) -> None:
        if self.family is None:
            object.__setattr__(self, "family", SERVERS if self.transport == RPC else ALLREDUCE)
        if self.hook_sends is None:
            object.__setattr__(self, "hook_sends",
                               self.transport is not None and self.family in (ALLREDUCE, SERVERS))
        object.__setattr__(self, "cost", self.resolved_cost(self.cost or Cost()))
        if (self.transport not in (COLLECTIVE, RPC, None) or self.payload not in PAYLOADS
                or self.sparse_buckets not in (SPARSE_ALLREDUCE, SPARSE_GLOO, SPARSE_SERVERS, None)
                or self.family not in FAMILIES or self.wrap not in (DDP, FSDP, ENGINE, SERVER_OWNED)
                or self.identical not in (EVERY_ITERATION, AT_SYNCHRONISATION, GATHERED,
                                          SERVERS_MODEL)
                or any(c not in COLLECTIVES or per not in FREQUENCIES
                       for c, per in self.sends)
                or self.engine not in (None, *ENGINES)
                or any(state not in MODEL_STATES for state in self.holds.sharded)
                or self.holds.over not in ("trainers", "host")
                or self.holds.gathers not in ("", "layer", "unit")
                or self.recovery not in RECOVERIES):
            raise ValueError(f"bad strategy record {self}")
        if self.transport is not None and self.lossless == (self.uncompressed is not None):
            raise ValueError(f"a lossy strategy names the lossless one it compresses, "
                             f"and only it: {self}")
        if (self.payload == "compressed") != (self.compressor is not None):
            raise ValueError(f"a compressed strategy, and only it, names its compressor: {self}")
        if (self.payload == "low-rank factors") != (self.factors in ("tensor", "bucket")):
            raise ValueError(f"a low-rank strategy says what it factors, "
                             f"each tensor or the bucket: {self}")
        if (self.transport == RPC) != (self.family == SERVERS):
            raise ValueError(f"the strategies that send to parameter servers, and only they, "
                             f"are of that family: {self}")
        if self.cost.pipeline not in (None, *PIPELINES):
            raise ValueError(f"a strategy's buckets go through one of predict's pipelines "
                             f"({', '.join(PIPELINES)}): {self}")

    def resolved_cost(self, cost: Cost) -> Cost:
        """``cost`` with what it leaves out taken from the rest of the record: a hook that sends
        its buckets goes through the pipeline of its transport (its host's servers where it
        pushes once per host, the low-rank one where it sends factors), its buckets combined by a
        ring over every trainer; one made for sparse buckets sends the others as the strategy it
        is on a dense model; it costs like the strategy it compresses."""
        pipeline = cost.pipeline
        if pipeline is None and self.hook_sends:
            pipeline = (LOW_RANK_BUCKETS if self.payload == "low-rank factors"
                        else COLLECTIVE_BUCKETS if self.transport == COLLECTIVE
                        else HOST_SERVER_BUCKETS if self.per_host
                        else SPARSE_SERVER_BUCKETS if self.for_sparse else SERVER_BUCKETS)
        return replace(cost, pipeline=pipeline, like=cost.like or self.uncompressed)

    @property
    def periodic(self) -> bool:
        """Whether it synchronises once a period (local SGD, DiLoCo): most of its iterations,
        its p50 among them, synchronise nothing."""
        return any(per == "period" for _, per in self.sends)

    @property
    def needs_servers(self) -> bool:
        return self.transport == RPC

    @property
    def takes_servers(self) -> bool:
        """Whether a run of it may have parameter servers at all (the sharded and local families
        have none to send to)."""
        return self.family in (ALLREDUCE, SERVERS)

    @property
    def floor(self) -> str | None:
        """The ``--limits`` floor it is held against: the raw transfer over its transport."""
        return self.transport

    def rpc_slices(self, per_host: int | None) -> int:
        """Into how many slices each trainer's host splits a bucket for the servers: node-aggregated
        servers' G trainers push one slice each of their host's sum; 1 for every other strategy."""
        return (per_host or 1) if self.per_host and self.needs_servers else 1


def calls_per_iteration(per: str, period: int = 1, micro_batches: int = 1) -> float:
    """How many calls of a collective of frequency ``per`` an iteration (an optimizer step of
    ``micro_batches``) makes, amortised over the period."""
    return {"iteration": 1.0, "micro-batch": float(micro_batches), "period": 1.0 / period}[per]


def expected_bytes(record: Strategy, nbytes: int, world: int, period: int = 1,
                   backend: str = "gloo", micro_batches: int = 1) -> float:
    """What a strategy that is not a DDP hook sends per iteration (an optimizer step of
    ``micro_batches``) over a model of ``nbytes`` float32 parameter bytes, in its wire dtype,
    amortised over its period (the hook's own bytes come from its buckets)."""
    wire = nbytes * ELEMENT_BYTES.get(record.payload, 4) // 4
    return sum(collective_bytes(collective, wire, world, backend) *
               calls_per_iteration(per, period, micro_batches) for collective, per in record.sends)


HOOKS: Registry = Registry("hook", record_type=Strategy)

SERVER_COUNTS = ("nserver", "ncudaserver")  # the options that start parameter servers


def sends_to_servers(hook: Any) -> bool:
    """Whether a recorded run's ``hook`` sends to parameter servers: all-reduce started with
    ``--nserver 1``, as every hook was before ``--nserver`` followed the hook, left its server
    idle. A name this ps_bench does not know is taken to."""
    return not (isinstance(hook, str) and hook in HOOKS and not HOOKS.record(hook).needs_servers)
