"""Goodput at scale (``predict --mtbf``): the useful samples a second of wall time each strategy
keeps when failures come at the cluster's rate, beside its failure-free batch time.

Failures are independent and exponentially distributed: one GPU's mean time between failures
(``--mtbf``) or one node's (``--node-mtbf``), the cluster's that over the GPUs (nodes) it
holds, M = m / N. A failure stops what the strategy's record says it stops
(``Strategy.recovery``), and each way of recovering has its model here:

- restart (DDP's all-reduce and every hook around it, FSDP2, ZeRO, DeepSpeed; local SGD and
  DiLoCo from a synchronisation): every rank stops, restarts (R: from the failure to useful work
  again: detection, rendezvous, start-up, restore) and redoes the work since its last
  checkpoint; a checkpoint every τ of work costs δ. Daly's model of that job (J. T. Daly, "A
  higher order estimate of the optimum checkpoint interval for restart dumps", Future
  Generation Computer Systems 22(3), 2006, eq. 13) gives its wall time over its work,
  ``M e^(R/M) (e^((τ+δ)/M) - 1) / τ``, at his higher-order estimate of the optimum interval
  (eq. 37); Young's first-order one (J. W. Young, "A first order approximation to the optimum
  checkpoint interval", CACM 17(9), 1974) is ``sqrt(2δM)``.
- heal (torchft's replica groups): the failed group alone stops, restarts (R) and heals from a
  live peer (H: its replica's parameters and optimizer state over the network link) while the
  other groups go on; the step in flight when it failed commits for no group (its collective
  across the groups fails), so each failure costs every group a step s and one of G groups R + H:
  ``1 - (s + (R + H) / G) / M`` of the job's time is kept (a group a node).
- servers keep (servers that own the parameters, ``--staleness``): the failed trainer's share is
  lost until it is back, ``1 - R / (N M)`` kept; the servers are taken not to fail.

The effective training time ratio (ETTR) is what is kept; goodput the failure-free samples a
second times it. A checkpoint's cost δ is given (``--checkpoint-time``), or scaled from a run
made with ``--checkpoint-every``: each trainer writes its share of the model's states (its
bytes, over the trainers) at the rate that run's trainers wrote theirs, so δ falls as the
trainers grow, as a parallel file system's bandwidth grows with its writers; R is given
(``--restart-time``) or the median recovery of the runs torchrun restarted.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field

from ps_bench.config import ConfigError
from ps_bench.options import plural
from ps_bench.predict.runs import Run
from ps_bench.runtime.faults import parse_duration
from ps_bench.strategies import HOOKS
from ps_bench.strategies.record import AT_SYNC, HEAL, RESTART, SERVERS_KEEP

# optimizer states a parameter has beside itself, float32: what a healing group receives
STATES_PER_PARAMETER = {"sgd": 1, "adamw": 2}
MODELS = {RESTART: "restart from the last checkpoint", AT_SYNC: "restart from the last checkpoint",
          HEAL: "its replica group heals from a live peer",
          SERVERS_KEEP: "a trainer's share lost until it is back"}


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate of the optimum checkpoint interval (2006, eq. 37):
    ``sqrt(2δM) [1 + sqrt(δ/2M)/3 + (δ/2M)/9] - δ`` for δ < 2M, else M."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return (math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9)
            - checkpoint_s)


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum interval (1974): ``sqrt(2δM)``."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def restart_ettr(interval_s: float, checkpoint_s: float, restart_s: float,
                 mtbf_s: float) -> float:
    """The share of wall time a restarting job spends on work it keeps, Daly's (2006, eq. 13):
    ``τ / (M e^(R/M) (e^((τ+δ)/M) - 1))``."""
    exponent = (interval_s + checkpoint_s) / mtbf_s
    if exponent > 700 or restart_s / mtbf_s > 700:  # the job never gets through an interval
        return 0.0
    return interval_s / (mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1(exponent))


def heal_ettr(restart_s: float, heal_s: float, groups: int, step_s: float,
              mtbf_s: float) -> float:
    """Replica groups that heal: each failure costs every group the step in flight and one of
    ``groups`` its restart and heal."""
    return max(0.0, 1.0 - (step_s + (restart_s + heal_s) / groups) / mtbf_s)


def elastic_ettr(restart_s: float, trainers: int, mtbf_s: float) -> float:
    """A trainer's share lost until it is back, the others going on."""
    return max(0.0, 1.0 - restart_s / (trainers * mtbf_s))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("goodput under failures (see docs/predict.md)")
    group.add_argument("--mtbf", metavar="DURATION", help="one GPU's mean time between failures, "
                       "e.g. 5000h; the cluster's is it over the GPUs (give this or --node-mtbf)")
    group.add_argument("--node-mtbf", metavar="DURATION", help="one node's mean time between "
                       "failures, e.g. 600h; the cluster's is it over the nodes")
    group.add_argument("--checkpoint-time", metavar="DURATION", help="what one checkpoint costs "
                       "training, e.g. 30s (default: scaled from a run given made with "
                       "--checkpoint-every: each trainer writes its share at that run's rate)")
    group.add_argument("--restart-time", metavar="DURATION", help="from a failure to useful work "
                       "again: detection, rendezvous, start-up, restore, e.g. 10min (default: the "
                       "median recovery of the runs given that torchrun restarted)")
    group.add_argument("--checkpoint-every", type=int, metavar="N", help="predict restarting "
                       "strategies checkpointing every N iterations (default: at Daly's optimum "
                       "interval)")


def duration(text: str | None, flag: str) -> float | None:
    if text is None:
        return None
    try:
        return parse_duration(text)
    except ValueError as error:
        raise ConfigError(f"{flag} {error}") from None


@dataclass
class Failures:
    """What ``--mtbf`` predicts with: the failure rate, a checkpoint's cost (given, or a
    trainer's write rate and the run's checkpoint bytes and gradient bytes, to scale it), the
    restart, the interval, and where each came from."""

    gpu_mtbf_s: float | None
    node_mtbf_s: float | None
    restart_s: float
    checkpoint_s: float | None = None
    write_rate: float | None = None  # bytes a second a trainer writes its share of a checkpoint
    run_bytes: float | None = None  # that run's checkpoint, and its float32 gradient
    run_gradient_bytes: float | None = None
    every: int | None = None
    optimizer: str = "adamw"
    sources: list[str] = field(default_factory=list)

    def cluster_mtbf_s(self, trainers: int, nodes: int) -> float:
        return (self.gpu_mtbf_s / trainers if self.gpu_mtbf_s is not None
                else self.node_mtbf_s / nodes)

    def checkpoint_cost_s(self, trainers: int, gradient_bytes: float) -> float:
        """δ: given, or each trainer's share of the run's checkpoint, scaled by the gradient
        bytes predicted against the run's, at the run's write rate."""
        if self.checkpoint_s is not None:
            return self.checkpoint_s
        scaled = self.run_bytes * gradient_bytes / self.run_gradient_bytes
        return scaled / trainers / self.write_rate

    def row(self, row: dict, gradient_bytes: float, link_bytes_per_ms: float) -> dict:
        """A prediction's goodput, ETTR, the failure model and the interval (a restarting one)."""
        recovery = HOOKS.record(row["strategy"]).recovery
        n, nodes = row["trainers"], row["nodes"]
        mtbf_s = self.cluster_mtbf_s(n, nodes)
        out = {"mtbf_s": mtbf_s, "failure_model": MODELS[recovery]}
        if recovery in (RESTART, AT_SYNC):
            delta = self.checkpoint_cost_s(n, gradient_bytes)
            tau = (self.every * row["batch_ms"] / 1000.0 if self.every is not None
                   else daly_interval_s(delta, mtbf_s))
            ettr = restart_ettr(tau, delta, self.restart_s, mtbf_s)
            out.update(checkpoint_s=delta, checkpoint_interval_s=tau)
        elif recovery == HEAL:
            states = gradient_bytes * (1 + STATES_PER_PARAMETER[self.optimizer])
            heal_s = states / link_bytes_per_ms / 1000.0
            ettr = heal_ettr(self.restart_s, heal_s, max(1, nodes), row["batch_ms"] / 1000.0,
                             mtbf_s)
            out["heal_s"] = heal_s
        else:
            ettr = elastic_ettr(self.restart_s, n, mtbf_s)
        return {**out, "ettr": ettr,
                "goodput_samples_per_s": (row["samples_per_s"] or 0.0) * ettr}

    def describe(self) -> str:
        rate = (f"one GPU's {hours(self.gpu_mtbf_s)}" if self.gpu_mtbf_s is not None
                else f"one node's {hours(self.node_mtbf_s)}")
        return (f"failures: mean time between failures {rate}, the cluster's that over its "
                f"{'GPUs' if self.gpu_mtbf_s is not None else 'nodes'}; "
                + "; ".join(self.sources) + "\n")


def hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"


def check_arguments(args: argparse.Namespace) -> tuple[float | None, ...]:
    """``--mtbf`` and what goes with it, checked before any file is read: each duration with
    its unit, one rate of failures, an interval of 1 or more. Returns the durations (seconds):
    one GPU's and one node's mean time between failures, the checkpoint, the restart."""
    gpu, node = duration(args.mtbf, "--mtbf"), duration(args.node_mtbf, "--node-mtbf")
    checkpoint = duration(args.checkpoint_time, "--checkpoint-time")
    restart = duration(args.restart_time, "--restart-time")
    if gpu is None and node is None:
        given = [flag for flag, value in (("--checkpoint-time", checkpoint),
                                          ("--restart-time", restart),
                                          ("--checkpoint-every", args.checkpoint_every))
                 if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} cost{'s' * (len(given) == 1)} failures: give "
                              f"--mtbf (one GPU's) or --node-mtbf (one node's)")
    if gpu is not None and node is not None:
        raise ConfigError("give --mtbf (one GPU's) or --node-mtbf (one node's), not both")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise ConfigError(f"--checkpoint-every must be at least 1 (iterations); got "
                          f"{args.checkpoint_every}")
    return gpu, node, checkpoint, restart


def target(args: argparse.Namespace, runs: list[Run], optimizer: str | None) -> Failures | None:
    """``--mtbf`` and what goes with it (``check_arguments``), the costs taken from the runs
    where not given; None without ``--mtbf`` or ``--node-mtbf``."""
    gpu, node, checkpoint, restart = check_arguments(args)
    if gpu is None and node is None:
        return None
    recoveries = [run.recovery for run in runs]
    failures = Failures(gpu, node, 0.0, checkpoint, every=args.checkpoint_every,
                        optimizer=optimizer or "adamw")
    if restart is not None:
        failures.restart_s = restart
        failures.sources.append(f"restart {restart:g} s (--restart-time)")
    else:
        measured = [failure["recovery_s"] for recovery in recoveries
                    for failure in recovery.get("failures", []) if failure.get("recovery_s")]
        if not measured:
            raise ConfigError("--mtbf: give --restart-time (from a failure to useful work again), "
                              "or a run torchrun restarted from its checkpoint (its recovery)")
        failures.restart_s = statistics.median(measured)
        failures.sources.append(f"restart {failures.restart_s:.1f} s (the median recovery of "
                                f"{plural(len(measured), 'failure')} in the runs given)")
    if checkpoint is not None:
        failures.sources.append(f"checkpoint {checkpoint:g} s (--checkpoint-time)")
        return failures
    # the last attempt's saves, else an earlier attempt's (one that failed before it saved)
    saved = [(run, checkpoints) for run, recovery in zip(runs, recoveries)
             for checkpoints in [recovery.get("checkpoints")] + [
                 (((attempt.get("results") or {}).get("recovery") or {}).get("checkpoints"))
                 for attempt in recovery.get("attempts", [])]
             if (checkpoints or {}).get("bytes_per_s_per_trainer")]
    if saved:
        run, checkpoints = saved[0]
        failures.write_rate = checkpoints["bytes_per_s_per_trainer"]
        failures.run_bytes = checkpoints["bytes"]
        failures.run_gradient_bytes = run.gradient_bytes
        failures.sources.append(
            f"checkpoint: each trainer writes its share of {checkpoints['bytes']:,.0f} bytes "
            f"(scaled by the gradient bytes) at {failures.write_rate / 1e6:.1f} MB/s, as in "
            f"{run.path}")
        return failures
    raise ConfigError("--mtbf: give --checkpoint-time (what one checkpoint costs), or a run made "
                      "with --checkpoint-every (its trainers' write rate)")


def goodput_winners(rows: list[dict]) -> list[dict]:
    """At each trainer count, the strategy with the most goodput, and the fastest beside it."""
    best: dict[int, dict] = {}
    fastest: dict[int, dict] = {}
    for row in rows:
        if "goodput_samples_per_s" not in row or row.get("fits") is False \
                or HOOKS.record(row["strategy"]).transport is None:
            continue
        n = row["trainers"]
        if n not in best or row["goodput_samples_per_s"] > best[n]["goodput_samples_per_s"]:
            best[n] = row
        if n not in fastest or row["batch_ms"] < fastest[n]["batch_ms"]:
            fastest[n] = row
    return [{"trainers": n, "strategy": row["strategy"], "servers": row["servers"],
             "goodput_samples_per_s": row["goodput_samples_per_s"], "ettr": row["ettr"],
             "fastest": fastest[n]["strategy"]}
            for n, row in sorted(best.items())]


def render_goodput_winners(rows: list[dict]) -> str:
    lines = []
    for w in goodput_winners(rows):
        differs = (f" (the fastest, {w['fastest']}, keeps less)" if w["fastest"] != w["strategy"]
                   else " (also the fastest)")
        lines.append(f"most goodput at {w['trainers']} trainers: {w['strategy']}, "
                     f"{w['goodput_samples_per_s']:.0f} samples/s, ETTR {w['ettr']:.3f}{differs}")
    return "\n".join(lines)
