"""The master's rounds: create servers and trainers, run warmup and timed rounds, report."""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed.rpc as rpc

from ps_bench.config import Entry, RunConfig
from ps_bench.data import build_data
from ps_bench.metrics.results import SCHEMA, default_results_path, environment, iso_now, print_report, write_results
from ps_bench.metrics.stats import summary_rows
from ps_bench.servers import SERVERS
from ps_bench.topology import Topology
from ps_bench.trainers.trainer import TRAINER_METRICS, TRAINERS

SERVER_METRICS = ("straggler", "aggregate", "round")


def device_name(index: int | None) -> str:
    return "cpu" if index is None else f"cuda:{index}"


class Master:
    def __init__(self, config: RunConfig, topology: Topology, model: Entry, data: Entry,
                 device_of: callable, argv: list[str]) -> None:
        self.config, self.topology = config, topology
        self.model, self.data = model, data
        self.device_of = device_of  # rank -> CUDA index or None
        self.argv = argv
        self.started = iso_now()

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
                servers=handles,
                mapping=topo.mapping,
                group_server=topo.group_of(info.index) if topo.mapping == "group" and servers else None,
                cuda_rpc=info.cuda_rpc,
                device=device_name(self.device_of(info.rank)),
                rpc_timeout=cfg.rpc_timeout,
                bucket_cap_mb=cfg.bucket_cap_mb,
            )))
        for trainer in trainers:  # waits until every DDP replica is built
            trainer.rpc_sync(timeout=0).ready()
        return trainers

    def run(self) -> dict:
        cfg, topo = self.config, self.topology
        servers = self.create_servers()
        trainers = self.create_trainers(servers)
        trainer_samples: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        server_samples: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        trainer_bytes = defaultdict(lambda: [0, 0])
        server_bytes = defaultdict(lambda: [0, 0])
        iterations = processed = 0
        timed_s = 0.0
        losses: list[float] = []
        total = cfg.warmup_rounds + cfg.rounds
        run_start = time.perf_counter()
        for round_index in range(total):
            timed = round_index >= cfg.warmup_rounds
            start = time.perf_counter()
            futures = [t.rpc_async(timeout=0).run_round() for t in trainers]
            rounds = [f.wait() for f in futures]
            elapsed = time.perf_counter() - start
            served = [s.rpc_sync().take_metrics() for s in servers]
            for server in servers:
                server.rpc_sync().reset_state()
            mean_loss = sum(r["losses"][-1] for r in rounds) / len(rounds)
            print(
                f"[round {round_index + 1}/{total}] {'timed' if timed else 'warmup':6} "
                f"{elapsed:7.2f} s  (elapsed {time.perf_counter() - run_start:6.1f} s)  loss {mean_loss:.4f}",
                flush=True,
            )
            if not timed:
                continue
            timed_s += elapsed
            iterations += rounds[0]["iterations"]
            for info, result in zip(topo.trainers, rounds):
                for metric, values in result["samples"].items():
                    trainer_samples[info.rank][metric].extend(values)
                trainer_bytes[info.rank][0] += result["bytes_sent"]
                trainer_bytes[info.rank][1] += result["bytes_recv"]
                processed += result["samples_processed"]
            losses.append(sum(sum(r["losses"]) / len(r["losses"]) for r in rounds) / len(rounds))
            for info, result in zip(topo.servers, served):
                for metric, values in result["samples"].items():
                    server_samples[info.rank][metric].extend(values)
                server_bytes[info.rank][0] += result["bytes"]["recv"]
                server_bytes[info.rank][1] += result["bytes"]["sent"]
        replicas = self.compare_replicas(trainers)

        rows = summary_rows("trainer", trainer_samples, TRAINER_METRICS, split_ranks=cfg.per_rank)
        rows += summary_rows("server", server_samples, SERVER_METRICS, split_ranks=cfg.per_rank)
        pooled_rows = [r for r in rows if r.rank is None]

        def per_iter(counts: dict, column: int, count: int) -> float:
            return sum(c[column] for c in counts.values()) / count / iterations if count and iterations else 0.0

        results = {
            "schema": SCHEMA,
            "status": "ok",
            "started": self.started,
            "finished": iso_now(),
            "argv": self.argv,
            "config": {**cfg.to_dict(), "model_config": self.model.to_dict(), "data_config": self.data.to_dict()},
            "env": environment(cfg.backend),
            "summary": [r.to_dict() for r in pooled_rows],
            "throughput": {
                "samples_per_s": processed / timed_s if timed_s else 0.0,
                "iterations": iterations,
                "timed_s": timed_s,
            },
            "bytes": {
                "trainer_sent_per_iter": per_iter(trainer_bytes, 0, topo.num_trainers),
                "trainer_recv_per_iter": per_iter(trainer_bytes, 1, topo.num_trainers),
                "server_recv_per_iter": per_iter(server_bytes, 0, topo.num_servers),
                "server_sent_per_iter": per_iter(server_bytes, 1, topo.num_servers),
            },
            "replicas": replicas,
            "loss": {"first": losses[0], "last": losses[-1]} if losses else None,
            "samples": [
                {"role": info.role, "rank": info.rank, "name": info.name, "metrics": dict(samples[info.rank])}
                for info, samples in [(i, trainer_samples) for i in topo.trainers]
                + [(i, server_samples) for i in topo.servers]
            ],
        }
        print_report(results, rows)
        path = write_results(results, cfg.out or default_results_path(cfg.hook, topo.num_trainers, topo.num_servers))
        print(f"results: {path}", flush=True)
        return results

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
