"""The master's rounds: create servers and trainers, run warmup and timed rounds, report."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed.rpc as rpc

from ps_bench.config import Entry, RunConfig
from ps_bench.faults import Fault, maybe_inject
from ps_bench.metrics import limits
from ps_bench.metrics.memory import combine_peaks, peak_memory
from ps_bench.metrics.results import SCHEMA, environment, format_bytes, iso_now, print_report, write_results
from ps_bench.models import build_data
from ps_bench.metrics.stats import SummaryRow, summary_rows
from ps_bench.servers import SERVERS
from ps_bench.topology import Topology
from ps_bench.trainers.trainer import BYTE_METRICS, TRAINER_METRICS, TRAINERS, bucket_bytes

SERVER_METRICS = ("straggler", "aggregate", "round")
PARTIAL_NAME = "partial.json"
SNAPSHOT_CHEAP_S = 0.05


def device_name(index: int | None) -> str:
    return "cpu" if index is None else f"cuda:{index}"


def describe_buckets(buckets: list[dict]) -> str:
    sizes = ", ".join(format_bytes(b["bytes"]) + (" sparse, this iteration's" if b["sparse"] else "") for b in buckets)
    return f"DDP buckets, as DDP built them: {len(buckets)} ({sizes})"


def write_snapshot(results: dict, run_dir: str) -> None:
    """What has finished so far, for the launcher to keep if the job fails later."""
    path = Path(run_dir) / PARTIAL_NAME
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(results))
    os.replace(temporary, path)


def read_snapshot(run_dir: str) -> dict | None:
    try:
        return json.loads((Path(run_dir) / PARTIAL_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None


class Master:
    def __init__(self, config: RunConfig, topology: Topology, model: Entry, data: Entry,
                 device_of: Callable[[int], int | None], argv: list[str], run_dir: str, results_path: str,
                 launched_at: float | None = None, hosts: list[dict] | None = None,
                 recovered: list[dict] | None = None) -> None:
        self.config, self.topology = config, topology
        self.model, self.data = model, data
        self.device_of = device_of
        self.argv = argv
        self.run_dir = run_dir
        self.results_path = results_path
        self.fault = Fault.parse(config.inject_fault) if config.inject_fault else None
        self.started = iso_now()
        self.launched_at = time.time() if launched_at is None else launched_at
        self.environment = {**environment(config.backend), "hosts": hosts or []}  # read once: every snapshot repeats it
        self.recovered = recovered or []  # earlier attempts torchrun restarted the job after
        self.trainer_samples: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.server_samples: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self.trainer_bytes: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.server_bytes: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.iterations = self.processed = self.rounds_done = 0
        self.timed_s = 0.0
        self.losses: list[float] = []
        self.grad_errors: list[float] = []
        self.verified_iterations = 0
        self.replicas: dict | None = None
        self.buckets: list[dict] | None = None  # DDP's buckets as it built them, from trainer 0
        self.limits: dict | None = None
        self.floor_layout: dict[int, int] | None = None  # --limits: the buckets every floor moves
        self.floor_targets: list[rpc.RRef] = []
        self.floor_samples: dict[str, list[float]] = defaultdict(list)
        self.memory: dict[str, dict[int, dict]] = {"trainer": {}, "server": {}}
        self.snapshot_at = self.snapshot_cost = 0.0

    # -- setting up ------------------------------------------------------------------------
    def create_servers(self) -> list[rpc.RRef]:
        cfg, topo = self.config, self.topology
        server_class = SERVERS.get(cfg.server)
        servers = [
            rpc.remote(info.name, server_class, kwargs=dict(
                server_index=info.index,
                num_servers=topo.num_servers,
                contributors=topo.contributors(info.index),
                num_trainers=topo.num_trainers,
                mapping=topo.mapping,
                device=device_name(self.device_of(info.rank)),
                fault=cfg.inject_fault,
            ))
            for info in topo.servers
        ]
        for server in servers:
            server.rpc_sync().set_peers(servers)
        return servers

    def create_trainers(self, servers: list[rpc.RRef]) -> list[rpc.RRef]:
        cfg, topo = self.config, self.topology
        dataset = build_data(self.data.class_name, self.data.kwargs, cfg.torch_seed)
        handles = [(rref, info.cuda_rpc) for rref, info in zip(servers, topo.servers)]
        trainer_class = TRAINERS.get(cfg.trainer)
        trainers = []
        for info in topo.trainers:
            shard = dataset.shard(info.index, topo.num_trainers)
            trainers.append(rpc.remote(info.name, trainer_class, kwargs=dict(
                trainer_index=info.index,
                model_class=self.model.class_name,
                model_kwargs=self.model.kwargs,
                seed=cfg.torch_seed,
                inputs=shard.inputs,
                targets=shard.targets,
                batch_size=cfg.batch_size,
                epochs=cfg.epochs,
                lr=cfg.lr,
                hook=cfg.hook,
                hook_options=cfg.hook_options,
                servers=handles,
                mapping=topo.mapping,
                group_server=topo.group_of(info.index) if topo.mapping == "group" and servers else None,
                cuda_rpc=info.cuda_rpc,
                device=device_name(self.device_of(info.rank)),
                rpc_timeout=cfg.rpc_timeout,
                bucket_cap_mb=cfg.bucket_cap_mb,
                gradient_as_bucket_view=cfg.gradient_as_bucket_view,
                fault=cfg.inject_fault,
            )))
        for trainer in trainers:  # waits until every DDP replica is built
            trainer.rpc_sync(timeout=0).ready()
        return trainers

    # -- the rounds --------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.config
        self.snapshot()
        servers = self.create_servers()
        trainers = self.create_trainers(servers)
        total = cfg.warmup_rounds + cfg.rounds
        print(f"ps_bench: ready after {time.time() - self.launched_at:.1f} s (every rank started, servers created, "
              f"DDP built on every trainer); {cfg.warmup_rounds} warmup and {cfg.rounds} timed rounds follow",
              flush=True)
        print(self.describe_workload(), flush=True)
        run_start = time.perf_counter()
        for round_index in range(total):
            maybe_inject(self.fault, "master", 0, round_index + 1)
            timed = round_index >= cfg.warmup_rounds
            start = time.perf_counter()
            profiled = cfg.profile is not None and round_index == total - 1
            futures = [t.rpc_async(timeout=0).run_round(verify=timed and cfg.verify,
                                                        profile_path=self.trace_path(info) if profiled else None)
                       for t, info in zip(trainers, self.topology.trainers)]
            rounds = [f.wait() for f in futures]
            elapsed = time.perf_counter() - start
            served = [s.rpc_sync().take_metrics() for s in servers]
            for server in servers:
                server.rpc_sync().reset_state()
            mean_loss = sum(sum(r["losses"]) / len(r["losses"]) for r in rounds) / len(rounds)
            if self.buckets is None:  # DDP rebuilds its buckets in the first iteration: read them after it
                self.buckets = trainers[0].rpc_sync().bucket_layout()
                print(describe_buckets(self.buckets), flush=True)
            if timed:  # kept before it is announced
                self.add_round(elapsed, rounds, served, mean_loss)
                self.snapshot()
            print(
                f"[round {round_index + 1}/{total}] {'timed' if timed else 'warmup':6} "
                f"{elapsed:7.2f} s  (elapsed {time.perf_counter() - run_start:6.1f} s)  loss {mean_loss:.4f}",
                flush=True,
            )
            if timed and cfg.limits:
                self.measure_floors(trainers)
        self.replicas = self.compare_replicas(trainers)
        if cfg.limits:
            self.limits = self.summarize_limits()
        results = self.results("ok")
        print_report(results, self.rows(split_ranks=cfg.per_rank))
        path = write_results(results, self.results_path)
        print(f"results: {path}", flush=True)
        return results

    def add_round(self, elapsed: float, rounds: list[dict], served: list[dict], mean_loss: float) -> None:
        topo = self.topology
        self.rounds_done += 1
        self.timed_s += elapsed
        self.iterations += rounds[0]["iterations"]
        for info, result in zip(topo.trainers, rounds):
            for metric, values in result["samples"].items():
                self.trainer_samples[info.rank][metric].extend(values)
            self.trainer_bytes[info.rank][0] += result["bytes_sent"]
            self.trainer_bytes[info.rank][1] += result["bytes_recv"]
            self.processed += result["samples_processed"]
        self.losses.append(mean_loss)
        for result in rounds:
            self.grad_errors.extend(result["grad_errors"])
        self.verified_iterations += rounds[0]["verified_iterations"]
        for info, result in zip(topo.trainers, rounds):
            self.memory["trainer"][info.rank] = result["memory"]
        for info, result in zip(topo.servers, served):
            self.memory["server"][info.rank] = result["memory"]
            for metric, values in result["samples"].items():
                self.server_samples[info.rank][metric].extend(values)
            self.server_bytes[info.rank][0] += result["bytes"]["recv"]
            self.server_bytes[info.rank][1] += result["bytes"]["sent"]

    def snapshot(self) -> None:
        """Keeps the finished rounds for the launcher, after every round. The snapshot grows with
        the run: once writing one costs more than SNAPSHOT_CHEAP_S, it is skipped while less than
        ten times that cost has passed since the last one (at most about a tenth of the wall
        time, between rounds, never inside the timed region)."""
        start = time.perf_counter()
        if self.snapshot_cost > SNAPSHOT_CHEAP_S and start - self.snapshot_at < 10 * self.snapshot_cost:
            return
        write_snapshot(self.results("failed", error="the job ended before it finished"), self.run_dir)
        self.snapshot_at = time.perf_counter()
        self.snapshot_cost = self.snapshot_at - start

    def describe_workload(self) -> str:
        size = self.model.size
        sparse = f" + {format_bytes(size['sparse_gradient_bytes'])} sparse (at dense size)" \
            if size["sparse_gradient_bytes"] else ""
        return (f"model {self.model.id}: {size['parameters']:,} parameters, gradients "
                f"{format_bytes(size['dense_gradient_bytes'])} dense{sparse}; data {self.data.id}")

    # -- results -------------------------------------------------------------------------------
    def rows(self, split_ranks: bool = False) -> list[SummaryRow]:
        """Timing rows (ms), then per-iteration bytes rows (B) for the printed tables."""
        rows = summary_rows("trainer", self.trainer_samples, TRAINER_METRICS, split_ranks=split_ranks)
        rows += summary_rows("trainer", self.trainer_samples, BYTE_METRICS, unit="B", split_ranks=split_ranks)
        return rows + summary_rows("server", self.server_samples, SERVER_METRICS, split_ranks=split_ranks)

    def results(self, status: str, error: str | None = None) -> dict:
        cfg, topo = self.config, self.topology

        def per_iter(counts: dict[int, list[int]], column: int, processes: int) -> float:
            if not processes or not self.iterations:
                return 0.0
            return sum(c[column] for c in counts.values()) / processes / self.iterations

        results = {
            "schema": SCHEMA,
            "status": status,
            **({"error": error} if error is not None else {}),
            "started": self.started,
            "finished": iso_now(),
            "argv": self.argv,
            "config": {**cfg.to_dict(), "model_config": self.model.to_dict(), "data_config": self.data.to_dict(),
                       "model_size": {**self.model.size, "ddp_buckets": self.buckets}},
            "env": self.environment,
            "restarts": len(self.recovered),
            "recovered": self.recovered,
            "rounds_completed": self.rounds_done,
            "summary": [r.to_dict() for r in self.rows() if r.unit == "ms"],
            "throughput": {
                "samples_per_s": self.processed / self.timed_s if self.timed_s else 0.0,
                "iterations": self.iterations,
                "timed_s": self.timed_s,
            },
            "bytes": {
                "trainer_sent_per_iter": per_iter(self.trainer_bytes, 0, topo.num_trainers),
                "trainer_recv_per_iter": per_iter(self.trainer_bytes, 1, topo.num_trainers),
                "server_recv_per_iter": per_iter(self.server_bytes, 0, topo.num_servers),
                "server_sent_per_iter": per_iter(self.server_bytes, 1, topo.num_servers),
            },
            "replicas": self.replicas,
            "loss": {"first": self.losses[0], "last": self.losses[-1]} if self.losses else None,
            **({"verify": self.verify_summary()} if cfg.verify else {}),
            "memory": {
                "trainer": combine_peaks(list(self.memory["trainer"].values())),
                "server": combine_peaks(list(self.memory["server"].values())) if topo.num_servers else None,
                "master": peak_memory(),
            },
            **({"limits": self.limits, "efficiency": self.efficiency()} if self.limits else {}),
            "samples": [
                {"role": info.role, "rank": info.rank, "name": info.name, "metrics": dict(samples.get(info.rank, {}))}
                for info, samples in [(i, self.trainer_samples) for i in topo.trainers]
                + [(i, self.server_samples) for i in topo.servers]
            ],
        }
        return results

    def trace_path(self, info) -> str:
        return str(Path(self.config.profile) / f"{info.role}{info.index}-rank{info.rank}.json")

    def measure_floors(self, trainers: list[rpc.RRef]) -> None:
        """``--limits``: a share of every floor's repetitions, after each timed round, so floors and
        strategy are sampled under the same conditions of the machine (see ``ps_bench.metrics.limits``).
        The buckets are trainer 0's of the first timed round's last iteration, the same for every
        trainer and every round."""
        topo = self.topology
        if self.floor_layout is None:
            self.floor_layout = bucket_bytes(trainers[0].rpc_sync().bucket_layout())
            self.floor_targets = [rpc.remote(info.name, limits.RpcFloorTarget, args=(self.floor_layout,))
                                  for info in topo.servers]
        repeat = limits.repeats_per_round(self.config.rounds)
        futures = [t.rpc_async(timeout=0).measure_floors(self.floor_layout, self.floor_targets, repeat)
                   for t in trainers]
        for floors in [f.wait() for f in futures]:
            for kind, samples in floors.items():
                self.floor_samples[kind].extend(samples)

    def summarize_limits(self) -> dict:
        """The floors' statistics over every round's samples, pooled over trainers, and memcpy."""
        topo, samples = self.topology, self.floor_samples
        per_iteration = sum(self.floor_layout.values())
        return {
            "bytes_per_iter": per_iteration,
            "buckets": len(self.floor_layout),
            "rpc": limits.floor_summary(samples["rpc_ms"], per_iteration) if samples["rpc_ms"] else None,
            "collective": {**limits.floor_summary(samples["collective_ms"], per_iteration, world=topo.num_trainers),
                           "backend": self.config.backend},
            "memcpy": limits.memcpy_floor(per_iteration),
            "compute": {"count": len(samples["compute_ms"]), "p50_ms": float(np.median(samples["compute_ms"]))},
        }

    def efficiency(self) -> dict | None:
        """The strategy's floor p50 over its trainer ``comm`` p50 (None for strategies that move nothing)."""
        kind = limits.floor_for(self.config.hook)
        floor = self.limits.get(kind) if kind else None
        p50 = {r.metric: r.p50 for r in self.rows() if r.role == "trainer" and r.unit == "ms"}
        if floor is None or "comm" not in p50:
            return None
        exposed_ms = max(0.0, p50["batch"] - self.limits["compute"]["p50_ms"])
        return {"floor": kind, "floor_ms": floor["p50_ms"], "cost": "trainer comm p50", "cost_ms": p50["comm"],
                "value": limits.efficiency(floor["p50_ms"], p50["comm"]),
                "exposed_ms": exposed_ms, "exposed_value": limits.efficiency(floor["p50_ms"], exposed_ms)}

    def verify_summary(self) -> dict:
        errors = sorted(self.grad_errors)
        return {
            "grad_rel_error_p50": float(np.percentile(errors, 50)) if errors else None,
            "grad_rel_error_max": errors[-1] if errors else None,
            "iterations": self.verified_iterations,
            "buckets_checked": len(errors),
        }

    @staticmethod
    def compare_replicas(trainers: list[rpc.RRef]) -> dict:
        vectors = [t.rpc_sync().parameters_vector() for t in trainers]
        reference = vectors[0]
        max_abs_diff = max((v - reference).abs().max().item() for v in vectors)
        return {
            "identical": all(torch.equal(v, reference) for v in vectors),
            "param_norm": reference.double().norm().item(),
            "max_abs_diff": max_abs_diff,
        }
