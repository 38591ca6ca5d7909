"""Run options as one typed dataclass; the command line and JSON files only fill it.

Precedence: command line > JSON run file (``--config``) > the defaults below.
``validate`` checks a whole configuration once, before any process starts, and raises
``ConfigError`` with one line that names the input and what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """Bad user input: reported as one line, exit status 2."""


def option(default: Any, help: str, *, aliases: tuple[str, ...] = (), choices: tuple[str, ...] = ()) -> Any:
    metadata = {"help": help, "aliases": aliases, "choices": choices}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class RunConfig:
    """Everything one benchmark run needs; field names are the option names."""

    ntrainer: int = option(2, "trainers whose gradients cross RPC as CPU tensors")
    ncudatrainer: int = option(0, "trainers whose gradients cross RPC as CUDA tensors (device maps)")
    nserver: int = option(1, "parameter servers that aggregate on the CPU")
    ncudaserver: int = option(0, "parameter servers that aggregate on a GPU")
    backend: str = option("gloo", "trainers' collective backend", choices=("gloo", "nccl", "multi"))
    hook: str = option("ps", "DDP communication hook (gradient strategy)", aliases=("ddp_hook",))
    hook_options: dict = option({}, "options of the hook, e.g. PowerSGD's matrix_approximation_rank")
    verify: bool = option(False, "compare what the strategy delivered with the exact mean gradient, "
                                 "on a few iterations per timed round (left out of the timings)")
    server: str = option("average", "parameter-server aggregation algorithm")
    trainer: str = option("ddp", "trainer loop")
    mapping: str = option(
        "shard",
        "trainers to servers: shard = each bucket to one owning server (bytes balanced), every "
        "trainer to every server; group = one server per group of trainers, servers combine partial sums",
        choices=("shard", "group"),
    )
    epochs: int = option(1, "passes over each trainer's data shard per round")
    batch_size: int = option(16, "samples per trainer per iteration")
    lr: float = option(0.01, "SGD learning rate")
    warmup_rounds: int = option(1, "untimed rounds before the timed ones")
    rounds: int = option(5, "timed rounds")
    data: str | None = option(
        None, "entry of the data configuration file, or zoo data (default: the zoo model's own data, "
        "else DummyDataSmall)")
    model: str = option(
        "DummyModelSmall", "entry of the model configuration file, or a zoo model: resnet18, resnet50, gpt2_small, "
        "dlrm, and their test-sized resnet18_small, resnet50_small, gpt2_tiny, dlrm_small")
    data_config_path: str = option("configs/data_configurations.json", "data configuration file")
    model_config_path: str = option("configs/model_configurations.json", "model configuration file")
    bucket_cap_mb: float = option(25.0, "DDP bucket size cap in MiB (more buckets spread over more servers)")
    gradient_as_bucket_view: bool = option(
        False, "DDP's gradient_as_bucket_view: dense gradients are views into DDP's buckets, which saves "
               "their size in memory and the copy of every answer back into them")
    torch_seed: int = option(0, "seed for data, model initialisation and CPU randomness")
    cuda_seed: int = option(0, "seed for CUDA randomness")
    rpc_timeout: float = option(60.0, "seconds before an RPC call fails")
    rpc_threads: int | None = option(
        None, "TensorPipe worker threads per process (default: sized to the role, 4 or more: a server one "
        "per trainer and server plus one, a trainer two plus one per server)")
    master_addr: str = option("127.0.0.1", "address of the rendezvous store (a private interface: RPC trusts its peers)")
    master_port: int | None = option(None, "port of the rendezvous store (default: a free one)")
    iface: str | None = option(
        None, "network interface that connects the nodes, e.g. eth1: exported to every rank as "
        "TP_SOCKET_IFNAME (TensorPipe) and GLOO_SOCKET_IFNAME (gloo); must exist on every node (default: "
        "let them choose)")
    timeout: float | None = option(
        None, "watchdog for the whole job in seconds: on expiry every rank's Python stacks go to the "
        "log and the job ends with status 1 (default: none)")
    inject_fault: str | None = option(
        None, "make one rank fail on purpose: ROLE:INDEX:ITER:KIND[:first] with ROLE trainer|server|master, "
        "INDEX among that role from 0, ITER from 1 (a training iteration; the master's round), "
        "KIND exit|raise|hang; a trailing :first fails only torchrun's first attempt, so "
        "--max-restarts can recover (default: none)")
    limits: bool = option(False, "after the timed rounds, measure the floors with this run's bytes and processes: "
                                 "raw RPC round trips to the servers, raw all-reduce among the trainers, memory-copy "
                                 "bandwidth, a compute-only iteration; adds 'limits' and 'efficiency' (floor p50 / "
                                 "trainer comm p50) to the results")
    profile: str | None = option(None, "write torch.profiler Chrome traces of a few timed iterations of every trainer "
                                       "into this folder, one file per rank (open in ui.perfetto.dev or chrome://tracing)")
    out: str | None = option(None, "results file (default: a new name under results/; never overwritten)")
    per_rank: bool = option(False, "also print one table row per rank")
    dry_run: bool = option(False, "print the rank/role/name/mapping table and exit")
    debug: bool = option(False, "show tracebacks for errors in the input")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def num_trainers(self) -> int:
        return self.ntrainer + self.ncudatrainer

    @property
    def num_servers(self) -> int:
        return self.nserver + self.ncudaserver

    @property
    def world_size(self) -> int:
        return self.num_trainers + self.num_servers + 1


OPTIONS: dict[str, dataclasses.Field] = {f.name: f for f in fields(RunConfig)}
# Keys a JSON run file may hold: option names, dash or underscore spelling, and aliases.
JSON_KEYS: dict[str, str] = {}
for _f in fields(RunConfig):
    for _key in (_f.name, *_f.metadata["aliases"]):
        JSON_KEYS[_key] = _f.name
        JSON_KEYS[_key.replace("_", "-")] = _f.name


def field_type(name: str) -> type:
    """The scalar type of an option (``int | None`` gives ``int``)."""
    annotation = str(OPTIONS[name].type)
    for candidate in (bool, int, float, str, dict):
        if annotation.startswith(candidate.__name__):
            return candidate
    raise TypeError(f"unsupported option type {annotation}")


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Loads a JSON file; a missing file or bad syntax is a ``ConfigError`` naming the place."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from None
    except OSError as error:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {error.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{what} {str(path)!r} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None


def coerce(name: str, value: Any, source: str) -> Any:
    """Checks a JSON value against the option's type (ints are accepted for floats)."""
    kind = field_type(name)
    if value is None and OPTIONS[name].default is None:
        return None
    try:
        return as_type(value, kind)
    except TypeError:
        raise ConfigError(f"{source}: {name!r} must be {kind.__name__}, got {json.dumps(value)}") from None


def as_type(value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (a bool is no int; an int is taken for a float, as a
    float); TypeError otherwise."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise TypeError(f"expected {kind.__name__}")


def load_run_file(path: str) -> dict[str, Any]:
    """Reads a run JSON whose keys are option names; unknown keys raise with the valid list."""
    raw = read_json(path, "run config")
    if not isinstance(raw, dict):
        raise ConfigError(f"run config {path!r} must hold a JSON object of options")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in JSON_KEYS or key == "config":
            valid = ", ".join(sorted(n for n in OPTIONS))
            raise ConfigError(f"run config {path!r}: unknown key {key!r}; valid keys: {valid}")
        name = JSON_KEYS[key]
        values[name] = coerce(name, value, f"run config {path!r}")
    return values


def build_config(cli_values: dict[str, Any], config_path: str | None = None) -> RunConfig:
    """Defaults, then the JSON run file, then the command line (hook options key by key)."""
    values: dict[str, Any] = {}
    if config_path is not None:
        values.update(load_run_file(config_path))
    cli_values = dict(cli_values)
    if "hook_options" in cli_values:
        cli_values["hook_options"] = {**values.get("hook_options", {}), **cli_values["hook_options"]}
    values.update(cli_values)
    return RunConfig(**values)


def resolve_path(path: str) -> Path:
    """A relative path is taken from the working directory, else from the project root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    bundled = PROJECT_ROOT / candidate
    return bundled if bundled.exists() else candidate


@dataclass(frozen=True)
class Entry:
    """One entry of an upstream-format data or model configuration file, or of the zoo."""

    id: str
    class_name: str
    kwargs: dict[str, Any]
    source: str  # the file it came from, or ZOO
    size: dict[str, int] | None = None  # models: parameters and gradient bytes (see model_size)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "class": self.class_name, "configurations": self.kwargs, "source": self.source}


ZOO = "the model zoo"
DEFAULT_DATA = "DummyDataSmall"


def load_entry(path: str, entry_id: str, class_key: str, registry: Any, option_name: str,
               zoo: dict[str, dict]) -> Entry:
    """Finds ``entry_id`` in the file ``{"Id": {"<class_key>": ..., "configurations": {...}}}``,
    else among the zoo's entries of the same format, and checks its keys."""
    file_option = f"--{option_name}-config-path"
    table = read_json(resolve_path(path), f"{file_option}")
    if not isinstance(table, dict):
        raise ConfigError(f"{file_option} {path!r} must hold a JSON object of entries")
    if entry_id in table:
        entry, source = table[entry_id], str(path)
    elif entry_id in zoo:
        entry, source = zoo[entry_id], ZOO
    else:
        close = difflib.get_close_matches(entry_id, [*table, *zoo], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"--{option_name} {entry_id!r} is not in {path} or {ZOO}; {hint}entries: "
                          f"{', '.join(sorted(table))}; zoo: {', '.join(zoo)}")
    if not isinstance(entry, dict) or class_key not in entry:
        raise ConfigError(f"{source}: entry {entry_id!r} needs a {class_key!r} key")
    kwargs = entry.get("configurations", {})
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{source}: entry {entry_id!r}: 'configurations' must be an object")
    try:
        factory = registry.get(entry[class_key])
    except KeyError as error:
        raise ConfigError(f"{source}: entry {entry_id!r}: {error}") from None
    accepted = [name for name in inspect.signature(factory).parameters if name != "self"]
    for key in kwargs:
        if key not in accepted:
            raise ConfigError(f"{source}: entry {entry_id!r}: unknown configuration {key!r}; valid: {', '.join(accepted)}")
    return Entry(entry_id, registry.canonical(entry[class_key]), dict(kwargs), source)


def construct(entry: Entry, registry: Any) -> Any:
    """Builds an entry's model (on the meta device: no weights are allocated) or data
    description, so that any error in its configuration is one line naming the entry."""
    import torch

    try:
        with torch.device("meta"):
            return registry.get(entry.class_name)(**entry.kwargs)
    except Exception as error:  # noqa: BLE001 - a constructor may raise anything on bad sizes
        text = str(error).strip()
        reason = text.splitlines()[0] if text else type(error).__name__
        raise ConfigError(f"{entry.source}: entry {entry.id!r}: {reason}") from None


def model_size(network: Any) -> dict[str, int]:
    """Parameters (shared ones once) and the bytes of their gradients: dense, and sparse
    (embeddings with sparse gradients, counted at their dense size; what they really send
    depends on the rows a batch touches)."""
    sparse = {id(module.weight) for module in network.modules() if getattr(module, "sparse", False)}
    parameters = list(network.parameters())
    nbytes = {id(p): p.numel() * p.element_size() for p in parameters}
    return {
        "parameters": sum(p.numel() for p in parameters),
        "dense_gradient_bytes": sum(n for key, n in nbytes.items() if key not in sparse),
        "sparse_gradient_bytes": sum(n for key, n in nbytes.items() if key in sparse),
    }


def check_interface(name: str) -> None:
    """Raises ConfigError unless this node has a network interface called ``name``."""
    import socket

    names = sorted(interface for _, interface in socket.if_nameindex())
    if name not in names:
        raise ConfigError(f"--iface {name!r}: no such network interface on {socket.gethostname()}; "
                          f"it has {', '.join(names)}")


def check_writable_folder(path: str, option_name: str) -> None:
    """A ConfigError unless the folder exists and is writable, or could be created; creates
    nothing (a ``--dry-run`` leaves no trace; the folder is made where the files are written)."""
    existing = Path(path).absolute()
    while not existing.exists():  # the nearest part of the path that exists
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option_name} {path!r} cannot be created: {str(existing)!r} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option_name} {path!r} is not writable; choose another folder")


def check_port(flag: str, port: int) -> None:
    """Raises ConfigError unless ``port`` is a TCP port number."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"{flag} must be in 1..65535; got {port}")


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def validate(cfg: RunConfig, gpus: int | None = None, trainers_on_node: int | None = None) -> tuple[Entry, Entry]:
    """Checks a whole configuration before any process starts; returns the model and data
    entries it names. ``gpus`` defaults to the CUDA devices visible here, ``trainers_on_node``
    to every trainer (one machine)."""
    from ps_bench.models import DATA, DATA_PRESETS, MODEL_PRESETS, MODELS, PRESET_DATA
    from ps_bench.registry import UnknownNameError
    from ps_bench.servers import SERVERS
    from ps_bench.trainers.hooks import HOOKS, SERVER_HOOKS, SPARSE_ALLREDUCE_HOOKS, check_hook_options
    from ps_bench.trainers.trainer import TRAINERS

    def need(condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(message)

    for name in ("ntrainer", "ncudatrainer", "nserver", "ncudaserver", "warmup_rounds"):
        need(getattr(cfg, name) >= 0, f"--{name.replace('_', '-')} must be 0 or more; got {getattr(cfg, name)}")
    for name in ("epochs", "batch_size", "rounds", "rpc_threads"):
        value = getattr(cfg, name)
        need(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1; got {value}")
    for name in ("lr", "rpc_timeout", "bucket_cap_mb", "timeout"):
        value = getattr(cfg, name)
        need(value is None or value > 0, f"--{name.replace('_', '-')} must be positive; got {value}")
    if cfg.inject_fault is not None:
        from ps_bench.faults import Fault

        try:
            fault = Fault.parse(cfg.inject_fault)
        except ValueError as error:
            raise ConfigError(f"--inject-fault: {error}") from None
        count = {"trainer": cfg.num_trainers, "server": cfg.num_servers, "master": 1}[fault.role]
        need(fault.index < count, f"--inject-fault: there is no {fault.role} {fault.index}; "
                                  f"this run has {count} {fault.role}(s), numbered from 0")
    if cfg.profile is not None:
        check_writable_folder(cfg.profile, "--profile")
    need(cfg.num_trainers >= 1, "at least one trainer is needed: set --ntrainer or --ncudatrainer to 1 or more")
    if cfg.master_port is not None:
        check_port("--master-port", cfg.master_port)
    if cfg.iface is not None:
        check_interface(cfg.iface)
    for name, allowed in (("backend", ("gloo", "nccl", "multi")), ("mapping", ("shard", "group"))):
        value = getattr(cfg, name)
        need(value in allowed, f"--{name} must be one of {', '.join(allowed)}; got {value!r}")
    for name, registry in (("hook", HOOKS), ("server", SERVERS), ("trainer", TRAINERS)):
        try:
            setattr(cfg, name, registry.canonical(getattr(cfg, name)))
        except UnknownNameError as error:
            raise ConfigError(f"--{name}: {error}") from None
    try:
        cfg.hook_options = check_hook_options(cfg.hook, cfg.hook_options)
    except ValueError as error:
        raise ConfigError(f"--hook-option: {error}") from None
    if cfg.hook in SERVER_HOOKS:
        need(cfg.num_servers >= 1, f"--hook {cfg.hook} sends gradients to parameter servers: set --nserver 1 or more")
    if cfg.mapping == "group" and cfg.num_servers:
        need(
            cfg.num_servers <= cfg.num_trainers,
            f"--mapping group needs at least as many trainers as servers: {cfg.num_servers} servers "
            f"need {cfg.num_servers} trainers; got {cfg.num_trainers}",
        )

    model = load_entry(cfg.model_config_path, cfg.model, "model_class", MODELS, "model", MODEL_PRESETS)
    if cfg.data is None:
        cfg.data = PRESET_DATA.get(cfg.model, DEFAULT_DATA) if model.source == ZOO else DEFAULT_DATA
    data = load_entry(cfg.data_config_path, cfg.data, "data_class", DATA, "data", DATA_PRESETS)
    network, dataset = construct(model, MODELS), construct(data, DATA)
    model = dataclasses.replace(model, size=model_size(network))
    need(network.takes == dataset.gives,
         f"--model {cfg.model} takes {network.takes} but --data {cfg.data} gives {dataset.gives}; "
         f"leave --data out to use the model's own data")
    mismatch = network.fits(dataset)
    need(mismatch is None, f"--data {cfg.data} {mismatch} (--model {cfg.model})")
    samples = dataset.sample_count
    need(
        samples // cfg.num_trainers >= cfg.batch_size,
        f"--data {cfg.data} has {samples} samples: {cfg.num_trainers} trainers get {samples // cfg.num_trainers} "
        f"each, fewer than --batch-size {cfg.batch_size}; lower --batch-size or use more samples",
    )
    smallest = getattr(network, "min_batch_size", 1)
    need(cfg.batch_size >= smallest, f"--model {cfg.model} needs --batch-size {smallest} or more (BatchNorm); "
                                     f"got {cfg.batch_size}")

    if gpus is None:
        gpus = cuda_device_count()
    wants_cuda = [
        f"--backend {cfg.backend}" if cfg.backend != "gloo" else "",
        f"--ncudatrainer {cfg.ncudatrainer}" if cfg.ncudatrainer else "",
        f"--ncudaserver {cfg.ncudaserver}" if cfg.ncudaserver else "",
    ]
    wants_cuda = [w for w in wants_cuda if w]
    if wants_cuda and gpus == 0:
        raise ConfigError(f"CUDA is needed for {' and '.join(wants_cuda)}, but no GPU is available here "
                          f"(torch.cuda.is_available() is False); use --backend gloo with CPU trainers and servers")
    if cfg.backend in ("nccl", "multi"):
        local_trainers = cfg.num_trainers if trainers_on_node is None else trainers_on_node
        need(
            local_trainers <= gpus,
            f"--backend {cfg.backend} needs one GPU per trainer: {local_trainers} trainers on this node, "
            f"{gpus} GPUs; lower --ntrainer/--ncudatrainer or use --backend gloo",
        )
        sparse = any(getattr(m, "sparse", False) for m in network.modules())
        if sparse and cfg.hook in SPARSE_ALLREDUCE_HOOKS:
            raise ConfigError(f"--model {cfg.model} has sparse gradients, which NCCL cannot all-reduce "
                              f"(--hook {cfg.hook}, --backend {cfg.backend}); use --hook hybrid with "
                              f"--backend multi, --hook sparse_ps or ps, or --backend gloo")
        if sparse and cfg.hook == "hybrid" and cfg.backend == "nccl":
            raise ConfigError("--hook hybrid all-reduces sparse gradients over gloo: use --backend multi")
    return model, data
