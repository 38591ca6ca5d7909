"""The books of one run: what the master gathers from each round, turned into the results file.

``RunRecord`` takes plain data (the dicts trainers and servers return for a round, floor
samples, the replicas' comparison) and builds the ``ps_bench.result/1`` object, for a run that
finished and for one that failed half-way alike; it starts no process and calls no RPC, so the
contract is unit-tested with made-up rounds. A failed run's file, and the snapshots of finished
rounds a running job's master hands its launcher, are written by ``ps_bench.results.files``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import torch

from ps_bench.config import RESULTS_SCHEMA
from ps_bench.job import Job
from ps_bench.metrics import flops
from ps_bench.metrics.costs import collective_bytes
from ps_bench.metrics.memory import combine_peaks, peak_memory
from ps_bench.metrics.stats import SummaryRow, summary_rows
from ps_bench.metrics.timers import ahead_ms, server_lane, server_offsets
from ps_bench.metrics.wire import host_links
from ps_bench.models import DATA, MODELS
from ps_bench.results import floors
from ps_bench.results.files import iso_now
from ps_bench.results.progress import Progress
from ps_bench.runtime.topology import PIECES, Topology
from ps_bench.strategies import compiled
from ps_bench.strategies.base import parameter_norm
from ps_bench.strategies.record import EVERY_ITERATION

# An engine's names for its collectives -> what ``costs.collective_bytes`` charges them as
COLLECTIVE_KINDS = {"all_gather_into_tensor": "all_gather", "all_gather_base": "all_gather",
                    "reduce_scatter_tensor": "reduce_scatter",
                    "reduce_scatter_base": "reduce_scatter"}
# ms, per iteration (exposed: on the CPU's clock only, ``metrics.timers.exposed_ms``)
TRAINER_METRICS = ("batch", "forward", "backward", "optimizer", "comm", "exposed")
BYTE_METRICS = ("bytes_sent", "bytes_recv")  # B, per iteration
SERVER_METRICS = ("straggler", "aggregate", "round")  # ms, per bucket and iteration


def servers_model_summary(vectors: list[torch.Tensor]) -> dict:
    """--staleness: no replicas to compare (the servers hold the one model): ``identical`` and
    ``max_abs_diff`` are null, ``param_norm`` is the servers' parameters'."""
    return {"identical": None, "param_norm": parameter_norm(torch.cat(vectors)),
            "max_abs_diff": None, "checked_at": None}


def difference(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    """Whether ``a`` and ``b`` are alike element by element, NaN where the other is NaN
    (replicas that diverged alike are alike; ``torch.equal`` calls no NaN equal), and the
    largest |a - b|, alike elements 0 apart and a NaN beside anything else infinitely far:
    identical replicas are 0 apart even where they diverged."""
    alike = (a == b) | (a.isnan() & b.isnan())
    apart = (a - b).abs().nan_to_num(nan=math.inf, posinf=math.inf)
    largest = torch.where(alike, torch.zeros_like(apart), apart).max().item() if a.numel() else 0.0
    return bool(alike.all()), largest


def replica_summary(vectors: list[torch.Tensor], checked_at: str = EVERY_ITERATION) -> dict:
    """Whether every trainer holds the same parameters (flattened), and how far apart they are;
    ``checked_at`` says which parameters each trainer handed over (its strategy record's
    ``identical``: the end of the run, its last synchronisation, or the full parameters gathered
    from the shards)."""
    reference = vectors[0]
    differences = [difference(v, reference) for v in vectors]
    return {
        "identical": all(alike for alike, _ in differences),
        "param_norm": parameter_norm(reference),
        "max_abs_diff": max(largest for _, largest in differences),
        "checked_at": checked_at,
    }


def replicas_alike(prints: list[dict], checked_at: str = EVERY_ITERATION) -> dict | None:
    """``replica_summary`` from the trainers' fingerprints (``strategies.base.fingerprint``) when
    they show bit-identical, finite parameters; None when they cannot say (the vectors decide)."""
    if not (math.isfinite(prints[0]["norm"]) and
            all(p["digest"] == prints[0]["digest"] for p in prints)):
        return None
    return {"identical": True, "param_norm": prints[0]["norm"], "max_abs_diff": 0.0,
            "checked_at": checked_at}


class RunRecord:
    """Everything a run's results file says, kept as the master's rounds arrive.

    The master calls ``add_round`` after each timed round (with what every trainer's
    ``run_round`` and every server's ``take_metrics`` returned), ``add_floors`` after it with
    ``--limits``, ``progress.add`` after every round with ``--target-loss``, and sets
    ``buckets`` and ``replicas`` once they are known; ``results`` builds the results object at
    any point, ``rows`` the printed tables."""

    def __init__(self, job: Job, topology: Topology, argv: list[str], environment: dict,
                 recovered: list[dict] | None = None) -> None:
        self.config, self.strategy, self.topology, self.engine_config = (
            job.config, job.strategy, topology, job.engine_config)
        self.model, self.data = job.model, job.data
        self.argv, self.environment = argv, environment
        # a model of sequences: its tokens and model FLOPs a sample (metrics.flops)
        self.tokens = flops.sequence_length(job.data)
        self.flops = (flops.model_flops_per_sample(job.model, job.data, MODELS, DATA)
                      if self.tokens else None)
        self.recovered = recovered or []  # earlier attempts torchrun restarted the job after
        self.recovery: dict | None = None  # checkpoints, failures, goodput (results.recovery)
        self.started = iso_now()
        self.trainer_samples: dict[int, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(list))
        self.server_samples: dict[int, dict[str, list[float]]] = defaultdict(
            lambda: defaultdict(list))
        self.trainer_bytes: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # sent, received
        self.server_bytes: dict[int, list[int]] = defaultdict(lambda: [0, 0])  # received, sent
        # (from host, to host) -> bytes
        self.host_traffic: dict[tuple[int, int], int] = defaultdict(int)
        self.rounds_done = 0
        # rank -> iterations, samples
        self.trainer_work: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.dropped: set[int] = set()  # ranks of trainers dropped (--trainer-timeout)
        # --staleness: each applied update's observed staleness, every server
        self.staleness: list[int] = []
        # --staleness: server rank -> updates applied
        self.server_updates: dict[int, int] = defaultdict(int)
        self.timed_s = 0.0  # the timed rounds' wall time, less untimed_s
        self.untimed_s = 0.0  # ... the iterations --verify checked and --profile traced
        self.losses: list[float] = []  # mean training loss of each timed round
        self.grad_errors: list[float] = []
        # --verify, an engine's own: calls, bytes
        self.engine_counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        # ms each collective's calls were open, all trainers
        self.collective_ms: dict[str, float] = defaultdict(float)
        # the timed iterations those ms were taken over, all trainers
        self.collective_iterations = 0
        self.verified_iterations = 0
        self.memory: dict[str, dict[int, dict]] = {"trainer": {}, "server": {}}
        self.buckets: list[dict] | None = None  # DDP's buckets as it built them, from trainer 0
        self.bucket_offsets: dict[int, list[tuple]] = defaultdict(list)  # (ready, done) ms
        self.server_offsets: dict[tuple[int, int], list[tuple]] = defaultdict(list)  # its lane
        self.replicas: dict | None = None
        # --limits: bucket index -> (elements, dtype) messages: the float32 buckets every transport
        # floor moves, and the strategy's own where they differ (16-bit, low-rank)
        self.floor_messages: dict[int, list[tuple[int, str]]] | None = None
        self.own_messages: dict[int, list[tuple[int, str]]] | None = None
        self.floor_gathered: list[int] = []  # the sparse buckets, all-gathered by collective floors
        self.floor_samples: dict[str, list[float]] = defaultdict(list)
        # --limits: the memory-copy floor, measured once the rounds are over
        self.memcpy: dict | None = None
        # --target-loss, from every round (warmup too)
        self.progress = Progress(job.config, topology)
        # --compile: rank -> its units, compile seconds before the timed rounds and within them
        self.compiled: dict[int, dict] = {}

    # -- what the master hands in ------------------------------------------------------------
    def add_round(self, elapsed_s: float, rounds: list[dict], served: list[dict]) -> float:
        """One timed round: ``rounds`` in trainer order (None: a trainer dropped by then),
        ``served`` in server order. Returns the round's mean training loss."""
        topo = self.topology
        ran = [result for result in rounds if result is not None]
        self.rounds_done += 1
        # less the iterations --verify checks and --profile traces, as the batch samples are. The
        # trainers run them nearly in step, each its own time on them plus its wait for the
        # others: less the least of them, so that every trainer's timed iterations still fit
        untimed_s = min(elapsed_s, min(result.get("untimed_s", 0.0) for result in ran))
        self.timed_s += elapsed_s - untimed_s
        self.untimed_s += untimed_s
        self.verified_iterations += ran[0]["verified_iterations"]
        for info, result in zip(topo.trainers, rounds):
            if result is None:
                continue
            self.trainer_work[info.rank][0] += result["iterations"]
            self.trainer_work[info.rank][1] += (result["samples_processed"]
                                                - result.get("untimed_samples", 0))
            moves = self.strategy.transport is not None  # moving nothing, it exposes none
            for metric, values in result["samples"].items():
                self.trainer_samples[info.rank][metric].extend(
                    values if moves or metric != "exposed" else [0.0] * len(values))
            self.trainer_bytes[info.rank][0] += result["bytes_sent"]
            self.trainer_bytes[info.rank][1] += result["bytes_recv"]
            self.grad_errors.extend(result["grad_errors"])
            for kind, ms in result.get("collectives", {}).items():
                self.collective_ms[kind] += ms
            self.collective_iterations += len(result["samples"].get("batch", []))
            for name, (calls, nbytes) in (result.get("engine_counts", {})
                                          if info.index == 0 else {}).items():
                self.engine_counts[name][0] += calls
                self.engine_counts[name][1] += nbytes
            for source, destination, nbytes in result.get("host_traffic", []):
                self.host_traffic[source, destination] += nbytes
            self.memory["trainer"][info.rank] = result["memory"]
            if "compile" in result:
                compiled.note(self.compiled, info.rank, result["compile"])
            for bucket, offsets in result.get("timeline", {}).items():
                self.bucket_offsets[bucket].extend(offsets)
        began = rounds[0].get("backward_began") if rounds and rounds[0] else None  # trainer 0's
        for info, result in zip(topo.servers, served):
            if result is None:  # lost (--server-replicas)
                continue
            ahead = ahead_ms(self.environment.get("clocks"), info.rank, topo.trainers[0].rank)
            for key, offsets in server_offsets(began, result.get("recent"), ahead).items():
                self.server_offsets[info.index, key].extend(offsets)
            for metric, values in result["samples"].items():
                self.server_samples[info.rank][metric].extend(values)
            self.server_bytes[info.rank][0] += result["bytes"]["recv"]
            self.server_bytes[info.rank][1] += result["bytes"]["sent"]
            self.memory["server"][info.rank] = result["memory"]
            self.staleness.extend(result.get("staleness", []))
            self.server_updates[info.rank] += result.get("updates", 0)
        loss = mean_loss(ran)
        self.losses.append(loss)
        return loss

    def staleness_summary(self) -> dict:
        """--staleness: the bound, the observed staleness of every applied update (p50, p99, max)
        and each server's updates per second of the timed rounds."""
        observed = np.asarray(self.staleness, dtype=np.float64)
        return {
            "bound": self.config.staleness,
            "updates": len(observed),
            "p50": float(np.percentile(observed, 50)) if len(observed) else None,
            "p99": float(np.percentile(observed, 99)) if len(observed) else None,
            "max": int(observed.max()) if len(observed) else None,
            "servers": [{"rank": info.rank, "updates": self.server_updates[info.rank],
                         "updates_per_s": (self.server_updates[info.rank] / self.timed_s
                                           if self.timed_s else 0.0)}
                        for info in self.topology.servers],
        }

    def add_floors(self, floors: list[dict[str, list[float]]]) -> None:
        """``--limits``: every trainer's floor samples (ms) of one round, by floor."""
        for samples in floors:
            for kind, values in samples.items():
                self.floor_samples[kind].extend(values)

    # -- what it gives ---------------------------------------------------------------------------
    def rows(self, split_ranks: bool = False) -> list[SummaryRow]:
        """Timing rows (ms), then per-iteration bytes rows (B) for the printed tables."""
        rows = summary_rows("trainer", self.trainer_samples, TRAINER_METRICS,
                            split_ranks=split_ranks)
        rows += summary_rows("trainer", self.trainer_samples, BYTE_METRICS, unit="B",
                             split_ranks=split_ranks)
        return rows + summary_rows("server", self.server_samples, SERVER_METRICS,
                                   split_ranks=split_ranks)

    @property
    def samples_per_s(self) -> float:
        """The timed rounds' samples a second, every trainer's."""
        if not self.timed_s:
            return 0.0
        return sum(work[1] for work in self.trainer_work.values()) / self.timed_s

    def results(self, status: str, error: str | None = None) -> dict:
        """The ``ps_bench.result/1`` object of the run so far."""
        cfg, topo = self.config, self.topology
        measured_floors = self.limits()
        return {
            "schema": RESULTS_SCHEMA,
            "status": status,
            **({"error": error} if error is not None else {}),
            "started": self.started,
            "finished": iso_now(),
            "argv": self.argv,
            "config": {**cfg.to_dict(), "model_config": self.model.to_dict(),
                       "data_config": self.data.to_dict(),
                       "model_size": {**self.model.size, "ddp_buckets": self.buckets},
                       **({"engine_config": self.engine_config}
                          if self.engine_config is not None else {})},
            "env": self.environment,
            "restarts": len(self.recovered),
            "recovered": self.recovered,
            **({"recovery": self.recovery} if self.recovery is not None else {}),
            "rounds_completed": self.rounds_done,
            "summary": [r.to_dict() for r in self.rows() if r.unit == "ms"],
            "throughput": {
                "samples_per_s": self.samples_per_s,
                "samples_per_iteration": cfg.batch_size * cfg.grad_accum,
                "iterations": self.iterations,
                "timed_s": self.timed_s,
                "untimed_s": self.untimed_s,
                "per_trainer": [{"index": info.index, "rank": info.rank,
                                 "iterations": self.trainer_work[info.rank][0],
                                 "samples_per_s": (self.trainer_work[info.rank][1] / self.timed_s
                                                   if self.timed_s else 0.0)}
                                for info in topo.trainers],
                **flops.throughput_of(self.samples_per_s, topo.num_trainers - len(self.dropped),
                                      self.tokens, self.flops, flops.peak_tflops(
                                          cfg.peak_tflops,
                                          self.environment.get("cuda_devices") or []
                                          if cfg.ncudatrainer else [], cfg.precision)),
            },
            "bytes": {
                "trainer_sent_per_iter": self.per_iteration(self.trainer_bytes, 0,
                                                            topo.num_trainers),
                "trainer_recv_per_iter": self.per_iteration(self.trainer_bytes, 1,
                                                            topo.num_trainers),
                "server_recv_per_iter": self.per_iteration(self.server_bytes, 0, topo.num_servers),
                "server_sent_per_iter": self.per_iteration(self.server_bytes, 1, topo.num_servers),
                "server_recv_busiest_per_iter": max(
                    (self.per_iteration({rank: counts}, 0, 1) for rank, counts
                     in self.server_bytes.items()), default=0.0),
                **host_links(self.host_traffic, self.environment.get("hosts") or [],
                             self.mean_iterations),
            },
            "timeline": self.timeline(),
            "server_timeline": server_lane(self.server_offsets, PIECES),
            "replicas": self.replicas,
            "loss": {"first": self.losses[0], "last": self.losses[-1]} if self.losses else None,
            **({"convergence": self.progress.summary()} if cfg.target_loss is not None else {}),
            **({"staleness": self.staleness_summary()} if cfg.staleness is not None else {}),
            **({"verify": self.verify_summary()} if cfg.verify else {}),
            **({"compile": compiled.summary(self.compiled)} if cfg.compile else {}),
            "memory": {
                "trainer": combine_peaks(list(self.memory["trainer"].values())),
                "server": (combine_peaks(list(self.memory["server"].values()))
                           if topo.num_servers else None),
                "master": peak_memory(),
            },
            **({"limits": measured_floors, "efficiency": self.efficiency(measured_floors)}
               if measured_floors else {}),
            "samples": [
                {"role": info.role, "rank": info.rank, "name": info.name,
                 "metrics": dict(samples.get(info.rank, {}))}
                for info, samples in [(i, self.trainer_samples) for i in topo.trainers]
                + [(i, self.server_samples) for i in topo.servers]
            ],
        }

    @property
    def mean_iterations(self) -> float:
        """The timed iterations of a trainer (with --staleness each runs as many as it can in a
        round: their mean, over the whole run)."""
        done = [work[0] for rank, work in self.trainer_work.items() if rank not in self.dropped]
        return sum(done) / len(done) if done else 0.0

    @property
    def iterations(self) -> int:
        return round(self.mean_iterations)

    def per_iteration(self, counts: dict[int, list[int]], column: int, processes: int) -> float:
        """Bytes per iteration, mean per process of the role (over ``mean_iterations``,
        unrounded)."""
        if not processes or not self.mean_iterations:
            return 0.0
        return sum(c[column] for c in counts.values()) / processes / self.mean_iterations

    def timeline(self) -> list[dict] | None:
        """Each DDP bucket in the order it became ready: its payload bytes, and p50 over every
        trainer's sampled timed iterations (the last few of each round) of when backward handed
        it to the strategy (``ready_ms``) and when the strategy delivered it (``done_ms``; on a GPU,
        the end of backward), in ms after backward began, and on the CPU how long the strategy's
        hook held backward's thread before it returned (``held_ms``: what it did before its
        collective or RPC went off on their own); None before the buckets are known."""
        if not self.bucket_offsets or self.buckets is None:
            return None
        sizes = {bucket["index"]: bucket["bytes"] for bucket in self.buckets}
        rows = [{"index": index, "bytes": sizes.get(index),
                 "ready_ms": float(np.median([offset[0] for offset in offsets])),
                 "done_ms": float(np.median([offset[1] for offset in offsets])),
                 **({"held_ms": float(np.median([offset[2] for offset in offsets]))}
                    if all(len(offset) > 2 for offset in offsets) else {})}
                for index, offsets in self.bucket_offsets.items()]
        return sorted(rows, key=lambda row: (row["ready_ms"], row["index"]))

    def verify_summary(self) -> dict:
        """--verify: the gradient error of every captured bucket against the exact mean; for a
        strategy run by an engine of its own, what the engine's own logger says it sent (trainer
        0's collectives, each charged per rank as ``costs.collective_bytes`` charges it)."""
        errors = sorted(self.grad_errors)
        out = {
            "grad_rel_error_p50": float(np.percentile(errors, 50)) if errors else None,
            "grad_rel_error_max": errors[-1] if errors else None,
            "iterations": self.verified_iterations,
            "buckets_checked": len(errors),
        }
        if self.engine_counts and self.iterations:
            world, per = self.topology.num_trainers, self.iterations
            out["engine"] = {name: {"calls_per_iter": calls / per, "bytes_per_iter": nbytes / per}
                             for name, (calls, nbytes) in sorted(self.engine_counts.items())}
            out["engine_sent_per_iter"] = sum(
                collective_bytes(COLLECTIVE_KINDS.get(name, name), nbytes / calls, world,
                                 self.config.backend) * calls
                for name, (calls, nbytes) in self.engine_counts.items() if calls) / per
        return out

    def limits(self) -> dict | None:
        """``--limits``: the floors measured and the strategy's efficiency against them
        (``ps_bench.results.floors``); None until the memcpy floor is in."""
        return floors.limits(self)

    def efficiency(self, measured: dict) -> dict | None:
        return floors.efficiency(self, measured)


def mean_loss(rounds: list[dict]) -> float:
    """The mean over trainers of each trainer's mean loss over the round (NaN for a round that
    ran no iteration)."""
    if not rounds[0]["losses"]:
        return float("nan")
    return sum(sum(r["losses"]) / len(r["losses"]) for r in rounds) / len(rounds)
