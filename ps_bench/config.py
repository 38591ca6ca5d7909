"""Run options as one typed dataclass; the command line and JSON files only fill it.

Precedence: command line > JSON run file (``--config``) > the defaults below. Each field
carries what its flag needs (help, aliases, choices, its group in ``--help``), so a new
option is one field here and the code that reads it. This module imports nothing it
configures: ``ps_bench.job.validate`` checks a whole configuration against the registered
strategies, servers, trainers, models and data, and raises ``ConfigError`` with one line that
names the input and what to change.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


PROJECT_ROOT = Path(__file__).resolve().parent.parent


class ConfigError(ValueError):
    """Bad user input: reported as one line, exit status 2."""


def need(condition: bool, message: str) -> None:
    """Raises ConfigError(``message``) unless ``condition``."""
    if not condition:
        raise ConfigError(message)


def flag(name: str) -> str:
    """The command-line spelling of an option: ``max_iterations`` -> ``--max-iterations``."""
    return f"--{name.replace('_', '-')}"


# --help groups
TOPOLOGY, STRATEGY, RUN = "topology", "strategy and workload", "rounds, rendezvous and output"
NETWORK = "emulated network (see bench.py emulate --help)"
CONVERGENCE = "time to a target loss"
FAILURES = "checkpoints and failures"
DEFAULT_MAX_ITERATIONS = 1000  # --max-iterations when --target-loss is given without it
PATHS = ("FILE", "PATH", "DIR", "DIR|FILE", "RESULTS.json", "BASE", "NEW")  # files and folders


def option(default: Any, help: str, *, group: str = RUN, aliases: tuple[str, ...] = (),
           choices: tuple[str, ...] = (), metavar: str | None = None,
           numbers_as_text: bool = False) -> Any:
    """A RunConfig field with what its flag needs; ``numbers_as_text``: JSON numbers as text."""
    metadata = {"help": help, "group": group, "aliases": aliases, "choices": choices,
                "metavar": metavar, "numbers_as_text": numbers_as_text}
    if isinstance(default, (dict, list)):
        return field(default_factory=type(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class RunConfig:
    """Everything one benchmark run needs; field names are the option names."""

    ntrainer: int = option(2, "trainers whose gradients cross RPC as CPU tensors", group=TOPOLOGY)
    ncudatrainer: int = option(0, "trainers whose gradients cross RPC as CUDA tensors "
                                  "(device maps)", group=TOPOLOGY)
    nserver: int | None = option(
        None, "parameter servers that aggregate on the CPU (default: 1 where --hook sends "
        "gradients to servers and --ncudaserver is 0, else 0: no server idles beside a strategy "
        "that sends it nothing)", group=TOPOLOGY)
    ncudaserver: int = option(0, "parameter servers that aggregate on a GPU", group=TOPOLOGY)
    backend: str = option("gloo", "trainers' collective backend", group=TOPOLOGY,
                          choices=("gloo", "nccl", "multi"))
    per_host: int | None = option(
        None, "trainers per host, as GPUs share a node: trainers [kG, (k+1)G) are host k; hsdp "
        "shards within a host and replicates across hosts (default: unset, every trainer on one "
        "host)", group=TOPOLOGY, metavar="G")
    servers_on: str = option(
        "dedicated", "where an emulated network places the parameter servers: dedicated (a host of "
        "their own) or colocated (server k on trainer host k mod the hosts, as many on each, as "
        "BytePS places them)",
        group=TOPOLOGY, choices=("dedicated", "colocated"))
    hook: str = option("ps", "DDP communication hook (gradient strategy)", group=STRATEGY,
                       aliases=("ddp_hook",))
    hook_options: dict = option({}, "options of the hook, e.g. PowerSGD's "
                                    "matrix_approximation_rank", group=STRATEGY)
    ds_config: str | None = option(
        None, "a DeepSpeed config (ds_config.json) for --hook deepspeed_zero1|2|3: its batch size, "
        "optimizer and precision become the run's (\"auto\" takes the run's), and what conflicts "
        "with an option given here is refused", group=STRATEGY, metavar="FILE")
    verify: bool = option(False, "compare what the strategy delivered with the exact mean "
                                 "gradient, on a few iterations per timed round (at most 4, and "
                                 "never two in a row; left out of the timings)")
    server: str = option("average", "parameter-server aggregation algorithm", group=STRATEGY)
    trainer: str = option("ddp", "trainer loop", group=STRATEGY)
    mapping: str = option(
        "shard",
        "trainers to servers: shard = each bucket to one owning server (bytes balanced), every "
        "trainer to every server; group = one server per group of trainers, servers combine "
        "partial sums",
        group=TOPOLOGY, choices=("shard", "group"),
    )
    epochs: int = option(1, "passes over each trainer's data shard per round", group=STRATEGY)
    batch_size: int = option(16, "samples per trainer per micro-batch (per iteration without "
                                 "--grad-accum)", group=STRATEGY)
    grad_accum: int = option(1, "micro-batches of --batch-size an optimizer step: the gradients "
                                "accumulated over them, synchronised once a step as each "
                                "strategy's engine does it (an iteration is an optimizer step)",
                             group=STRATEGY, metavar="N")
    precision: str = option("fp32", "what forward and backward compute in: bf16 and fp16 under "
                                    "torch.autocast (fp16 with a gradient scaler, on a GPU); "
                                    "DeepSpeed casts the model as its config says",
                            group=STRATEGY, choices=("fp32", "bf16", "fp16"))
    activation_checkpointing: str = option(
        "none", "recompute activations in backward instead of keeping them: full (every unit: "
        "a Hugging Face model's transformer blocks, else each module holding parameters) or "
        "selective (every other unit), with torch's checkpoint_wrapper", group=STRATEGY,
        choices=("none", "full", "selective"))
    compile: bool = option(
        False, "compile the model's units (those --activation-checkpointing names) with "
        "torch.compile before the strategy wraps them, as torchtitan does; the compile time is "
        "reported apart from the timed rounds", group=STRATEGY)
    peak_tflops: float | None = option(
        None, "one trainer's GPU's dense peak TFLOP/s in the run's precision, for the MFU of a "
        "model of sequences (default: the table of GPUs in docs/results.md for CUDA trainers; "
        "none on a CPU)", group=STRATEGY, metavar="TFLOPS")
    reduce_dtype: str | None = option(
        None, "what an engine that has one communicates the gradients in: FSDP2's "
        "MixedPrecisionPolicy (its gathers too), DeepSpeed's communication_data_type (default: "
        "the engine's own: FSDP2 the parameters' float32, DeepSpeed the type it trains in); DDP "
        "sends the gradients in their own dtype", group=STRATEGY,
        choices=("fp32", "bf16", "fp16"))
    lr: float = option(0.01, "learning rate of the trainers' optimizer (diloco: the inner one)",
                       group=STRATEGY)
    optimizer: str = option(
        "sgd", "the trainers' optimizer: sgd = torch.optim.SGD (with --momentum), adamw = "
        "torch.optim.AdamW; diloco's inner optimizer, zero1's sharded one", group=STRATEGY,
        choices=("sgd", "adamw"))
    momentum: float = option(0.0, "SGD momentum, in [0, 1) (--optimizer sgd)", group=STRATEGY)
    weight_decay: float | None = option(
        None, "the optimizer's weight decay (default: torch's, 0 for sgd and 0.01 for adamw)",
        group=STRATEGY)
    warmup_rounds: int = option(1, "untimed rounds before the timed ones (cover 2 iterations)")
    rounds: int = option(5, "timed rounds")
    labels: str | None = option(
        None, "labels of the synthetic data: random = drawn uniformly, nothing to learn (the "
        "default without --target-loss); teacher = a fixed, seeded function of the inputs the "
        "model can learn (the default with --target-loss)", group=CONVERGENCE,
        choices=("random", "teacher"))
    target_loss: float | None = option(
        None, "train until the averaged model's training loss, smoothed over the last 10 "
        "iterations, is at or below X (or --max-iterations): rounds go on past --rounds, and the "
        "results say whether, after how many iterations and after how many seconds of training "
        "the target was reached", group=CONVERGENCE, metavar="X")
    max_iterations: int | None = option(
        None, f"the most training iterations a --target-loss run takes, warmup included (default: "
              f"{DEFAULT_MAX_ITERATIONS})",
        group=CONVERGENCE)
    staleness: str | None = option(
        None, "parameter servers that own the parameters and apply SGD themselves, trainers "
        "without DDP that push gradients and read parameters, where a trainer may run at most S "
        "clocks (iterations) ahead of the slowest: 0 = bulk-synchronous (trains as --hook ps "
        "does), inf = fully asynchronous; needs --hook ps and servers (default: none, synchronous "
        "DDP)", group=STRATEGY, metavar="S", numbers_as_text=True)
    straggler: list = option(
        [], "make trainers slower on purpose, after the forward pass and inside the clock, in "
        "every mode: trainer:INDEX:DELAY sleeps DELAY (us, ms or s) in each of that trainer's "
        "iterations (persistent); any:DELAY:P delays each trainer in each iteration with "
        "probability P (transient: the draws follow --torch-seed, the same on every run); "
        "repeatable, e.g. trainer:1:30ms or any:20ms:0.2",
        group=STRATEGY, metavar="trainer:I:DELAY|any:DELAY:P")
    data: str | None = option(
        None, "entry of the data configuration file, or zoo data (default: the zoo model's own "
        "data, else DummyDataSmall)", group=STRATEGY)
    model: str = option(
        "DummyModelSmall", "entry of the model configuration file, a zoo model, or hf:CONFIG: a "
        "Hugging Face transformers architecture from its config.json (a path, or one shipped in "
        "configs/hf), built with random seeded weights, nothing downloaded; needs pip install -e "
        "\".[hf]\"", group=STRATEGY)
    model_options: dict = option({}, "options of the model: keys of an hf: model's config, or "
                                     "of a zoo model's configurations", group=STRATEGY)
    data_config_path: str = option("configs/data_configurations.json", "data configuration file",
                                   group=STRATEGY, metavar="PATH")
    model_config_path: str = option("configs/model_configurations.json", "model configuration file",
                                    group=STRATEGY, metavar="PATH")
    bucket_cap_mb: float = option(25.0, "DDP bucket size cap in MiB (more buckets spread over "
                                        "more servers)", group=STRATEGY)
    gradient_as_bucket_view: bool = option(
        False, "DDP's gradient_as_bucket_view: dense gradients are views into DDP's buckets, which "
               "saves their size in memory and the copy of every answer back into them",
        group=STRATEGY)
    torch_seed: int = option(0, "seed for data, model initialisation and CPU randomness",
                             group=STRATEGY)
    cuda_seed: int = option(0, "seed for CUDA randomness", group=STRATEGY)
    rpc_timeout: float = option(60.0, "seconds before an RPC call fails", metavar="SECONDS")
    rpc_threads: int | None = option(
        None, "TensorPipe worker threads per process (default: sized to the role, 4 or more: a "
        "server one per trainer and server plus one, a trainer two plus one per server)")
    master_addr: str = option("127.0.0.1", "address of the rendezvous store "
                                           "(a private interface: RPC trusts its peers)")
    master_port: int | None = option(None, "port of the rendezvous store (default: a free one)")
    rpc_transport: str = option(
        "auto", "how TensorPipe moves RPC payloads: auto = its own choice (shared memory between "
        "processes of one machine, even across network namespaces; that transport polls, half a "
        "core per process); tcp = TCP sockets only (the uv transport and basic channel), so RPC "
        "crosses the network as gloo's collectives do; an emulated network always uses tcp",
        choices=("auto", "tcp"))
    emulate_link: str | None = option(
        None, "emulate a cluster network on this machine: every host a network namespace behind a "
        "link of this rate to one switch, shaped both ways with tc, e.g. 1gbit, 10gbit, 500mbit "
        "(bits a second); needs root (default: none, the real network)", group=NETWORK,
        metavar="RATE")
    emulate_hosts: int | None = option(
        None, "emulated hosts: the ranks packed onto N hosts in rank order (default: every "
        "trainer and every server on a host of its own, the master beside the last server)",
        group=NETWORK)
    emulate_delay: str | None = option(
        None, "added one-way delay on every emulated link, e.g. 100us or 2ms (needs the kernel's "
        "netem)", group=NETWORK, metavar="TIME")
    emulate_keep: bool = option(False, "keep the emulated network after the run, for a look "
                                       "inside; prints how to enter and remove it", group=NETWORK)
    iface: str | None = option(
        None, "network interface that connects the nodes, e.g. eth1: exported to every rank as "
        "TP_SOCKET_IFNAME (TensorPipe) and GLOO_SOCKET_IFNAME (gloo); must exist on every node "
        "(default: let them choose)")
    timeout: float | None = option(
        None, "watchdog for the whole job in seconds: on expiry every rank's Python stacks go to "
        "the log and the job ends with status 1 (default: none)")
    inject_fault: str | None = option(
        None, "make ranks fail on purpose: ROLE:INDEX:ITER:KIND[:first] with ROLE "
        "trainer|server|master, INDEX among that role from 0, ITER from 1 (a training iteration; "
        "the master's round), KIND exit|raise|hang, or cut=DURATION (a trainer's host link down "
        "that long, under --emulate-link); a trailing :first fails only torchrun's first "
        "attempt, so --max-restarts can recover; several separated by commas (default: none)",
        group=FAILURES)
    mtbf: str | None = option(
        None, "draw failures at exponential gaps of this mean from the job's start (seeded by "
        "--torch-seed), each of a rank of --fail-roles drawn at random, which then exits (one "
        "drawn while torchrun restarts the job begins the restart again): with ms, s, min or "
        "h, e.g. 90s (default: none)", group=FAILURES, metavar="DURATION")
    fail_roles: str = option("trainer", "the roles --mtbf draws the failed ranks from: trainer, "
                                        "server or master, several separated by commas",
                             group=FAILURES, metavar="ROLES")
    trainer_timeout: float | None = option(
        None, "parameter servers drop a trainer that sends nothing this long while the others "
        "wait, and go on with the living: each average divides by the trainers that sent "
        "(ps, ps_fp16, ps_bf16, ps_compressed; default: wait for every trainer)",
        group=FAILURES, metavar="SECONDS")
    server_replicas: int = option(
        0, "1: each server's buckets also kept by the next server, which answers for it if it "
        "is lost (ps, ps_fp16, ps_bf16); 0: none", group=FAILURES, metavar="N")
    checkpoint_every: int | None = option(
        None, "save a checkpoint every N iterations (the model, the optimizer, the data's "
        "position and the RNG, with torch.distributed.checkpoint; DeepSpeed's engines with their "
        "own save_checkpoint): a job torchrun restarts, or started again with the same options, "
        "resumes from the newest complete one at its iteration (default: none)",
        group=FAILURES, metavar="N")
    checkpoint_dir: str | None = option(
        None, "the checkpoints' folder, shared by every trainer's host (default: "
        "checkpoints/HOOK-Nt-HASH, HASH of the options that shape the training)",
        group=FAILURES, metavar="DIR")
    checkpoint_async: bool = option(
        False, "save each checkpoint in the background (torch.distributed.checkpoint's "
        "async_save): training goes on once the state is copied", group=FAILURES)
    limits: bool = option(False, "after each timed round, measure a share of the floors with this "
                                 "run's bytes and processes: raw RPC round trips to the servers "
                                 "(CUDA tensors where the run's cross RPC on the GPU), raw "
                                 "all-reduce among the trainers, memory-copy bandwidth, a "
                                 "compute-only iteration; adds 'limits' and 'efficiency' (floor "
                                 "p50 / trainer comm p50) to the results")
    profile: str | None = option(None, "write torch.profiler Chrome traces of a few timed "
                                       "iterations of every trainer into this folder, one file "
                                       "per rank (open in ui.perfetto.dev or chrome://tracing), "
                                       "and beside each a .txt table of the operators by self "
                                       "time",
                                 metavar="DIR")
    trace: str | None = option(None, "--profile's traces of the last timed round, with ps_bench's "
                                     "own spans in them (each iteration's phases, each bucket from "
                                     "its hand-over to its answer; on every server each bucket's "
                                     "receiving and aggregation), one file per rank, and "
                                     "merged.json: every rank as a process of its own on one "
                                     "clock (open in ui.perfetto.dev)", metavar="DIR")
    out: str | None = option(None, "results file (default: a new name under results/; never "
                                   "overwritten); a folder (one that exists, or ending in /): "
                                   "the new name inside it", metavar="PATH")
    per_rank: bool = option(False, "also print one table row per rank")
    verbose: bool = option(False, "also print where the start-up time went, phase by phase "
                                  "(always in the results, env.startup_s)")
    dry_run: bool = option(False, "print the rank/role/name/mapping table and exit")
    debug: bool = option(False, "show tracebacks for errors in the input")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def num_trainers(self) -> int:
        return self.ntrainer + self.ncudatrainer

    @property
    def num_servers(self) -> int:
        assert self.nserver is not None, "--nserver left out: job.default_servers sets it first"
        return self.nserver + self.ncudaserver

    @property
    def world_size(self) -> int:
        return self.num_trainers + self.num_servers + 1


OPTIONS: dict[str, dataclasses.Field] = {f.name: f for f in fields(RunConfig)}
# Keys a JSON run file may hold: option names, dash or underscore spelling, and aliases.
JSON_KEYS: dict[str, str] = {}
for _f in fields(RunConfig):
    for _key in (_f.name, *_f.metadata["aliases"]):
        JSON_KEYS[_key] = JSON_KEYS[_key.replace("_", "-")] = _f.name


def field_type(name: str) -> type:
    """The scalar type of an option (``int | None`` gives ``int``)."""
    annotation = str(OPTIONS[name].type)
    for candidate in (bool, int, float, str, dict, list):
        if annotation.startswith(candidate.__name__):
            return candidate
    raise TypeError(f"unsupported option type {annotation}")


def not_text(error: UnicodeDecodeError) -> str:
    """``not UTF-8 text (byte 0xe8 at offset 14)``: where a file read as text is not."""
    return f"not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start})"


class DuplicateKey(ValueError):
    """A key given twice in one JSON object (JSON's readers keep the last, silently)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` for ps_bench's own files: a key given twice in one
    object is a mistake to say, not a value to drop."""
    values: dict[str, Any] = {}
    for key, value in pairs:
        if key in values:
            raise DuplicateKey(f"key {key!r} is given twice in one object "
                               f"({json.dumps(values[key])}, then {json.dumps(value)})")
        values[key] = value
    return values


def read_json(path: str | os.PathLike, what: str, own_format: bool = True) -> Any:
    """Loads a JSON file; a missing file, bad syntax or (in ``own_format``, ps_bench's own kinds
    of file, not DeepSpeed's or Hugging Face's) a key given twice is a ``ConfigError`` naming
    the place."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what} {str(path)!r} is not valid JSON: {not_text(error)}") from None
    except OSError as error:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {error.strerror}") from None
    try:
        return json.loads(text, object_pairs_hook=unique_keys if own_format else None)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{what} {str(path)!r} is not valid JSON: {error.msg} at line "
                          f"{error.lineno} column {error.colno}") from None
    except DuplicateKey as error:
        raise ConfigError(f"{what} {str(path)!r}: {error}") from None


RESULTS_SCHEMA = "ps_bench.result/1"  # a results file's "schema" (ps_bench.results.files)
