"""A job checked as a whole before any process starts.

``validate`` holds a ``RunConfig`` against the registered pieces (each strategy's record,
the servers, trainers, models and data) and against the GPUs of the node, and returns the
``Job``: the configuration with the strategy record it resolved to and the model and data
entries it names, which travel together to every rank. Every problem is a ``ConfigError``: one
line that names the input and what to change.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass

import torch

from ps_bench.config import ConfigError, RunConfig, flag, need
from ps_bench.metrics.messages import PRECISIONS
from ps_bench.models import DATA, DATA_PRESETS, MODELS, RANDOM, TEACHER, default_data, model_entry
from ps_bench.models.base import SyntheticData
from ps_bench.models.huggingface import is_hf
from ps_bench.models.entries import Entry, construct, load_entry, model_size
from ps_bench.options import plural
from ps_bench.places import check_interface, check_port, check_writable_folder
from ps_bench.registry import UnknownNameError
from ps_bench.runtime import checkpoints, membership, network
from ps_bench.runtime.faults import CUT, Straggler, drawn_of, parse_faults
from ps_bench.runtime.topology import Topology
from ps_bench.servers import SERVERS, replicas
from ps_bench.strategies import (HOOKS, SPARSE_ALLREDUCE, SPARSE_GLOO, Strategy, check_hook_options,
                                 stale)
from ps_bench.strategies.record import BY_ITSELF, ENGINE, ENGINES, FSDP, RECOVERIES, SHARDED
from ps_bench.trainers.trainer import TRAINERS

DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}  # torch's own defaults


@dataclass(frozen=True)
class Job:
    """A validated run: its configuration (names canonical, defaults chosen), the record of the
    strategy it trains with (``--hook``'s, or the stale-synchronous one under ``--staleness``),
    and the model and data entries it names."""

    config: RunConfig
    strategy: Strategy
    model: Entry
    data: Entry
    engine_config: dict | None = None  # an engine's own config (DeepSpeed's), resolved from the run
    notes: tuple[str, ...] = ()  # what the user should hear before it starts (a line each)
    checkpoints: checkpoints.Plan | None = None  # --checkpoint-every: where, and where it resumes

    def topology(self) -> Topology:
        """The job's ranks and roles; with node-aggregated parameter servers, a server hears once
        from each host."""
        cfg, strategy = self.config, self.strategy
        return Topology(cfg.ntrainer, cfg.ncudatrainer, cfg.nserver, cfg.ncudaserver, cfg.mapping,
                        cuda_collectives=cfg.backend != "gloo",
                        pushing_hosts=(cfg.per_host if strategy.per_host and strategy.needs_servers
                                       else None))

    @property
    def recovers_by_itself(self) -> bool:  # no option turns its recovery on (BY_ITSELF)
        return self.strategy.recovery in BY_ITSELF

    def goes_on(self) -> dict[str, bool]:
        """The roles this job goes on without (``membership.goes_on``)."""
        return membership.goes_on(self.config, self.recovers_by_itself)


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_servers(cfg: RunConfig) -> None:
    """``--nserver`` left out: 1 where the strategy sends gradients to parameter servers and no
    ``--ncudaserver`` is given, else 0, so that no server idles beside a strategy that sends it
    nothing (the hook by its registered or upstream's name; an unknown one is an error here)."""
    if cfg.nserver is not None:
        return
    try:
        record = HOOKS.record(HOOKS.canonical(cfg.hook))
    except UnknownNameError as error:
        raise ConfigError(f"--hook: {error}") from None
    cfg.nserver = int(record.needs_servers and not cfg.ncudaserver)


def check_options(cfg: RunConfig, machine: bool = True) -> None:
    """Each option on its own: ranges, formats, ports, folders, and (``machine``) the interface
    on this machine; ``--nserver`` left out is set first (``default_servers``)."""
    default_servers(cfg)
    for name in ("ntrainer", "ncudatrainer", "nserver", "ncudaserver", "warmup_rounds"):
        need(getattr(cfg, name) >= 0, f"{flag(name)} must be 0 or more; got {getattr(cfg, name)}")
    for name in ("epochs", "batch_size", "grad_accum", "rounds", "rpc_threads"):
        value = getattr(cfg, name)
        need(value is None or value >= 1, f"{flag(name)} must be at least 1; got {value}")
    for name in ("lr", "rpc_timeout", "bucket_cap_mb", "timeout", "peak_tflops"):
        value = getattr(cfg, name)
        need(value is None or 0 < value < math.inf,
             f"{flag(name)} must be positive{' and finite' if value == math.inf else ''}; "
             f"got {value}")
    try:
        faults = parse_faults(cfg.inject_fault)
    except ValueError as error:
        raise ConfigError(f"--inject-fault: {error}") from None
    for fault in faults:
        count = {"trainer": cfg.num_trainers, "server": cfg.num_servers, "master": 1}[fault.role]
        need(fault.index < count, f"--inject-fault: there is no {fault.role} {fault.index}; "
                                  f"this run has {plural(count, fault.role)}, numbered from 0")
        need(fault.kind != CUT or cfg.emulate_link is not None, "--inject-fault: a link cut is of "
             "an emulated host's link: give --emulate-link (or run bench.py emulate)")
    drawn_of(cfg)
    for text in cfg.straggler:
        try:
            straggler = Straggler.parse(text)
        except ValueError as error:
            raise ConfigError(f"--straggler {text}: {error}") from None
        need(straggler.index is None or straggler.index < cfg.num_trainers,
             f"--straggler {text}: there is no trainer {straggler.index}; "
             f"this run has {plural(cfg.num_trainers, 'trainer')}, numbered from 0")
    for name, folder in (("profile", cfg.profile), ("trace", cfg.trace)):  # --trace: and more
        if folder is not None:
            need(folder.strip(), f"--{name}: give the folder for the traces, e.g. traces/")
            check_writable_folder(folder, f"--{name}")
    cfg.profile = cfg.profile or cfg.trace
    need(cfg.num_trainers >= 1,
         "at least one trainer is needed: set --ntrainer or --ncudatrainer to 1 or more")
    if cfg.master_port is not None:
        check_port("--master-port", cfg.master_port)
    if cfg.iface is not None and machine:
        check_interface(cfg.iface)
    for name in ("backend", "mapping", "rpc_transport", "labels", "optimizer", "precision",
                 "reduce_dtype"):
        allowed, value = (RunConfig.__dataclass_fields__[name].metadata["choices"],
                          getattr(cfg, name))
        # None: chosen by check_labels, or the engine's own reduce dtype
        need(value in allowed or (value is None and name in ("labels", "reduce_dtype")),
             f"--{name} must be one of {', '.join(allowed)}; got {value!r}")
    if cfg.target_loss is not None:
        need(math.isfinite(cfg.target_loss) and cfg.target_loss > 0,
             f"--target-loss must be a positive number; got {cfg.target_loss}")
    if cfg.max_iterations is not None:
        need(cfg.target_loss is not None, "--max-iterations bounds a --target-loss run; without a "
             "target, the run length is --rounds x --epochs passes over each trainer's shard")
        need(cfg.max_iterations >= 1,
             f"--max-iterations must be at least 1; got {cfg.max_iterations}")


def check_optimizer(cfg: RunConfig) -> None:
    """--optimizer and its options; the weight decay defaults to torch's for the optimizer."""
    # at 1 or more the velocity never decays: every past gradient is applied again for ever
    need(0 <= cfg.momentum < 1, f"--momentum must be in [0, 1); got {cfg.momentum}")
    need(cfg.momentum == 0 or cfg.optimizer == "sgd",
         f"--momentum is SGD's; --optimizer {cfg.optimizer} has its own "
         f"(leave --momentum out)")
    if cfg.weight_decay is None:
        cfg.weight_decay = DEFAULT_WEIGHT_DECAY.get(cfg.optimizer, 0.0)
    need(0 <= cfg.weight_decay < math.inf,
         f"--weight-decay must be 0 or more, finite; got {cfg.weight_decay}")


def check_labels(cfg: RunConfig, dataset: SyntheticData) -> None:
    """Teacher labels by default with a target loss, random otherwise; a target needs a teacher."""
    if cfg.labels is None:
        cfg.labels = TEACHER if cfg.target_loss is not None else RANDOM
    if cfg.labels == TEACHER and dataset.teacher is None:
        learnable = ", ".join(name for name in DATA if DATA.get(name).teacher is not None)
        reason = ("--target-loss needs learnable data" if cfg.target_loss is not None
                  else "--labels teacher")
        raise ConfigError(f"{reason}, but --data {cfg.data} ({type(dataset).__name__}) has no "
                          f"teacher to label it; data classes with one: {learnable}")
    need(cfg.target_loss is None or cfg.labels == TEACHER,
         f"--target-loss {cfg.target_loss} with --labels random: random labels cannot be learned; "
         f"use --labels teacher (the default with a target)")


def check_pieces(cfg: RunConfig) -> Strategy:
    """Strategy, server and trainer by their registered names (upstream's become ours), the
    hook's options, and what the strategy's record needs of the topology; returns the record of
    the strategy the run trains with."""
    for name, registry in (("hook", HOOKS), ("server", SERVERS), ("trainer", TRAINERS)):
        try:
            setattr(cfg, name, registry.canonical(getattr(cfg, name)))
        except UnknownNameError as error:
            raise ConfigError(f"--{name}: {error}") from None
    try:
        cfg.hook_options = check_hook_options(cfg.hook, cfg.hook_options)
    except ValueError as error:
        raise ConfigError(f"--hook {cfg.hook}: {error}") from None
    record = stale.resolve(cfg, HOOKS.record(cfg.hook))
    if record.needs_servers:
        need(cfg.num_servers >= 1,
             f"--hook {cfg.hook} sends gradients to parameter servers: set --nserver 1 or more")
    if not record.takes_servers:
        need(cfg.num_servers == 0, f"--hook {cfg.hook} ({record.family} family) trains without "
                                   f"parameter servers: leave --nserver out (got --nserver "
                                   f"{cfg.nserver}, --ncudaserver {cfg.ncudaserver})")
        unsupported = (["--gradient-as-bucket-view"]
                       if cfg.gradient_as_bucket_view and record.wrap in (FSDP, ENGINE) else [])
        need(not unsupported, f"--hook {cfg.hook} cannot be combined with {', '.join(unsupported)} "
                              f"yet (its floors and gradient captures are those of a DDP hook)")
    if cfg.per_host is not None:
        need(cfg.per_host >= 1, f"--per-host must be at least 1; got {cfg.per_host}")
        need(cfg.num_trainers % cfg.per_host == 0, f"--per-host {cfg.per_host} does not divide the "
                                                   f"{cfg.num_trainers} trainers into whole hosts")
    if cfg.servers_on == "colocated":
        hosts = cfg.num_trainers // (cfg.per_host or 1)
        need(cfg.emulate_link is not None, "--servers-on colocated places servers on the trainers' "
                                           "hosts of an emulated network: set --emulate-link "
                                           "(bench.py emulate); on real hosts the launcher places "
                                           "every rank")
        need(cfg.num_servers >= hosts and cfg.num_servers % hosts == 0,
             f"--servers-on colocated puts as many servers on each trainer host: this job has "
             f"{plural(hosts, 'trainer host')}, so --nserver {hosts} or a multiple of it; got "
             f"{cfg.num_servers}")
    if record.per_host:
        hosts = cfg.num_trainers // cfg.per_host if cfg.per_host else 1
        need(hosts >= 2, f"--hook {cfg.hook} synchronises within each host, then across hosts: it "
                         f"needs 2 hosts or more (--per-host G with G a divisor of the trainers "
                         f"below their number; got {plural(cfg.num_trainers, 'trainer')} on "
                         f"{hosts} host)")
        need(not (record.needs_servers and cfg.mapping == "group" and cfg.num_servers > hosts),
             f"--hook {cfg.hook} --mapping group gives each server a group of hosts: "
             f"{cfg.num_servers} servers need {cfg.num_servers} hosts; got {hosts}")
    if cfg.mapping == "group" and cfg.num_servers:
        need(
            cfg.num_servers <= cfg.num_trainers,
            f"--mapping group needs at least as many trainers as servers: {cfg.num_servers} "
            f"servers need {cfg.num_servers} trainers; got {cfg.num_trainers}",
        )
    return record


def check_workload(cfg: RunConfig) -> tuple[Entry, Entry, torch.nn.Module]:
    """The model and data entries, built on the meta device: they fit each other and the batch."""
    model = model_entry(cfg.model, cfg.model_options, cfg.model_config_path)
    defaulted = cfg.data is None
    if defaulted:
        cfg.data = default_data(model)
    data = load_entry(cfg.data_config_path, cfg.data, "data_class", DATA, "data", DATA_PRESETS)
    network = construct(model, MODELS)
    if defaulted:  # the model's own data: fitted to it (a Hugging Face model's vocabulary)
        data = dataclasses.replace(data, kwargs=network.fitted_data(data.kwargs))
    dataset = construct(data, DATA)
    model = dataclasses.replace(model, size=model_size(network))
    need(network.takes == dataset.gives,
         f"--model {cfg.model} takes {network.takes} but --data {cfg.data} gives {dataset.gives}; "
         f"leave --data out to use the model's own data")
    mismatch = network.fits(dataset)
    need(mismatch is None, f"--data {cfg.data} {mismatch} (--model {cfg.model})")
    check_labels(cfg, dataset)
    samples, step = dataset.sample_count, cfg.batch_size * cfg.grad_accum
    accumulated = f" x --grad-accum {cfg.grad_accum}" if cfg.grad_accum > 1 else ""
    need(
        samples // cfg.num_trainers >= step,
        f"--data {cfg.data} has {plural(samples, 'sample')}: {plural(cfg.num_trainers, 'trainer')} "
        f"get{'s' * (cfg.num_trainers == 1)} "
        f"{samples // cfg.num_trainers} each, fewer than --batch-size {cfg.batch_size}"
        f"{accumulated}; lower --batch-size or use more samples",
    )
    smallest = getattr(network, "min_batch_size", 1)
    need(cfg.batch_size >= smallest, f"--model {cfg.model} needs --batch-size {smallest} or more "
                                     f"(BatchNorm); got {cfg.batch_size}")
    return model, data, network


def check_devices(cfg: RunConfig, record: Strategy, network: torch.nn.Module, gpus: int,
                  trainers_on_node: int) -> None:
    """CUDA where the options ask for it, one GPU per NCCL trainer, no sparse all-reduce on NCCL."""
    wants_cuda = [
        f"--backend {cfg.backend}" if cfg.backend != "gloo" else "",
        f"--ncudatrainer {cfg.ncudatrainer}" if cfg.ncudatrainer else "",
        f"--ncudaserver {cfg.ncudaserver}" if cfg.ncudaserver else "",
    ]
    wants_cuda = [w for w in wants_cuda if w]
    if wants_cuda and gpus == 0:
        raise ConfigError(f"CUDA is needed for {' and '.join(wants_cuda)}, but no GPU is available "
                          f"here (torch.cuda.is_available() is False); use --backend gloo with CPU "
                          f"trainers and servers")
    sparse = any(getattr(m, "sparse", False) for m in network.modules())
    need(not (sparse and record.per_host and record.needs_servers),
         f"--model {cfg.model} has sparse gradients, which --hook {cfg.hook} cannot sum within a "
         f"host (each trainer's rows differ): use --hook ps")
    need(not (record.for_sparse and is_hf(cfg.model)),
         f"--hook {cfg.hook} is made for sparse embedding gradients, and --model {cfg.model} has "
         f"none (a Hugging Face model's embeddings are dense): on it, it is "
         f"--hook {record.for_sparse}")
    need(not (sparse and record.family == SHARDED),
         f"--model {cfg.model} has sparse gradients, which --hook {cfg.hook} cannot shard; use a "
         f"dense model, or --hook allreduce, ps or sparse_ps")
    if cfg.backend not in ("nccl", "multi"):
        return
    need(
        trainers_on_node <= gpus,
        f"--backend {cfg.backend} needs one GPU per trainer: "
        f"{plural(trainers_on_node, 'trainer')} on this node, {plural(gpus, 'GPU')}; lower "
        f"--ntrainer/--ncudatrainer or use --backend gloo",
    )
    if not any(getattr(m, "sparse", False) for m in network.modules()):
        return
    sparse_buckets = record.sparse_buckets
    if sparse_buckets == SPARSE_ALLREDUCE:
        raise ConfigError(f"--model {cfg.model} has sparse gradients, which NCCL cannot all-reduce "
                          f"(--hook {cfg.hook}, --backend {cfg.backend}); use --hook hybrid with "
                          f"--backend multi, --hook sparse_ps or ps, or --backend gloo")
    if sparse_buckets == SPARSE_GLOO and cfg.backend == "nccl":
        raise ConfigError(f"--hook {cfg.hook} all-reduces sparse gradients over gloo: "
                          f"use --backend multi")


def check_network(cfg: RunConfig, machine: bool = True) -> None:
    """An emulated network: its options and (``machine``) this machine; its RPC always goes over
    TCP."""
    if cfg.emulate_link is None:
        given = [flag(name) for name in ("emulate_hosts", "emulate_delay")
                 if getattr(cfg, name) is not None]
        given += ["--emulate-keep"] if cfg.emulate_keep else []
        need(not given, f"{', '.join(given)} shape{'s' * (len(given) == 1)} an emulated network: "
                        f"set --emulate-link too")
        return
    network.check(cfg, machine)
    cfg.rpc_transport = "tcp"


def validate(cfg: RunConfig, gpus: int | None = None, trainers_on_node: int | None = None,
             machine: bool = True) -> Job:
    """Checks a whole configuration before any process starts (canonicalising the names it
    holds); returns the job it describes. ``gpus`` defaults to the CUDA devices visible here,
    ``trainers_on_node`` to every trainer (one machine); ``machine=False`` leaves out what only
    this machine decides (root and tc for an emulated network, the interface --iface names)."""
    gpus = cuda_device_count() if gpus is None else gpus
    check_options(cfg, machine)
    record = check_pieces(cfg)
    # may set the batch and optimizer from the engine's
    engine_config, notes = check_engine(cfg, record, gpus)
    record = engine_record(record, cfg, engine_config)
    record = check_training(cfg, record)
    check_optimizer(cfg)
    check_network(cfg, machine)
    model, data, network = check_workload(cfg)
    if hasattr(HOOKS.get(cfg.hook), "check_network"):  # an engine's config against the model
        HOOKS.get(cfg.hook).check_network(cfg, engine_config, network, gpus)
    check_devices(cfg, record, network, gpus,
                  cfg.num_trainers if trainers_on_node is None else trainers_on_node)
    if cfg.num_servers and not record.needs_servers:
        one = cfg.num_servers == 1
        notes.append(f"--hook {cfg.hook} sends no gradient to parameter servers: the "
                     f"{cfg.num_servers} server{'' if one else 's'} asked for (--nserver "
                     f"{cfg.nserver}, --ncudaserver {cfg.ncudaserver}) "
                     f"{'idles' if one else 'idle'}; leave both out to start none")
    membership.check(cfg, record.elastic, cfg.hook)
    membership.check_going_on(cfg, record.recovery in BY_ITSELF, cfg.hook)
    replicas.check(cfg, record.replicated, cfg.hook)
    plan = checkpoints.plan(cfg, RECOVERIES[record.recovery])
    return Job(cfg, record, model, data, engine_config, tuple(notes), plan)


def check_engine(cfg: RunConfig, record: Strategy, gpus: int) -> tuple[dict | None, list[str]]:
    """A strategy run by an engine of its own: the package is there, and its config resolved
    (``configure`` of the strategy), with notes for the user; ``--ds-config`` only where
    DeepSpeed runs."""
    need(cfg.ds_config is None or record.engine == "deepspeed",
         f"--ds-config configures DeepSpeed: it goes with --hook deepspeed_zero1, 2 or 3 "
         f"(got --hook {cfg.hook})")
    if record.engine is None:
        return None, []
    need(importlib.util.find_spec(record.engine) is not None,
         f"--hook {cfg.hook} runs on {record.engine}, which is not installed: "
         f"{ENGINES[record.engine]}")
    factory = HOOKS.get(cfg.hook)
    return factory.configure(cfg, gpus) if hasattr(factory, "configure") else (None, [])


def check_training(cfg: RunConfig, record: Strategy) -> Strategy:
    """--precision and --reduce-dtype against the devices and the strategy; returns the record
    as it sends (FSDP2's gradients and gathers in --reduce-dtype)."""
    need(not cfg.compile or record.not_compiled is None, f"--compile: --hook {cfg.hook} is not "
         f"compiled here: {record.not_compiled}; run it without --compile")
    on_cpu = cfg.ntrainer > 0 and cfg.backend not in ("nccl", "multi")
    need(cfg.precision != "fp16" or not on_cpu,
         f"--precision fp16 needs the trainers on GPUs (fp16 autocast with a gradient scaler); "
         f"{plural(cfg.ntrainer, 'trainer')} compute{'s' * (cfg.ntrainer == 1)} on the CPU here: "
         f"use --precision bf16")
    if cfg.reduce_dtype is None:
        return record
    need(record.reduce_dtype,
         f"--reduce-dtype is for strategies whose engine communicates in a dtype of its own "
         f"(fsdp, hsdp, deepspeed_zero1-3); --hook {cfg.hook} sends the gradients as they are "
         f"(its fp16 and bf16 forms are hooks of their own): leave --reduce-dtype out")
    if record.engine == "deepspeed":  # its communication_data_type: configured_record's
        return record
    return dataclasses.replace(record, payload=PRECISIONS[cfg.reduce_dtype])


def engine_record(record: Strategy, cfg: RunConfig, engine_config: dict | None) -> Strategy:
    """The strategy's record as its engine's resolved config trains (DeepSpeed's bf16: bytes)."""
    factory = HOOKS.get(cfg.hook)
    return (factory.configured_record(record, engine_config)
            if hasattr(factory, "configured_record") else record)
