"""The master rank: creates the servers and trainers over RPC and drives the rounds."""

from __future__ import annotations

import sys
import time
from typing import Callable

import torch.distributed.rpc as rpc

from ps_bench.job import Job
from ps_bench.metrics import limits, messages
from ps_bench.metrics.startup import render_startup, startup_phases
from ps_bench.models import build_data, build_held_out
from ps_bench.models.entries import Entry
from ps_bench.options import plural
from ps_bench.processes.attempts import Attempts, RecoveryBooks
from ps_bench.processes.healing import Healing
from ps_bench.processes.waiting import (PROGRESS_EVERY_S, PROGRESS_FIRST_S, Elastic,
                                        ServersLost, round_progress, wait_round)
from ps_bench.processes import tracing
from ps_bench.processes.kept import Keeper
from ps_bench.results.files import environment, keep_results
from ps_bench.results.printed import format_bytes, print_report
from ps_bench.results.record import (RunRecord, mean_loss, replica_summary, replicas_alike,
                                     servers_model_summary)
from ps_bench.runtime.faults import faults_of, maybe_inject, schedule_of
from ps_bench.processes.rendezvous import crowded_warning, one_machine_warning, rpc_paths
from ps_bench.runtime.topology import Topology
from ps_bench.servers import SERVERS
from ps_bench.strategies import HOOKS, hook_options
from ps_bench.strategies.record import DDP, ENGINE, FSDP, SERVER_OWNED, SERVERS_MODEL, Strategy
from ps_bench.strategies.stale import parse_staleness
from ps_bench.trainers.convergence import HELD_OUT_SAMPLES
from ps_bench.trainers.trainer import TRAINERS

SETTLING_ITERATIONS = 2  # DDP builds its buckets in the first, rebuilds them in the second
# what each way of wrapping the model had built on the trainers when the job is ready
BUILT = {DDP: "DDP built on every trainer", FSDP: "every trainer's model sharded (FSDP2)",
         ENGINE: "every trainer's engine built", SERVER_OWNED: "every trainer's model built"}


def device_name(index: int | None) -> str:
    return "cpu" if index is None else f"cuda:{index}"


def ready_words(strategy: Strategy, num_servers: int) -> str:
    """What a job had done when it was ready: what ``ready after N s`` names."""
    return ", ".join(["every rank started", *(["servers created"] if num_servers else []),
                      BUILT[strategy.wrap]])


def describe_buckets(buckets: list[dict], shards: bool = False) -> str:
    if not buckets and not shards:
        return "DDP buckets: none (the strategy does not wrap the model in DDP)"
    sizes = ", ".join(format_bytes(b["bytes"]) +
                      (" sparse, this iteration's" if b["sparse"] else "") for b in buckets)
    if shards:
        return f"parameter shards, one per server: {len(buckets)} ({sizes})"
    return f"DDP buckets, as DDP built them: {len(buckets)} ({sizes})"


def describe_workload(model: Entry, data: Entry) -> str:
    size = model.size
    sparse = f" + {format_bytes(size['sparse_gradient_bytes'])} sparse (at dense size)" \
        if size["sparse_gradient_bytes"] else ""
    return (f"model {model.id}: {size['parameters']:,} parameters, gradients "
            f"{format_bytes(size['dense_gradient_bytes'])} dense{sparse}; data {data.id}")


def short_warmup_warning(warmup_rounds: int, per_round: int) -> str | None:
    """A line for a run whose warmup leaves the first iterations among the timed ones: they set
    up what the rest reuse (DDP rebuilds its buckets in the second, in the order the gradients
    came; optimizer state and what each hook keeps are made as first needed)."""
    warm = warmup_rounds * per_round
    if per_round == 0 or warm >= SETTLING_ITERATIONS:
        return None
    left = "iteration 2" if warm == 1 else "iterations 1 and 2"
    need = -(-SETTLING_ITERATIONS // per_round)
    return (f"ps_bench: warning: --warmup-rounds {warmup_rounds} of {per_round} iteration"
            f"{'s' if per_round != 1 else ''} each leaves {left} among the timed ones, where "
            f"DDP rebuilds its buckets and the optimizer and hooks make what they keep; "
            f"--warmup-rounds {need} times only what follows")


def compare_replicas(trainers: list, checked_at: str) -> dict:
    """The replica check: every trainer's fingerprint first, all at once; the parameters
    themselves only when those differ (or are not finite), for how far apart they are."""
    prints = [f.wait() for f in [t.rpc_async().parameters_fingerprint() for t in trainers]]
    alike = replicas_alike(prints, checked_at)
    if alike is not None:
        return alike
    return replica_summary(
        [f.wait() for f in [t.rpc_async().parameters_vector() for t in trainers]], checked_at)


class Master:
    """Runs one job from the master rank, the nccl-tests loop over RPC: create the servers, then
    the trainers (each builds its DDP replica), warmup rounds, timed rounds (each trainer runs
    its iterations; each server hands over its samples and is reset), floors after each timed
    round with ``--limits``, the replicas compared, the report printed and the results written.

    Every number goes into a ``RunRecord``; after each timed round a snapshot of it goes to the
    run folder, so that the launcher keeps the finished rounds if the job fails later, and a
    stopped job writes the rounds a paced-out snapshot had not kept
    (``ps_bench.processes.kept``)."""

    def __init__(self, job: Job, topology: Topology, device_of: Callable[[int], int | None],
                 argv: list[str], run_dir: str, results_path: str, launched_at: float | None = None,
                 hosts: list[dict] | None = None, recovered: list[dict] | None = None,
                 startup: Callable[[], dict] | None = None, emulated: dict | None = None,
                 on_stop: Callable[[str], None] | None = None,
                 attempts: Attempts | None = None) -> None:
        config = job.config
        self.job, self.config, self.topology = job, config, topology
        self.model, self.data = job.model, job.data
        self.servers_own_parameters = job.strategy.wrap == SERVER_OWNED  # --staleness
        self.device_of = device_of
        self.results_path = results_path
        self.fault = faults_of(config.inject_fault)
        self.launched_at = time.time() if launched_at is None else launched_at
        self.iterations_per_round = 0  # known once the trainers are built
        self.record = RunRecord(job, topology, argv,
                                {**environment(config.backend), "hosts": hosts or [],
                                 "rpc": rpc_paths(hosts or [], config.rpc_transport),
                                 **({"emulated": emulated} if emulated else {})},
                                recovered)
        # --limits: one RpcFloorTarget per server, for the float32 buckets (and the strategy's own
        # messages)
        self.floor_targets: list[list[rpc.RRef]] = []
        # () -> {"launcher": milestones, "ranks": [milestones]}, once every rank is up
        self.startup = startup
        self.kept = Keeper(self.record, run_dir, on_stop,
                           on_written=attempts.keep if attempts is not None else None)
        self.books = RecoveryBooks(attempts, job.checkpoints, self.record.recovered,
                                   config.num_trainers * config.batch_size * config.grad_accum,
                                   config.num_trainers, schedule_of(config))
        # --trainer-timeout: the rounds wait for the living trainers only
        store = attempts.store if attempts is not None else None  # failure records, if any
        self.elastic = (Elastic(topology, store, job.strategy.recovery)
                        if job.goes_on()["trainer"] else None)
        self.healing = Healing(job, store)
        self.books.drops = self.elastic.drops if self.elastic is not None else []
        self.books.failing = bool(config.mtbf or config.trainer_timeout or config.server_replicas
                                  or job.recovers_by_itself)  # its books in every run, then
        self.servers_lost = ServersLost(topology, store) if config.server_replicas else None
        self.books.servers_lost = self.servers_lost.entries if self.servers_lost else []

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
                **({} if cfg.trainer_timeout is None else dict(
                    trainer_timeout=cfg.trainer_timeout,
                    members=([info.name for info in topo.trainers],
                             [info.name for info in topo.servers] + [topo.info(-1).name]))),
                **({"replicas": cfg.server_replicas} if cfg.server_replicas else {}),
            ))
            for info in topo.servers
        ]
        for server in servers:
            server.rpc_sync().set_peers(servers)
        return servers

    def rank_hosts(self) -> list[int] | None:
        """The index in ``env.hosts`` of every rank's host (None: not known)."""
        hosts = self.record.environment["hosts"]
        owner = {rank: index for index, host in enumerate(hosts) for rank in host["ranks"]}
        if len(owner) != self.topology.world_size:
            return None
        return [owner[rank] for rank in range(self.topology.world_size)]

    def create_trainers(self, servers: list[rpc.RRef]) -> list[rpc.RRef]:
        cfg, topo = self.config, self.topology
        dataset = build_data(self.data.class_name, self.data.kwargs, cfg.torch_seed, cfg.labels)
        held_out = None
        if cfg.target_loss is not None:
            held_out = build_held_out(self.data.class_name, self.data.kwargs, cfg.torch_seed,
                                      min(HELD_OUT_SAMPLES, len(dataset)))
        handles = [(rref, info.cuda_rpc) for rref, info in zip(servers, topo.servers)]
        trainer_class = TRAINERS.get(cfg.trainer)
        rank_hosts, beside = self.rank_hosts(), self.healing.start()
        trainers = []
        for info in topo.trainers:
            shard = dataset.shard(info.index, topo.num_trainers)
            group_server = (topo.group_of(info.index) if topo.mapping == "group" and servers
                            else None)
            trainers.append(rpc.remote(info.name, trainer_class, args=(
                info.index, cfg, self.job.strategy, self.model, shard.inputs, shard.targets,
                handles, group_server, info.cuda_rpc, device_name(self.device_of(info.rank)),
                held_out if info.index == 0 else None, rank_hosts, self.job.engine_config,
                self.job.checkpoints), kwargs={"beside": beside} if beside else {}))
        # every replica is built
        iterations = [trainer.rpc_sync(timeout=0).ready() for trainer in trainers]
        self.iterations_per_round = min(iterations)
        if self.servers_own_parameters:  # a round is a budget of everyone's updates
            for server in servers:
                server.rpc_sync().own(self.model, cfg.torch_seed, cfg.lr,
                                      parse_staleness(cfg.staleness), sum(iterations))
        return trainers

    # -- the rounds --------------------------------------------------------------------------
    def run(self) -> dict:
        cfg, record = self.config, self.record
        self.kept.watch()
        # what was asked, should the job end before its first round; not a measure of what a
        # snapshot of finished rounds costs
        self.kept.write()
        hosts = record.environment["hosts"]
        cpu_trainers = {info.rank for info in self.topology.trainers
                        if self.device_of(info.rank) is None}
        for warning in (one_machine_warning(hosts, cfg.rpc_transport)
                        if self.topology.servers else None,
                        crowded_warning(hosts, cpu_trainers)):
            if warning:
                print(warning, file=sys.stderr, flush=True)
        servers = self.create_servers()
        servers_at = time.time()
        trainers = self.create_trainers(servers)
        ready_at = time.time()
        record.environment["clocks"] = tracing.measure_clocks(self.topology)
        warning = (short_warmup_warning(cfg.warmup_rounds, self.iterations_per_round)
                   if cfg.target_loss is None else None)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        total = cfg.warmup_rounds + cfg.rounds
        follow = (f"training until the averaged model's smoothed loss is at most {cfg.target_loss} "
                  f"or {plural(record.progress.max_iterations, 'iteration')} "
                  f"{'is' if record.progress.max_iterations == 1 else 'are'} done"
                  if cfg.target_loss is not None
                  else f"{cfg.warmup_rounds} warmup and {plural(cfg.rounds, 'timed round')} follow")
        print(f"ps_bench: ready after {ready_at - self.launched_at:.1f} s "
              f"({ready_words(self.job.strategy, cfg.num_servers)}); {follow}", flush=True)
        if self.startup is not None:
            times = self.startup()
            record.environment["startup_s"] = startup_phases(times["launcher"], times["ranks"],
                                                             servers_at, ready_at)
            if cfg.verbose:
                print(render_startup(record.environment["startup_s"]), flush=True)
        print(describe_workload(self.model, self.data), flush=True)
        run_start = time.perf_counter()
        converging = cfg.target_loss is not None
        round_index, start_step = self.books.resume_point(self.iterations_per_round)
        self.books.begin(ready_at)
        if self.books.wanted:  # the failed run's file says where it resumed and saves to
            self.note_recovery()
            self.kept.write()
        # a --target-loss run goes on until its trainers stop
        while converging or round_index < total:
            maybe_inject(self.fault, "master", 0, round_index + 1)
            profiled = tracing.traced(cfg, round_index, total, servers)
            start = time.perf_counter()
            living = self.living(trainers)
            futures = {info.index: t.rpc_async(timeout=0).run_round(
                           verify=round_index >= cfg.warmup_rounds and cfg.verify,
                           profile_path=tracing.path(cfg, info) if profiled else None,
                           start_step=start_step)
                       for t, info in zip(trainers, self.topology.trainers) if t in living}
            start_step = 0
            of = "" if converging else f"/{total}"
            name = f"[round {round_index + 1}{of}]"
            label = f"{name} {'timed' if round_index >= cfg.warmup_rounds else 'warmup':6}"
            if self.elastic is None:
                rounds = wait_round(list(futures.values()), trainers, label)
            else:  # the dropped trainers' places are None
                by_index = self.elastic.wait(
                    futures, lambda s: print(f"{label} {round_progress(living, s)}", flush=True),
                    PROGRESS_FIRST_S, PROGRESS_EVERY_S)
                rounds = [by_index.get(index) for index in range(len(trainers))]
            elapsed = time.perf_counter() - start
            if profiled:
                tracing.round_done(cfg, servers, self.topology)
            present = [result for result in rounds if result is not None]
            if not present:
                raise RuntimeError("every trainer was dropped (--trainer-timeout): none is left "
                                   "to train")
            self.books.add(present, elapsed)
            record.dropped = {drop["rank"] for drop in self.books.drops}
            self.note_recovery()
            served = self.take_served(servers)
            # DDP rebuilds its buckets in the first iteration
            if record.buckets is None and present[0]["iterations"]:
                record.buckets = self.living(trainers)[0].rpc_sync().bucket_layout()
                print(describe_buckets(record.buckets, shards=self.servers_own_parameters),
                      flush=True)
            with self.kept.adding():
                stopped = converging and record.progress.add(present)
                # the round training stopped in is kept even within warmup, so that every run
                # has one
                timed = ((round_index >= cfg.warmup_rounds or stopped)
                         and present[0]["iterations"] > 0)
                if timed:  # kept before it is announced
                    loss = record.add_round(elapsed, rounds, served)
                    self.kept.snapshot()
                else:
                    loss = mean_loss(present)
            print(f"{name} {'timed' if timed else 'warmup':6} "
                  f"{elapsed:7.2f} s  (elapsed {time.perf_counter() - run_start:6.1f} s)  "
                  f"loss {loss:.4f}{record.progress.line() if converging else ''}", flush=True)
            if timed and cfg.limits:
                self.measure_floors(trainers)
            if stopped:
                break
            round_index += 1
        if self.job.strategy.identical == SERVERS_MODEL:
            record.replicas = servers_model_summary(
                [s.rpc_sync().parameters_vector() for s in servers])
        else:
            record.replicas = compare_replicas(self.living(trainers),
                                               self.job.strategy.identical)
        if self.healing.heals:
            self.books.healed = self.healing.report(self.living(trainers)[0], self.elastic)
        # together: a close may be collective
        for closed in [t.rpc_async(timeout=0).close() for t in self.living(trainers)]:
            closed.wait()
        self.healing.close()
        if cfg.limits:
            record.memcpy = limits.memcpy_floor(messages.message_bytes(record.floor_messages))
        self.kept.release()
        self.note_recovery()
        results = record.results("ok")
        print_report(results, record.rows(split_ranks=cfg.per_rank))
        # a disk that filled during the run must not lose it: elsewhere, said on stderr
        path = keep_results(results, self.results_path)
        if path is None:
            raise OSError("the results could be written neither to --out nor to the system's "
                          "temporary folder (see the warnings above)")
        print(f"results: {path}", flush=True)
        tracing.report(cfg, self.topology, record.environment["clocks"])  # each rank's file
        return results

    def take_served(self, servers: list[rpc.RRef]) -> list[dict | None]:
        """Each server's books of the round, reset for the next (None: a server lost, its replica
        answering for it)."""
        if self.servers_lost is not None:
            return self.servers_lost.take(servers)
        served = [server.rpc_sync().take_metrics() for server in servers]
        for server in servers:
            server.rpc_sync().reset_state()
        return served

    def living(self, trainers: list[rpc.RRef]) -> list[rpc.RRef]:
        """The trainers not dropped (every one without --trainer-timeout)."""
        if self.elastic is None:
            return trainers
        return [trainers[index] for index in self.elastic.living()]

    def note_recovery(self) -> None:
        """The record's checkpoints, failures and goodput so far (``RecoveryBooks``), from when
        this attempt's first rank started (its start-up milestones)."""
        restarted_at = (None if self.startup is None else
                        min(ranks["started"] for ranks in self.startup()["ranks"]))
        self.record.recovery = self.books.block(self.launched_at, restarted_at, time.time(),
                                                self.record.samples_per_s)

    def measure_floors(self, trainers: list[rpc.RRef]) -> None:
        """``--limits``: a share of every floor's repetitions, after each timed round, so floors and
        strategy are sampled under the same conditions of the machine (see
        ``ps_bench.metrics.limits``). The buckets are trainer 0's of the first timed round's last
        iteration, the same for every trainer and every round."""
        record, cfg = self.record, self.config
        on_device = self.topology.rpc_on_gpu
        options = hook_options(cfg.hook, cfg.hook_options)
        if record.floor_messages is None:
            # DDP's buckets; without them (FSDP2, an engine, torchft), the model's gradients as one
            buckets = trainers[0].rpc_sync().bucket_layout() or [
                {"index": 0, "bytes": self.model.size["dense_gradient_bytes"], "sparse": False,
                 "shapes": []}]
            record.floor_messages = messages.floor_messages(HOOKS.record("allreduce"), buckets, {})
            own = messages.floor_messages(self.job.strategy, buckets, options,
                                          slices=self.job.strategy.rpc_slices(cfg.per_host),
                                          on_device=on_device,
                                          servers=self.topology.num_servers)
            record.own_messages = own if own != record.floor_messages else None
            record.floor_gathered = [bucket["index"] for bucket in buckets if bucket["sparse"]]
            self.floor_targets = [[rpc.remote(info.name, limits.RpcFloorTarget, args=(
                                       sent, device_name(self.device_of(info.rank))
                                       if on_device else "cpu"))
                                   for info in self.topology.servers]
                                  for sent in (record.floor_messages, record.own_messages)
                                  if sent and self.topology.servers]
        repeat = limits.repeats_per_round(cfg.rounds)
        piece = messages.piece_elements(options, self.topology.num_servers, on_device)
        futures = [t.rpc_async(timeout=0).measure_floors(record.floor_messages, record.own_messages,
                                                         self.floor_targets, repeat, piece,
                                                         on_device, tuple(record.floor_gathered))
                   for t in trainers]
        record.add_floors([f.wait() for f in futures])
