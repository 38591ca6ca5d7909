"""What a prediction needs from one results file (``Run``): its strategy, trainers and servers,
its compute phases and bucket timeline, its ``--limits`` link probe, and the network it had."""

from __future__ import annotations

from dataclasses import dataclass, field

from ps_bench.config import ConfigError
from ps_bench.metrics.limits import fit_link
from ps_bench.options import plural
from ps_bench.results.load import load_file, load_source
from ps_bench.strategies import HOOKS
from ps_bench.strategies.record import DDP


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
    # trainers on each trainer host (an emulated network's; else 1, every trainer apart)
    per_host: int = 1
    servers_on: str = "dedicated"
    grad_accum: int = 1  # micro-batches an optimizer step
    # what predict's memory takes from it: optimizer, momentum, precision, reduce_dtype,
    # model_options
    training: dict | None = None
    hook_options: dict = field(default_factory=dict)  # --hook-option, as given
    engine_config: dict | None = None  # the config its engine (DeepSpeed) was built from
    reduce_dtype: str | None = None  # its --reduce-dtype
    data: dict | None = None  # its data entry, as its results file resolved it
    # its checkpoints, failures and goodput (--checkpoint-every, or restarted by torchrun)
    recovery: dict = field(default_factory=dict)
    gradient_bytes: float = 0.0  # its model's float32 gradients, dense and sparse

    @property
    def precision(self) -> str:
        """What it computed in (``--precision``)."""
        return (self.training or {}).get("precision", "fp32")

    @property
    def communicates_nothing(self) -> bool:
        """Whether its backward is compute alone (one trainer, or the noop strategy)."""
        return self.trainers == 1 or HOOKS.record(self.hook).transport is None

    @property
    def computes_alone(self) -> bool:
        """Whether its forward and optimizer phases are the model's compute alone: its strategy
        wraps the model in DDP and communicates in its hooks only, none of its record's
        ``sends`` (FSDP2's and HSDP's gathers in forward, ZeRO's and local SGD's synchronisation
        at the step)."""
        record = HOOKS.record(self.hook)
        return record.wrap == DDP and not record.sends

    @property
    def on_one_host(self) -> bool:
        """Whether its trainers all shared one host: its link probe measured the host's local
        link."""
        return self.trainers > 1 and self.per_host == self.trainers

    @classmethod
    def load(cls, path: str) -> "Run":
        return cls.of(load_file(path), path)

    @classmethod
    def of(cls, results: dict, path: str) -> "Run":
        """The run of ``results``, read from ``path`` (a file, or a sweep's line)."""
        if results.get("status") != "ok":
            raise ConfigError(f"{path} is a failed run "
                              f"({results.get('error', 'no error recorded')}): predict from "
                              "runs that finished")
        cfg, rows = results["config"], {row["metric"]: row for row in results["summary"]
                                        if row["role"] == "trainer"}
        if stale(results):
            raise ConfigError(f"{path} ran --staleness {cfg['staleness']}: predict models "
                              f"synchronous strategies; give runs without --staleness")
        hook = HOOKS.canonical(cfg["hook"])
        limits = results.get("limits") or {}
        emulated = results.get("env", {}).get("emulated") or {}
        return cls(
            path=path, hook=hook,
            trainers=cfg["ntrainer"] + cfg.get("ncudatrainer", 0),
            servers=cfg["nserver"] + cfg.get("ncudaserver", 0), mapping=cfg.get("mapping", "shard"),
            batch_size=cfg["batch_size"], model=cfg["model"],
            batch_ms=batch_ms(hook, rows["batch"]),
            forward_ms=rows["forward"]["p50"], optimizer_ms=rows["optimizer"]["p50"],
            backward_ms=rows["backward"]["p50"] if "backward" in rows else 0.0,
            compute_ms=(limits.get("compute") or {}).get("p50_ms"),
            link=refitted(limits.get("link")),
            memcpy_gbps=(limits.get("memcpy") or {}).get("gbps"), timeline=results.get("timeline"),
            buckets=(cfg.get("model_size") or {}).get("ddp_buckets") or [],
            trainer_sent_per_iter=results["bytes"]["trainer_sent_per_iter"],
            link_rate_bps=emulated.get("link_rate_bps"),
            per_host=trainers_per_host(emulated.get("placement"),
                                       cfg["ntrainer"] + cfg.get("ncudatrainer", 0)),
            servers_on=cfg.get("servers_on", "dedicated"), backend=cfg.get("backend", "gloo"),
            grad_accum=cfg.get("grad_accum", 1),
            training={key: cfg[key] for key in ("optimizer", "momentum", "precision",
                                                "reduce_dtype", "model_options",
                                                "activation_checkpointing") if key in cfg},
            hook_options=dict(cfg.get("hook_options") or {}),
            engine_config=cfg.get("engine_config"), reduce_dtype=cfg.get("reduce_dtype"),
            data=cfg.get("data_config"), recovery=results.get("recovery") or {},
            gradient_bytes=sum((cfg.get("model_size") or {}).get(key, 0) for key in
                               ("dense_gradient_bytes", "sparse_gradient_bytes")),
        )


def compute_runs(runs: list[Run]) -> list[Run]:
    """The runs whose phases are the model's compute alone (``Run.computes_alone``); all of
    them where none is."""
    return [run for run in runs if run.computes_alone] or runs


def batch_ms(hook: str, row: dict) -> float:
    """A run's trainers' iteration from their summary row of it: the p50, or for a strategy that
    synchronises once a period (local SGD, DiLoCo) the mean, which amortises it over the period
    as predict does (the p50 is an iteration that synchronises nothing)."""
    return row.get("mean", row["p50"]) if HOOKS.record(hook).periodic else row["p50"]


def accumulating(runs: list[Run], micro_batches: int, hint: str) -> list[Run]:
    """``runs``, each made with ``micro_batches`` a step (``--grad-accum``); else a ConfigError
    naming the first that was not, and ``hint``."""
    for run in runs:
        if run.grad_accum != micro_batches:
            raise ConfigError(f"{run.path} ran --grad-accum {run.grad_accum}: {hint}")
    return runs


def stale(results: dict) -> bool:
    """Whether a run's servers were stale-synchronous (``--staleness``)."""
    return results.get("config", {}).get("staleness") is not None


def runs_of(sources: list[str]) -> list[Run]:
    """The runs of ``sources``, as report and compare read them (``load_source``): results files,
    sweep folders, a sweep's ``results.jsonl``, folders of results files. A failed run named on
    its own is refused; a sweep's or a folder's failed runs are passed over (a sweep records
    every point), and those of stale-synchronous servers (``--staleness``, which predict does not
    model), and one with no run that finished is refused."""
    runs = []
    for source in sources:
        loaded = load_source(source)
        if loaded.kind == "results file":
            runs += [Run.of(results, where) for where, results in loaded.runs]
            continue
        finished = [Run.of(results, where) for where, results in loaded.runs
                    if results.get("status") == "ok" and not stale(results)]
        if not loaded.runs:
            raise ConfigError(f"{source}: a {loaded.kind} with no results in it")
        if not finished:
            staled = any(stale(results) for _, results in loaded.runs)
            raise ConfigError(f"{source}: every run of this {loaded.kind} failed"
                              f"{' or ran --staleness' if staled else ''} "
                              f"({plural(len(loaded.runs), 'run')}): predict from runs that "
                              f"finished{' without it' if staled else ''}")
        runs += finished
    return runs


def refitted(link: dict | None) -> dict | None:
    """A run's link probe fitted as this ps_bench fits it (``limits.fit_link``) from the points
    it recorded, so that a results file of an earlier fit predicts as a new one does."""
    if not link or len(link.get("points") or ()) < 2:
        return link
    points = [(point["bytes"], point["p50_ms"]) for point in link["points"]]
    return {**link, **fit_link(points, link["method"], link["peers"])}


def trainers_per_host(placement: list[list[int]] | None, trainers: int) -> int:
    """Trainers on each host that has any, from an emulated network's placement (ranks per host,
    trainers ranking first); 1 without one, or where hosts hold different numbers."""
    counts = {sum(rank < trainers for rank in ranks) for ranks in placement or []} - {0}
    return counts.pop() if len(counts) == 1 else 1
