"""The results-file contract (``ps_bench.result/1``) other tools rely on, checked alike on files
that real runs wrote and on what ``RunRecord`` builds from made-up rounds."""

from __future__ import annotations

import json

SCHEMA = "ps_bench.result/1"
TOP_LEVEL = {"schema", "status", "started", "finished", "argv", "config", "env", "summary", "throughput", "bytes",
             "replicas", "samples", "restarts", "recovered", "rounds_completed", "loss", "memory", "timeline"}
FAILED_MINIMUM = {"schema", "status", "error", "started", "finished", "argv", "config", "env", "rounds_completed",
                  "summary"}
ENV = {"torch", "python", "hostname", "cuda_devices", "backend"}
STATS = {"role", "metric", "unit", "count", "mean", "std", "min", "p50", "p90", "p99", "max"}
BYTES = {"trainer_sent_per_iter", "trainer_recv_per_iter", "server_recv_per_iter", "server_sent_per_iter",
         "server_recv_busiest_per_iter"}
TRAINER_METRICS = {"batch", "forward", "backward", "optimizer", "comm", "exposed"}  # exposed: CPU runs
SERVER_METRICS = {"straggler", "aggregate", "round"}
CONVERGENCE = {"target_loss", "reached", "iterations", "seconds", "stopped_by", "diverged", "final_loss", "smoothing",
               "max_iterations", "labels", "loss_curve", "held_out"}


def check_contract(results: dict, status: str = "ok") -> None:
    """A finished run's results object (``status`` ok, or failed after some rounds)."""
    assert results["schema"] == SCHEMA
    assert results["status"] == status
    assert ("error" in results) == (status == "failed")
    missing = TOP_LEVEL - set(results)
    assert not missing, f"missing keys: {sorted(missing)}"
    assert set(results["env"]) >= ENV
    for row in results["summary"]:
        assert set(row) == STATS and row["unit"] == "ms" and row["count"] > 0
        assert row["min"] <= row["p50"] <= row["p90"] <= row["p99"] <= row["max"]
    assert set(results["bytes"]) == BYTES
    for role in ("trainer", "server"):  # what each process of the role holds, where it counted
        states = (results["memory"][role] or {}).get("model_states")
        if states is not None:
            assert set(states) == {"parameters_bytes", "gradients_bytes", "optimizer_bytes", "total_bytes"}
            assert states["total_bytes"] == sum(v for k, v in states.items() if k != "total_bytes")
    for bucket in results["timeline"] or []:
        assert set(bucket) - {"held_ms"} == {"index", "bytes", "ready_ms", "done_ms"} and bucket["ready_ms"] <= bucket["done_ms"]
        # each sample's hold ends before its bucket is done: so do their medians
        assert 0 <= bucket.get("held_ms", 0) <= bucket["done_ms"]
    for clock in results["env"].get("clocks", []):  # each rank's clock against the master's
        assert set(clock) == {"rank", "role", "index", "offset_ms", "error_ms", "measured_ms", "trip_ms", "shared"}
        assert clock["trip_ms"] > 0
        if clock["shared"]:  # one clock read within the round trip: never further than half of it
            assert clock["offset_ms"] == clock["error_ms"] == 0 and abs(clock["measured_ms"]) <= clock["trip_ms"] / 2
        else:
            assert clock["offset_ms"] == clock["measured_ms"] and clock["error_ms"] == clock["trip_ms"] / 2
    for piece in results.get("server_timeline") or []:  # each median of ordered samples
        assert set(piece) == {"server", "slice", "piece", "first_ms", "last_ms", "answered_ms"}
        assert piece["first_ms"] <= piece["last_ms"] <= piece["answered_ms"]
    if "convergence" in results:
        check_convergence(results["convergence"])
    if "staleness" in results:
        stale = results["staleness"]
        assert set(stale) == {"bound", "updates", "p50", "p99", "max", "servers"}
        assert stale["updates"] == 0 or stale["p50"] <= stale["p99"] <= stale["max"]
        if stale["bound"] != "inf" and stale["updates"]:
            assert stale["max"] <= int(stale["bound"])
        assert results["replicas"]["identical"] is None  # one model, on the servers
    if status == "ok":
        assert set(results["replicas"]) == {"identical", "param_norm", "max_abs_diff", "checked_at"}
        assert results["replicas"]["checked_at"] in (None, "every iteration", "the last synchronisation",
                                                     "gathered full parameters")
        assert results["throughput"]["samples_per_s"] > 0
    json.dumps(results)  # plain JSON all the way down


def check_convergence(convergence: dict) -> None:
    """A --target-loss run's block: curves of [iterations, seconds, loss] in order, the answer on them."""
    assert set(convergence) == CONVERGENCE
    assert convergence["stopped_by"] in ("target", "diverged", "max_iterations", "unfinished")
    assert convergence["reached"] == (convergence["stopped_by"] == "target")
    for curve in (convergence["loss_curve"], convergence["held_out"]):
        assert all(len(point) == 3 for point in curve)
        assert [p[0] for p in curve] == sorted(p[0] for p in curve) and [p[1] for p in curve] == sorted(p[1] for p in curve)
    if convergence["loss_curve"]:
        assert convergence["iterations"] <= convergence["loss_curve"][-1][0] <= convergence["max_iterations"]


def check_failed_minimum(results: dict) -> None:
    """A failed run with nothing of its own to report still says what was asked and why it failed."""
    assert results["schema"] == SCHEMA and results["status"] == "failed" and results["error"]
    missing = FAILED_MINIMUM - set(results)
    assert not missing, f"missing keys: {sorted(missing)}"
    assert results["rounds_completed"] == 0 and results["summary"] == []
    json.dumps(results)


def metrics_of(results: dict, role: str) -> set[str]:
    return {row["metric"] for row in results["summary"] if row["role"] == role}
