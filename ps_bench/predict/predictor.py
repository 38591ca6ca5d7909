"""A prediction calibrated on measured runs: compute phases, the bucket timeline and the link
from results files, each strategy's own compute from its own run, then ``pipelines`` at any n, k.

Calibration (``calibrate``), from one or more results files of the same model and batch:

- forward and optimizer p50 (trainer summary), backward's own compute (the ``--limits``
  compute-only iteration minus forward and optimizer, at least the last bucket's ready time);
- when each DDP bucket became ready (``timeline``, p50 over the runs): overlap is computed from
  it; without one (a GPU run) every bucket is taken as ready when backward's compute ends;
- the link: α and B fitted to the ``--limits`` link probe (median over the runs), unless the
  target network is given (``--link``, ``--latency``); the probe of a run whose trainers all
  shared one emulated host measured that host's local link instead (``--intra-link`` gives it);
- the server's aggregation throughput: the ``--limits`` memory-copy bandwidth;
- each strategy's own compute (casts, reductions, serialisation, PowerSGD's matrix products:
  whatever of its cost the transfers do not account for): its run's measured batch p50 minus the
  model's with that run's own compute phases and timeline, on the network the run had (the
  fitted link), a constant at every n, k and target network; for a strategy with no run given, that of the
  strategy it costs like (the one it compresses; ps_node, ps), else 0
  (``own_ms`` lists the measured ones).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from ps_bench.config import ConfigError
from ps_bench.metrics import costs
from ps_bench.metrics.costs import Link
from ps_bench.metrics.limits import ELEMENT_BYTES
from ps_bench.predict import pipelines
from ps_bench.predict.inputs import spread
from ps_bench.predict.pipelines import Phases
from ps_bench.results.load import load_file
from ps_bench.strategies import (COLLECTIVE_BUCKETS, HOOKS, HOST_SERVER_BUCKETS, LOW_RANK_BUCKETS, SERVER_BUCKETS,
                                 SPARSE_SERVERS, Strategy, hook_options)



@dataclass
class Run:
    """What a prediction needs from one results file."""

    path: str
    hook: str
    trainers: int
    servers: int
    mapping: str
    batch_size: int
    model: str
    batch_ms: float
    forward_ms: float
    optimizer_ms: float
    backward_ms: float
    compute_ms: float | None  # --limits compute-only iteration
    link: dict | None  # --limits link probe and its fit
    memcpy_gbps: float | None
    timeline: list[dict] | None
    buckets: list[dict]  # DDP's, as it built them (bytes, sparse)
    trainer_sent_per_iter: float
    link_rate_bps: float | None  # the emulated network's, if any
    backend: str = "gloo"  # the trainers' collectives'
    per_host: int = 1  # trainers on each trainer host (an emulated network's; else 1, every trainer apart)
    servers_on: str = "dedicated"

    @property
    def communicates_nothing(self) -> bool:
        """Whether its backward is compute alone (one trainer, or the noop strategy)."""
        return self.trainers == 1 or HOOKS.record(self.hook).transport is None

    @property
    def on_one_host(self) -> bool:
        """Whether its trainers all shared one host: its link probe measured the host's local link."""
        return self.trainers > 1 and self.per_host == self.trainers

    @classmethod
    def load(cls, path: str) -> "Run":
        results = load_file(path)
        if results.get("status") != "ok":
            raise ConfigError(f"{path} is a failed run ({results.get('error', 'no error recorded')}): predict from "
                              "runs that finished")
        cfg, summary = results["config"], {row["metric"]: row["p50"] for row in results["summary"]
                                           if row["role"] == "trainer"}
        limits = results.get("limits") or {}
        emulated = results.get("env", {}).get("emulated") or {}
        return cls(
            path=path, hook=HOOKS.canonical(cfg["hook"]), trainers=cfg["ntrainer"] + cfg.get("ncudatrainer", 0),
            servers=cfg["nserver"] + cfg.get("ncudaserver", 0), mapping=cfg.get("mapping", "shard"),
            batch_size=cfg["batch_size"], model=cfg["model"], batch_ms=summary["batch"],
            forward_ms=summary["forward"], optimizer_ms=summary["optimizer"], backward_ms=summary.get("backward", 0.0),
            compute_ms=(limits.get("compute") or {}).get("p50_ms"), link=limits.get("link"),
            memcpy_gbps=(limits.get("memcpy") or {}).get("gbps"), timeline=results.get("timeline"),
            buckets=(cfg.get("model_size") or {}).get("ddp_buckets") or [],
            trainer_sent_per_iter=results["bytes"]["trainer_sent_per_iter"],
            link_rate_bps=emulated.get("link_rate_bps"),
            per_host=trainers_per_host(emulated.get("placement"), cfg["ntrainer"] + cfg.get("ncudatrainer", 0)),
            servers_on=cfg.get("servers_on", "dedicated"), backend=cfg.get("backend", "gloo"),
        )


def trainers_per_host(placement: list[list[int]] | None, trainers: int) -> int:
    """Trainers on each host that has any, from an emulated network's placement (ranks per host,
    trainers ranking first); 1 without one, or where hosts hold different numbers."""
    counts = {sum(rank < trainers for rank in ranks) for ranks in placement or []} - {0}
    return counts.pop() if len(counts) == 1 else 1


@dataclass
class Calibration:
    model: str
    batch_size: int
    phases: Phases
    buckets: list[tuple[float, float, bool]]  # (ready ms, dense bytes, sparse), in the order they became ready
    link: Link
    link_from: str
    aggregate_bytes_per_ms: float | None
    overlap_from: str
    runs: list[Run]
    intra_link: Link | None = None  # a node's local link, between its trainers
    gloo: bool = False  # the runs' collectives ran on gloo (no reduce-scatter of its own); False: NCCL's
    intra_from: str = "none"
    own_ms: dict[str, float] = field(default_factory=dict)  # strategy -> its own compute, from its run
    payload_ratio: dict[str, float] = field(default_factory=dict)  # low-rank strategies: bytes sent / dense

    @property
    def gradient_bytes(self) -> float:
        return sum(nbytes for _, nbytes, _ in self.buckets)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "batch_size": self.batch_size,
            "phases_ms": {"forward": self.phases.forward, "backward": self.phases.backward,
                          "optimizer": self.phases.optimizer},
            "buckets": [{"ready_ms": ready, "bytes": nbytes, "sparse": sparse} for ready, nbytes, sparse in self.buckets],
            "overlap_from": self.overlap_from,
            "link": {"latency_us": self.link.latency_ms * 1000.0,
                     "bandwidth_gbit_s": self.link.bytes_per_ms * 1000.0 * 8 / 1e9, "from": self.link_from},
            "intra_link": None if self.intra_link is None else {
                "latency_us": self.intra_link.latency_ms * 1000.0,
                "bandwidth_gbit_s": self.intra_link.bytes_per_ms * 1000.0 * 8 / 1e9, "from": self.intra_from},
            "aggregate_gbps": self.aggregate_bytes_per_ms * 1000.0 / 1e9 if self.aggregate_bytes_per_ms else None,
            "own_ms": self.own_ms, "payload_ratio": self.payload_ratio,
            "runs": [run.path for run in self.runs],
        }


def calibrate(runs: list[Run], link_bps: float | None = None, latency_s: float | None = None,
              intra_bps: float | None = None, compute: Run | None = None) -> Calibration:
    """The calibration of ``runs`` (see the module's docstring); ``link_bps`` and ``latency_s``
    describe the target network instead of the runs' own, ``intra_bps`` a node's local link;
    ``compute`` (a run of the same model and batch, on the device to predict for) gives the
    compute phases and bucket timeline instead of ``runs``."""
    first = runs[0]
    for run in runs[1:]:
        if (run.model, run.batch_size) != (first.model, first.batch_size):
            raise ConfigError(f"{run.path} is of model {run.model} at batch {run.batch_size}, {first.path} of "
                              f"{first.model} at batch {first.batch_size}: predict one workload at a time")
    if compute is not None and (compute.model, compute.batch_size) != (first.model, first.batch_size):
        raise ConfigError(f"--compute {compute.path} is of model {compute.model} at batch {compute.batch_size}, the runs "
                          f"of {first.model} at batch {first.batch_size}: give a run of the same model and batch size")
    fitted = [run.link for run in runs if run.link and not run.on_one_host]
    fitted_intra = [run.link for run in runs if run.link and run.on_one_host]
    if link_bps is None and not fitted:
        raise ConfigError("no link to predict with: give runs made with --limits (their link is fitted) or the "
                          "target network with --link RATE")
    measured_link = (Link.of(statistics.median(f["latency_us"] for f in fitted),
                             statistics.median(f["bandwidth_gbit_s"] for f in fitted)) if fitted else None)
    if link_bps is not None:
        latency_us = (latency_s * 1e6 if latency_s is not None
                      else statistics.median(f["latency_us"] for f in fitted) if fitted else 0.0)
        link = Link.of(latency_us, link_bps / 1e9)
        link_from = f"--link {link_bps / 1e9:g} Gbit/s, latency {latency_us:g} us" + (
            " (fitted)" if latency_s is None and fitted else "")
    else:
        link = measured_link
        if latency_s is not None:
            link = Link(latency_s * 1000.0, link.bytes_per_ms)
        link_from = f"fitted to the --limits link probe of {len(fitted)} run(s)"
    intra_link, intra_from = None, "none: give --intra-link RATE, or a run whose trainers shared one host"
    if intra_bps is not None:
        intra_latency = statistics.median(f["latency_us"] for f in fitted_intra) if fitted_intra else 0.0
        intra_link, intra_from = Link.of(intra_latency, intra_bps / 1e9), f"--intra-link {intra_bps / 1e9:g} Gbit/s"
    elif fitted_intra:
        intra_link = Link.of(statistics.median(f["latency_us"] for f in fitted_intra),
                             statistics.median(f["bandwidth_gbit_s"] for f in fitted_intra))
        intra_from = f"fitted to the --limits link probe of {len(fitted_intra)} run(s) on one host"
    timed = [compute] if compute is not None else runs
    forward = statistics.median(run.forward_ms for run in timed)
    optimizer = statistics.median(run.optimizer_ms for run in timed)
    timelines = [run.timeline for run in timed if run.timeline]
    dense = bucket_sizes((compute or first).buckets)
    computes = [run.compute_ms for run in timed if run.compute_ms is not None]
    if compute is not None and not timelines and not computes and compute.communicates_nothing:
        backward = compute.backward_ms  # nothing to wait for: backward's own compute
        buckets = spread(backward, [dense[index] for index in sorted(dense)])
        overlap_from = (f"--compute {compute.path}: no bucket timeline (a GPU run), bucket-ready times spread over "
                        "backward in proportion to their bytes")
    elif timelines:
        ready: dict[int, list[float]] = {}
        for timeline in timelines:
            for row in timeline:
                ready.setdefault(row["index"], []).append(row["ready_ms"])
        buckets = ready_buckets({index: statistics.median(times) for index, times in ready.items()}, dense)
        backward = backward_compute(buckets, statistics.median(computes) if computes else None, forward, optimizer)
        overlap_from = f"the bucket timeline of {len(timelines)} run(s)"
    elif computes:
        backward = backward_compute([], statistics.median(computes), forward, optimizer)
        buckets = [(backward, *dense[index]) for index in sorted(dense)]
        overlap_from = "none: no run has a bucket timeline (GPU runs), every bucket ready when backward's compute ends"
    else:
        raise ConfigError("no backward compute to predict with: give runs made with --limits or on the CPU")
    memcpy = [run.memcpy_gbps for run in runs if run.memcpy_gbps]
    calibration = Calibration(first.model, first.batch_size, Phases(forward, backward, optimizer), buckets, link,
                              link_from, statistics.median(memcpy) * 1e9 / 1000.0 if memcpy else None, overlap_from,
                              runs, intra_link=intra_link, intra_from=intra_from,
                              gloo=all(run.backend == "gloo" for run in runs))
    for run in runs:  # payloads first: a low-rank strategy's own compute is fitted with its payload known
        if HOOKS.record(run.hook).cost.pipeline == LOW_RANK_BUCKETS and run.trainers > 1:
            ring = 2 * (run.trainers - 1) / run.trainers
            calibration.payload_ratio.setdefault(run.hook, run.trainer_sent_per_iter / ring / calibration.gradient_bytes)
    # each strategy's own compute: its run against the model with the run's own compute phases and
    # timeline, on the network the run had (the fitted link; the target one for a run on an
    # emulated link of the target's rate)
    own: dict[str, list[float]] = {}
    for run in runs:
        if measured_link is not None:
            network = measured_link
        elif run.link_rate_bps is not None and run.link_rate_bps == link_bps:
            network = link
        else:
            continue
        if run.per_host > 1 and calibration.intra_link is None:
            continue
        as_it_ran = replace(calibration, link=network, **own_terms(run, calibration))
        modelled = predict(as_it_ran, run.hook, run.trainers, run.servers, run.mapping, own=False,
                           per_node=run.per_host, servers_on=run.servers_on)
        if modelled is not None:
            own.setdefault(run.hook, []).append(run.batch_ms - modelled["batch_ms"])
    calibration.own_ms = {hook: statistics.median(values) for hook, values in own.items()}
    return calibration


def bucket_sizes(buckets: list[dict]) -> dict[int, tuple[int, bool]]:
    """Bucket index -> (dense bytes, sparse), from a results file's DDP buckets."""
    return {bucket["index"]: (bucket["bytes"], bucket.get("sparse", False)) for bucket in buckets}


def ready_buckets(ready: dict[int, float], sizes: dict[int, tuple[int, bool]]) -> list[tuple[float, int, bool]]:
    """``(ready ms, bytes, sparse)`` per bucket, in the order the buckets became ready."""
    return [(ready[index], *sizes.get(index, (0, False))) for index in sorted(ready, key=ready.get)]


def backward_compute(buckets: list[tuple[float, int, bool]], compute_ms: float | None, forward: float,
                     optimizer: float) -> float:
    """Backward's own compute: the compute-only iteration minus forward and optimizer, and at
    least until the last bucket was ready (without a compute-only iteration, just that)."""
    last_ready = max((ready for ready, _, _ in buckets), default=0.0)
    return last_ready if compute_ms is None else max(last_ready, compute_ms - forward - optimizer)


def own_terms(run: Run, calibration: Calibration) -> dict:
    """The compute phases and bucket timeline of one run alone (the calibration's pooled ones
    where the run lacks them), so that its slower or faster compute is not taken for its
    strategy's own cost."""
    ready = {row["index"]: row["ready_ms"] for row in run.timeline or []}
    buckets = ready_buckets(ready, bucket_sizes(run.buckets)) if ready else calibration.buckets
    backward = (backward_compute(buckets, run.compute_ms, run.forward_ms, run.optimizer_ms)
                if run.compute_ms is not None or ready else calibration.phases.backward)
    return {"phases": Phases(run.forward_ms, backward, run.optimizer_ms), "buckets": buckets}


def communication_end(calibration: Calibration, strategy: Strategy, hook: str, n: int, k: int,
                      mapping: str, per_node: int = 1, servers_on: str = "dedicated") -> float | None:
    """When the last bucket's combined gradient is back, ms after backward began (None: this
    strategy cannot be predicted from this calibration): its buckets through the pipeline its
    record's ``cost`` names, then what it pays once an iteration besides (``cost.iteration_ms``).
    ``per_node`` trainers share a node (its local link, ``calibration.intra_link``, between
    them); at 1, every model is the flat one."""
    cost = strategy.cost
    if cost.pipeline is None:
        return 0.0
    nodes = costs.Nodes(n // per_node, per_node, calibration.link, calibration.intra_link)
    end = BUCKET_PIPELINES[cost.pipeline](calibration, strategy, hook, nodes, k, mapping, servers_on)
    if end is not None and cost.iteration_ms is not None:
        end += cost.iteration_ms(nodes, calibration.gradient_bytes)
    return end


def wire_factor(strategy: Strategy) -> float:
    """Bytes on the wire per float32 byte of gradient."""
    return ELEMENT_BYTES[strategy.payload] / ELEMENT_BYTES["float32"]


def collectives_end(calibration: Calibration, strategy: Strategy, hook: str, nodes: costs.Nodes, k: int,
                    mapping: str, servers_on: str) -> float:
    """Each bucket combined by collectives among the trainers: a dense one as its record's
    ``cost.bucket_ms`` says (default: a ring over every trainer), a sparse one all-gathered."""
    bucket_ms = strategy.cost.bucket_ms or (lambda nodes, nbytes, gloo: costs.flat_ring_ms(nodes, nbytes))
    slowest = nodes.within() if nodes.count == 1 and nodes.per_node > 1 else calibration.link
    factor = wire_factor(strategy)

    def transfer(item):
        nbytes, sparse = item
        if sparse:
            return costs.allgather_ms(nodes.trainers, nbytes, slowest)
        return bucket_ms(nodes, nbytes * factor, calibration.gloo)
    return pipelines.pipeline([(ready, (nbytes, sparse)) for ready, nbytes, sparse in calibration.buckets], transfer)


def low_rank_end(calibration: Calibration, strategy: Strategy, hook: str, nodes: costs.Nodes, k: int,
                 mapping: str, servers_on: str) -> float | None:
    """Low-rank factors all-reduced bucket by bucket (three collectives each): their size
    depends on the layers' shapes, so it is known from a run of the strategy only."""
    ratio = calibration.payload_ratio.get(hook)
    if ratio is None:
        return None
    return pipelines.pipeline([(ready, nbytes * ratio) for ready, nbytes, _ in calibration.buckets],
                              lambda nbytes: costs.flat_ring_ms(nodes, nbytes, steps_per_message=3))


def server_bytes(calibration: Calibration, strategy: Strategy) -> list[tuple[float, float]]:
    """``(ready ms, bytes on the wire)`` of each bucket a trainer pushes to the servers."""
    factor = wire_factor(strategy)
    return [(ready, nbytes if sparse and strategy.sparse_buckets == SPARSE_SERVERS else nbytes * factor)
            for ready, nbytes, sparse in calibration.buckets]


def servers_end(calibration: Calibration, strategy: Strategy, hook: str, nodes: costs.Nodes, k: int,
                mapping: str, servers_on: str) -> float | None:
    """Every trainer pushes each bucket to its server: ``k`` dedicated ones, or one on each node."""
    sized = server_bytes(calibration, strategy)
    if servers_on == "colocated":
        return pipelines.colocated_ps_pipeline(sized, nodes, calibration.aggregate_bytes_per_ms)
    if k < 1:
        return None
    return pipelines.ps_pipeline(sized, nodes.trainers, k, calibration.link, mapping,
                                 calibration.aggregate_bytes_per_ms, nodes.per_node)


def host_servers_end(calibration: Calibration, strategy: Strategy, hook: str, nodes: costs.Nodes, k: int,
                     mapping: str, servers_on: str) -> float | None:
    """Each bucket summed within the node, one push per node: each trainer a slice."""
    colocated = servers_on == "colocated"
    if not colocated and k < 1:
        return None
    return pipelines.node_ps_pipeline(server_bytes(calibration, strategy), nodes, nodes.count if colocated else k,
                                      calibration.aggregate_bytes_per_ms, colocated, calibration.gloo)


# the pipeline each Strategy.cost.pipeline names
BUCKET_PIPELINES = {COLLECTIVE_BUCKETS: collectives_end, LOW_RANK_BUCKETS: low_rank_end,
                    SERVER_BUCKETS: servers_end, HOST_SERVER_BUCKETS: host_servers_end}


def own_compute(calibration: Calibration, hook: str) -> float:
    """The strategy's own compute from its run; without one, that of the strategy its record says
    it costs like (``cost.like``: the lossless one it compresses, ps_fp16 that of ps; ps_node that
    of ps, the same servers answering the same round trip per bucket), else 0."""
    like = HOOKS.record(hook).cost.like
    return calibration.own_ms.get(hook, calibration.own_ms.get(like, 0.0) if like else 0.0)


def sends_ms(calibration: Calibration, strategy: Strategy, hook: str, n: int, per_node: int = 1) -> float:
    """What a strategy's collectives over the whole model (its record's ``sends``: FSDP2's and
    ZeRO's gathers and scatters, local SGD's and DiLoCo's all-reduce once a period) cost an
    iteration, amortised over the period (its default, ``hook_options``), taken as not hidden
    behind compute (FSDP2 prefetches some of its gathers: an upper bound)."""
    if not strategy.sends:
        return 0.0
    nodes = costs.Nodes(n // per_node, per_node, calibration.link, calibration.intra_link)
    period = hook_options(hook, {}).get("period", 1)
    factor = ELEMENT_BYTES[strategy.payload] / ELEMENT_BYTES["float32"] if strategy.payload in ELEMENT_BYTES else 1.0
    return sum(costs.collective_ms(collective, nodes, calibration.gradient_bytes * factor, calibration.gloo)
               / (period if per == "period" else 1) for collective, per in strategy.sends)


def predict(calibration: Calibration, hook: str, n: int, k: int, mapping: str = "shard", own: bool = True,
            per_node: int = 1, servers_on: str = "dedicated") -> dict | None:
    """Predicted iteration of ``hook`` with ``n`` trainers, ``per_node`` to a node, and ``k``
    servers (dedicated, or colocated: one on each node) (None: not predictable): its hook's
    buckets overlapped with backward, then the collectives it issues besides (``sends_ms``)."""
    strategy = HOOKS.record(hook)
    end = communication_end(calibration, strategy, hook, n, k, mapping, per_node, servers_on)
    if end is None:
        return None
    own_ms = own_compute(calibration, hook) if own else 0.0
    sent_ms = sends_ms(calibration, strategy, hook, n, per_node)
    batch = pipelines.iteration_ms(calibration.phases, end, own_ms) + sent_ms
    return {"batch_ms": batch, "communication_end_ms": end, "sends_ms": sent_ms, "own_ms": own_ms,
            "samples_per_s": n * calibration.batch_size / (batch / 1000.0) if batch > 0 else None}


def from_compute_ms(model: str, batch_size: int, phases: Phases, buckets: list[tuple[int, bool]], link: Link,
                    link_from: str) -> Calibration:
    """A calibration with no run: compute phases as given, the buckets' ready times spread over
    backward in proportion to their bytes (``inputs.spread``)."""
    return Calibration(model, batch_size, phases, spread(phases.backward, buckets), link, link_from, None,
                       "--compute-ms: bucket-ready times spread over backward in proportion to their bytes", [])
