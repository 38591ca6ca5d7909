"""Real runs: every rank is a process, RPC and collectives go over loopback."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess

import pytest

from benchrun import ROOT, run_bench
from ps_bench.metrics.limits import repeats_per_round as floor_repeats_per_round

pytestmark = pytest.mark.integration

QUICK = ("--warmup-rounds", "1", "--rounds", "2")
TRAINER_METRICS = {"batch", "forward", "backward", "optimizer", "comm"}
SERVER_METRICS = {"straggler", "aggregate", "round"}
STATS = {"role", "metric", "unit", "count", "mean", "std", "min", "p50", "p90", "p99", "max"}


def check_contract(results: dict) -> None:
    """The results-file contract other tools rely on."""
    assert results["schema"] == "ps_bench.result/1"
    assert results["status"] == "ok"
    for key in ("started", "finished", "argv", "config", "env", "summary", "throughput", "bytes", "replicas", "samples"):
        assert key in results, key
    assert set(results["env"]) >= {"torch", "python", "hostname", "cuda_devices", "backend"}
    for row in results["summary"]:
        assert set(row) == STATS and row["unit"] == "ms" and row["count"] > 0
        assert row["min"] <= row["p50"] <= row["p90"] <= row["p99"] <= row["max"]
    assert set(results["bytes"]) == {"trainer_sent_per_iter", "trainer_recv_per_iter",
                                     "server_recv_per_iter", "server_sent_per_iter"}
    assert set(results["replicas"]) == {"identical", "param_norm", "max_abs_diff"}
    assert results["throughput"]["samples_per_s"] > 0


def metrics_of(results: dict, role: str) -> set[str]:
    return {row["metric"] for row in results["summary"] if row["role"] == role}


# Servers and mappings matter only to the hooks that use servers; the others run once.
CASES = list(itertools.product(("ps", "sparse_ps"), ("average", "average_batch"), ("shard", "group")))
CASES += [("allreduce", "average", "shard"), ("noop", "average", "shard")]


@pytest.mark.parametrize("hook, server, mapping", CASES, ids=["-".join(c) for c in CASES])
def test_every_hook_server_and_mapping_on_gloo(hook, server, mapping, results_path):
    run = run_bench("--hook", hook, "--server", server, "--mapping", mapping, "--ntrainer", "3", "--nserver", "2",
                    "--model", "DummyModelSmallSparse", *QUICK, out=results_path, timeout_s=120)
    assert run.returncode == 0, run.output
    results = run.results
    check_contract(results)
    assert results["config"]["hook"] == hook and results["config"]["mapping"] == mapping
    assert metrics_of(results, "trainer") == TRAINER_METRICS
    moved = results["bytes"]
    if hook in ("ps", "sparse_ps"):
        assert metrics_of(results, "server") == SERVER_METRICS
        assert moved["trainer_sent_per_iter"] > 0 and moved["server_recv_per_iter"] > 0
    else:
        assert metrics_of(results, "server") == set()
        assert moved["server_recv_per_iter"] == 0
    if hook == "noop":
        assert moved["trainer_sent_per_iter"] == 0
        assert results["replicas"]["identical"] is False  # no communication: replicas drift apart
    else:
        assert results["replicas"]["identical"] is True, results["replicas"]
        assert results["replicas"]["max_abs_diff"] == 0.0


def test_parameter_servers_and_allreduce_reach_the_same_parameters(tmp_path):
    """Fails if servers summed (or averaged only their group) instead of averaging."""
    norms = {}
    for name, args in {
        "allreduce": ("--hook", "allreduce"),
        "ps-group": ("--hook", "ps", "--mapping", "group"),
        "ps-shard": ("--hook", "ps", "--mapping", "shard", "--bucket-cap-mb", "0.001"),
        "ps-batch": ("--hook", "ps", "--server", "average_batch", "--mapping", "group"),
    }.items():
        run = run_bench("--ntrainer", "3", "--nserver", "2", "--torch-seed", "7", *QUICK, *args,
                        out=tmp_path / f"{name}.json", timeout_s=120)
        assert run.returncode == 0, run.output
        assert run.results["replicas"]["identical"] is True
        norms[name] = run.results["replicas"]["param_norm"]
    reference = norms["allreduce"]
    for name, norm in norms.items():
        assert abs(norm - reference) / reference < 1e-5, norms


def test_same_seed_same_result(tmp_path):
    norms = [run_bench("--torch-seed", "3", *QUICK, out=tmp_path / f"{i}.json").results["replicas"]["param_norm"]
             for i in range(2)]
    assert norms[0] == norms[1]


def test_default_run_prints_tables_and_results_path(results_path):
    run = run_bench(out=results_path, timeout_s=120)
    assert run.returncode == 0, run.output
    for text in ("Trainers (timed rounds)", "Parameter servers (timed rounds)", "bytes_sent", "p50", "p90", "p99",
                 "[round 1/6] warmup", "[round 6/6] timed", f"results: {results_path}"):
        assert text in run.stdout, text
    assert "replicas: identical=true" in run.stdout
    check_contract(run.results)
    assert run.results["throughput"]["iterations"] == 5 * (1024 // 2 // 16)


def test_per_rank_tables(results_path):
    run = run_bench("--per-rank", *QUICK, out=results_path)
    assert run.returncode == 0
    assert "trainer 0" in run.stdout and "trainer 1" in run.stdout and "server 2" in run.stdout


def test_upstream_experiment_command_line_runs(results_path):
    """What upstream's experiment scripts pass, unchanged, on upstream's own data and model sizes
    (plus ps_bench's --rounds, to keep the test short)."""
    run = run_bench(
        "--ntrainer=2", "--ncudatrainer=0", "--nserver=1", "--ncudaserver=0", "--server=AverageParameterServer",
        "--trainer=DdpTrainer", "--ddp_hook=sparse_rpc_hook", "--backend=gloo", "--epochs=1", "--batch_size=32",
        "--data=DummyData", "--model=DummyModelSparse", "--data_config_path=configs/data_configurations.json",
        "--model_config_path=configs/model_configurations.json", "--filestore=/tmp/filestore", "--create_criterion=cel",
        "--create_ddp_model=basic_ddp_model", "--create_optimizer=sgd_optimizer",
        "--preprocess_data=preprocess_dummy_data", "--iteration_step=basic_iteration_step",
        "--hook_state=BasicHookState", "--lr=1e-4", "--master_addr=localhost", "--torch_seed=1", "--rpc_timeout=120",
        "--warmup-rounds", "0", "--rounds", "1", out=results_path,
    )
    assert run.returncode == 0, run.output
    config = run.results["config"]
    assert (config["hook"], config["server"], config["trainer"]) == ("sparse_ps", "average", "ddp")
    assert config["model_size"]["parameters"] == 9_445_376  # upstream's DummyModel sizes
    assert run.results["replicas"]["identical"] is True
    assert "model DummyModelSparse: 9,445,376 parameters" in run.stdout


def test_run_config_file_with_command_line_override(tmp_path, results_path):
    config = tmp_path / "run.json"
    config.write_text('{"ntrainer": 3, "hook": "allreduce", "rounds": 4, "nserver": 0}')
    run = run_bench("--config", str(config), "--rounds", "1", out=results_path)
    assert run.returncode == 0, run.output
    assert run.results["config"]["ntrainer"] == 3 and run.results["config"]["rounds"] == 1


def test_cuda_backend_without_gpu_is_one_line_exit_2():
    run = run_bench("--backend", "nccl", timeout_s=60)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "CUDA" in run.stderr and "GPU" in run.stderr
    assert run.stdout == ""


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_under_torchrun(results_path):
    command = ["torchrun", "--standalone", "--nproc-per-node", "4", "bench.py", *QUICK, "--out", str(results_path)]
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert process.returncode == 0, process.stdout + process.stderr
    assert "results:" in process.stdout
    assert results_path.exists()


def test_wrong_process_count_under_torchrun():
    command = ["torchrun", "--standalone", "--nproc-per-node", "3", "bench.py"]
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert process.returncode != 0
    assert "torchrun started 3 processes but this run needs 4" in process.stderr


def test_limits_memory_and_profile_in_one_run(tmp_path):
    """--limits measures every floor with the run's buckets; memory per role; one trace per trainer."""
    traces = tmp_path / "traces"
    run = run_bench("--limits", "--profile", str(traces), *QUICK, out=tmp_path / "run.json", timeout_s=180)
    assert run.returncode == 0, run.output
    results = run.results
    check_contract(results)
    assert results["replicas"]["identical"] is True
    limits = results["limits"]
    assert limits["bytes_per_iter"] == results["bytes"]["trainer_sent_per_iter"] > 0
    assert limits["buckets"] >= 1
    for floor in (limits["rpc"], limits["collective"]):  # sampled after each of the 2 timed rounds, 2 trainers
        assert floor["count"] == 2 * 2 * floor_repeats_per_round(2) and floor["p50_ms"] > 0 and floor["algbw_gbps"] > 0
    assert limits["collective"]["busbw_gbps"] == limits["collective"]["algbw_gbps"]  # 2 trainers: 2(n-1)/n = 1
    assert limits["memcpy"]["gbps"] > 0 and limits["compute"]["p50_ms"] > 0
    efficiency = results["efficiency"]
    assert efficiency["floor"] == "rpc" and efficiency["floor_ms"] == limits["rpc"]["p50_ms"]
    comm = next(r for r in results["summary"] if r["role"] == "trainer" and r["metric"] == "comm")
    assert efficiency["cost_ms"] == comm["p50"] and efficiency["value"] == efficiency["floor_ms"] / comm["p50"]
    batch = next(r for r in results["summary"] if r["role"] == "trainer" and r["metric"] == "batch")
    assert efficiency["exposed_ms"] == max(0.0, batch["p50"] - limits["compute"]["p50_ms"])
    for role in ("trainer", "server", "master"):
        assert results["memory"][role]["peak_rss_bytes"] > 10 * 2**20
        assert results["memory"][role]["peak_cuda_bytes"] is None
    assert "samples taken after each timed round" in run.stdout and "efficiency: " in run.stdout
    assert "peak RSS MiB" in run.stdout
    assert sorted(p.name for p in traces.iterdir()) == ["trainer0-rank0.json", "trainer1-rank1.json"]
    trace = json.loads((traces / "trainer0-rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "autograd::engine::evaluate_function: AddmmBackward0" in names or any("Backward" in str(n) for n in names)
    # the traced iterations are left out of the samples
    assert batch["count"] == 2 * (2 * 32 - 3)
