"""Real runs: every rank is a process, RPC and collectives go over loopback."""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess

import pytest

from ps_bench.metrics.limits import repeats_per_round as floor_repeats_per_round
from ps_bench.servers import AVERAGING
from ps_bench.strategies import HOOKS
from tests.benchrun import ROOT, run_bench
from tests.contract import SERVER_METRICS, TRAINER_METRICS, check_contract, metrics_of

QUICK = ("--warmup-rounds", "1", "--rounds", "2")
# Servers and mappings matter only to the lossless strategies that use servers (every server, both
# mappings); the other strategies that reach the exact mean run once; all on a model with sparse
# gradients, 3 trainers and 2 servers (so the group mapping has a group of two and one of one).
# Strategies that group trainers by host (ps_node) need hosts of several trainers: tests/integration/test_families.py.
SERVER_STRATEGIES = [name for name in HOOKS.names() if HOOKS.record(name).needs_servers and HOOKS.record(name).lossless
                     and not HOOKS.record(name).per_host]
CASES = [(*case, ()) for case in itertools.product(SERVER_STRATEGIES, AVERAGING, ("shard", "group"))]
# hybrid held to its floor: its sparse bucket all-gathered among the 3 trainers, as gloo sends it
CASES += [(hook, "average", "shard", ("--limits",) if hook == "hybrid" else ()) for hook in HOOKS.names()
          if hook not in SERVER_STRATEGIES and HOOKS.record(hook).takes_servers
          and (HOOKS.record(hook).lossless or HOOKS.record(hook).transport is None) and not HOOKS.record(hook).per_host]
CASES += [("ps", "average", "shard", ("--bucket-cap-mb", "0.001"))]  # many buckets, owners balanced over servers


def case_run(bench_runs, hook: str, server: str, mapping: str, extra: tuple[str, ...]) -> dict:
    return bench_runs.ok("--hook", hook, "--server", server, "--mapping", mapping, "--ntrainer", "3", "--nserver",
                         "2", "--model", "DummyModelSmallSparse", *QUICK, *extra, timeout_s=120)


@pytest.mark.parametrize("hook, server, mapping, extra", CASES, ids=["-".join(c[:3] + c[3][:1]) for c in CASES])
def test_every_hook_server_and_mapping_on_gloo(hook, server, mapping, extra, bench_runs):
    results = case_run(bench_runs, hook, server, mapping, extra)
    check_contract(results)
    assert results["config"]["hook"] == hook and results["config"]["mapping"] == mapping
    assert metrics_of(results, "trainer") == TRAINER_METRICS
    moved = results["bytes"]
    if hook in SERVER_STRATEGIES:
        assert metrics_of(results, "server") == SERVER_METRICS
        assert moved["trainer_sent_per_iter"] > 0 and moved["server_recv_per_iter"] > 0
        # of 2 servers, the busiest receives from the mean to all of it
        mean, busiest = moved["server_recv_per_iter"], moved["server_recv_busiest_per_iter"]
        assert mean * (1 - 1e-9) <= busiest <= 2 * mean * (1 + 1e-9)
        if "--bucket-cap-mb" in extra:  # many buckets, owned by both servers: each a quarter or more
            assert busiest <= 1.5 * mean, moved
    else:
        assert metrics_of(results, "server") == set()
        assert moved["server_recv_per_iter"] == moved["server_recv_busiest_per_iter"] == 0
    if "--limits" in extra:  # one sparse bucket (the embedding's), one dense
        floors = results["limits"]
        assert floors["buckets"] == 2 and len(floors["collective"]["all_gathered"]) == 1
        gathered, = [bucket["bytes"] for bucket in results["config"]["model_size"]["ddp_buckets"]
                     if bucket["index"] in floors["collective"]["all_gathered"]]
        collective = floors["collective"]  # busbw: each trainer's link, 2(n-1)/n dense and n-1 gathered
        link_bytes = 2 * 2 / 3 * (floors["bytes_per_iter"] - gathered) + 2 * gathered
        assert collective["busbw_gbps"] == pytest.approx(link_bytes / collective["p50_ms"] / 1e6)
        assert results["efficiency"]["floor_of"] == "its float32 buckets"
        assert results["efficiency"]["value"] > 0
    if HOOKS.record(hook).transport is None:
        assert moved["trainer_sent_per_iter"] == 0
        assert results["replicas"]["identical"] is False  # no communication: replicas drift apart
    else:
        assert results["replicas"]["identical"] is True, results["replicas"]
        assert results["replicas"]["max_abs_diff"] == 0.0


def test_every_lossless_way_reaches_the_same_parameters(bench_runs):
    """Every lossless strategy, server and mapping trains the same model from the same seed to the
    same parameters as all-reduce: fails if servers summed (or averaged only their group) instead
    of averaging, or if a strategy mishandled sparse gradients."""
    norms = {"-".join(case[:3] + case[3][:1]): case_run(bench_runs, *case)["replicas"]["param_norm"]
             for case in CASES if HOOKS.record(case[0]).lossless}
    reference = norms["allreduce-average-shard"]
    assert len(norms) >= 10
    for name, norm in norms.items():
        assert abs(norm - reference) / reference < 1e-5, norms


def test_a_sparse_all_reduce_counts_what_gloo_sends(bench_runs):
    """gloo sums a sparse gradient's repeated rows before it gathers it, as sparse_ps does before
    it sends it to a server; the same seed makes the same lookups in both runs, so all-reduce's
    extra bytes (each trainer's rows to 2 others, not to one server) are sparse_ps's rows at the
    servers (mean per server of 2, from 3 trainers) times 2/3."""
    allreduce = case_run(bench_runs, "allreduce", "average", "shard", ())["bytes"]
    servers = case_run(bench_runs, "sparse_ps", "average", "shard", ())["bytes"]
    rows = servers["server_recv_per_iter"]
    assert rows > 0
    assert allreduce["trainer_sent_per_iter"] - servers["trainer_sent_per_iter"] == pytest.approx(rows * 2 / 3)


def test_default_run_prints_tables_and_results_path(bench_runs):
    run = bench_runs.get()  # the default run, shared
    assert run.returncode == 0, run.output
    for text in ("Trainers (timed rounds)", "Parameter servers (timed rounds)", "bytes_sent", "p50", "p90", "p99",
                 "[round 1/6] warmup", "[round 6/6] timed", f"results: {run.out}"):
        assert text in run.stdout, text
    assert "replicas: identical=true" in run.stdout
    check_contract(run.results)
    assert run.results["throughput"]["iterations"] == 5 * (1024 // 2 // 16)


def test_same_seed_same_result(bench_runs, results_path):
    first = bench_runs.ok()
    again = run_bench(out=results_path)
    assert again.returncode == 0, again.output
    assert again.results["replicas"]["param_norm"] == first["replicas"]["param_norm"]
    assert again.results["loss"] == first["loss"]


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
    assert "ps_bench: warning: --warmup-rounds 0 of " in run.stderr  # its first iterations are timed


def test_run_config_file_with_command_line_override_and_a_file_kept(tmp_path, results_path):
    """--config fills what the command line leaves out; an existing results file is never overwritten."""
    config = tmp_path / "run.json"
    config.write_text('{"ntrainer": 3, "hook": "allreduce", "rounds": 4, "nserver": 0}')
    results_path.write_text("keep me")
    run = run_bench("--config", str(config), "--rounds", "1", out=results_path)
    assert run.returncode == 0, run.output
    assert run.results["config"]["ntrainer"] == 3 and run.results["config"]["rounds"] == 1
    assert "--warmup-rounds" not in run.stderr  # its warmup round covers DDP's first iterations
    assert results_path.read_text() == "keep me"
    suffixed = results_path.with_name("results-1.json")
    assert f"results: {suffixed}" in run.stdout
    assert json.loads(suffixed.read_text())["status"] == "ok"


def test_cuda_backend_without_gpu_is_one_line_exit_2():
    run = run_bench("--backend", "nccl", timeout_s=60)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "CUDA" in run.stderr and "GPU" in run.stderr
    assert run.stdout == ""


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_wrong_process_count_under_torchrun():
    command = ["torchrun", "--standalone", "--nproc-per-node", "3", "bench.py"]
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert process.returncode != 0
    assert "torchrun started 3 processes but this run needs 4 (2 trainers + 1 server + 1 master)" in process.stderr


def test_limits_memory_profile_and_per_rank_tables_in_one_run(tmp_path):
    """--limits measures every floor with the run's buckets; memory per role; one trace per trainer;
    --per-rank adds a row per rank to the printed tables."""
    traces = tmp_path / "traces"
    run = run_bench("--limits", "--profile", str(traces), "--per-rank", *QUICK, out=tmp_path / "run.json",
                    timeout_s=180)
    assert run.returncode == 0, run.output
    # tracing is quiet: no Kineto line at each start and stop, no warning at each RPC it traces
    assert "profiler_start" not in run.output and "Profiling a distributed call" not in run.output, run.output
    assert "trainer 0" in run.stdout and "trainer 1" in run.stdout and "server 2" in run.stdout
    assert f"traces: {traces}/trainer<index>-rank<rank>.json, one a trainer" in run.stdout  # where they went
    results = run.results
    check_contract(results)
    assert results["replicas"]["identical"] is True
    limits = results["limits"]
    assert limits["bytes_per_iter"] == results["bytes"]["trainer_sent_per_iter"] > 0
    assert limits["buckets"] >= 1
    for floor in (limits["rpc"], limits["collective"]):  # sampled after each of the 2 timed rounds, 2 trainers
        assert floor["count"] == 2 * 2 * floor_repeats_per_round(2) and floor["p50_ms"] > 0 and floor["algbw_gbps"] > 0
    assert limits["collective"]["busbw_gbps"] == limits["collective"]["algbw_gbps"]  # 2 trainers: 2(n-1)/n = 1
    assert limits["rpc"]["tensors"] == "cpu"  # the run's tensors cross RPC on the CPU
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
    assert sorted(p.name for p in traces.iterdir()) == ["trainer0-rank0.json", "trainer0-rank0.txt",
                                                        "trainer1-rank1.json", "trainer1-rank1.txt"]
    summary = (traces / "trainer0-rank0.txt").read_text()  # torch's table of the operators by self CPU time
    assert summary.startswith("The traced iterations' operators by self CPU time") and "Self CPU time total" in summary
    assert "aten::addmm" in summary or "aten::mm" in summary
    trace = json.loads((traces / "trainer0-rank0.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "autograd::engine::evaluate_function: AddmmBackward0" in names or any("Backward" in str(n) for n in names)
    # the traced iterations are left out of the samples, and of the throughput: their samples and
    # their wall time (the profiler's start and the trace's writing in it)
    assert batch["count"] == 2 * (2 * 32 - 3)
    throughput = results["throughput"]
    assert throughput["untimed_s"] > 0
    assert f"less the iterations --profile traced ({throughput['untimed_s']:.2f} s)" in run.stdout
    timed_samples = batch["count"] * throughput["samples_per_iteration"]
    assert throughput["samples_per_s"] * throughput["timed_s"] == pytest.approx(timed_samples)
    assert throughput["timed_s"] * 1000 >= batch["mean"] * batch["count"] / 2  # each trainer's batches fit


def test_the_gpu_check_without_a_gpu_is_one_line_exit_2(tmp_path):
    check = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "report")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 2 and check.stdout == ""
    assert check.stderr.count("\n") == 1 and "no GPU here" in check.stderr
    assert not (tmp_path / "report").exists()  # nothing was made


def test_trace_writes_every_ranks_trace_and_one_merged_on_one_clock(tmp_path, bench_runs):
    """``--trace``: the last timed round's traces, a file a rank, and merged.json with every rank as
    a process of its own. ps_bench's spans (each traced iteration's phases and buckets on the
    trainers, each piece's receiving and aggregation on the servers) sit on the same clock as the
    profiler's operators: DDP's forward inside ps_bench's forward span; and across processes, a
    server aggregates a piece only after both trainers handed a bucket over."""
    folder = tmp_path / "traces"
    results = bench_runs.ok("--hook", "ps", "--nserver", "2", "--ntrainer", "2", "--model", "DummyModel", "--data",
                            "DummyData", "--rounds", "1", "--warmup-rounds", "0", "--trace", str(folder))
    assert results["config"]["trace"] == str(folder)  # tracing on, said in the results
    assert {path.name for path in folder.iterdir()} == {
        "merged.json", "trainer0-rank0.json", "trainer0-rank0.txt", "trainer1-rank1.json", "trainer1-rank1.txt",
        "server0-rank2.json", "server1-rank3.json"}
    merged = json.loads((folder / "merged.json").read_text())
    assert [rank["rank"] for rank in merged["ps_bench"]["ranks"]] == [0, 1, 2, 3]
    # every rank's clock measured against the master's: here the one clock of one machine
    assert [(clock["rank"], clock["shared"]) for clock in results["env"]["clocks"]] == [(r, True) for r in range(4)]
    assert all(rank["ahead_of_master_us"] == 0 for rank in merged["ps_bench"]["ranks"])
    events = merged["traceEvents"]
    names = {event["pid"]: event["args"]["name"] for event in events if event.get("name") == "process_name"}
    assert names == {0: "trainer 0 (rank 0)", 1: "trainer 1 (rank 1)", 2: "server 0 (rank 2)", 3: "server 1 (rank 3)"}
    ours = [event for event in events if event.get("cat") == "ps_bench"]
    for trainer in (0, 1):
        spans = [event["name"] for event in ours if event["pid"] == trainer]
        assert spans.count("forward") == spans.count("backward") == spans.count("optimizer") == 3
        assert {"bucket 0", "bucket 1"} <= set(spans)
    forwards = [event for event in ours if event["pid"] == 0 and event["name"] == "forward"]
    ddp = [event for event in events if event["pid"] == 0 and event.get("name") == "DistributedDataParallel.forward"]
    assert len(ddp) == 3 and all(any(span["ts"] - 1e3 <= op["ts"] <= span["ts"] + span["dur"] for span in forwards)
                                 for op in ddp)
    handed = {trainer: sorted(event["ts"] for event in ours if event["pid"] == trainer
                              and event["name"].startswith("bucket")) for trainer in (0, 1)}
    window = (min(min(times) for times in handed.values()), max(max(times) for times in handed.values()))
    aggregated = [event for event in ours if event["pid"] in (2, 3) and event["name"].endswith("aggregate and answer")
                  and window[0] <= event["ts"] <= window[1]]
    assert aggregated
    longest = max(event["dur"] for event in ours if event["name"].startswith("iteration"))
    for event in aggregated:  # both trainers had handed a bucket over by then, in that iteration
        for times in handed.values():
            before = [ts for ts in times if ts <= event["ts"]]
            assert before and event["ts"] - before[-1] <= longest, (event, times)
