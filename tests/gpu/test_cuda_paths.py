"""Every CUDA path as a real job on this machine's GPU(s): NCCL, ``multi``, CUDA tensors over
TensorPipe device maps, compression on the GPU, floors, peak CUDA memory and CUDA-event timing.

Each job runs with ``--verify`` where it checks a strategy, and its results file is held to what
can be derived without running it: identical replicas where the strategy is lossless, and the
bytes each trainer and server moves from the model's DDP buckets. With one GPU, NCCL takes one
trainer; two-trainer strategies run with CUDA tensors over gloo (``--ncudatrainer 2``), the
trainers sharing the GPU.
"""

from __future__ import annotations

import math

import pytest

from ps_bench.metrics.costs import allreduce_bytes
from ps_bench.predict.inputs import model_buckets
from ps_bench.predict.memory import kept_bytes
from tests.benchrun import run_bench
from tests.contract import check_contract
from tests.gpu import GPUS

QUICK = ("--warmup-rounds", "1", "--rounds", "2")
# Two trainers that all-reduce on the GPU: NCCL where there are two GPUs, else gloo on CUDA tensors.
TWO_CUDA_TRAINERS = (("--backend", "nccl", "--ntrainer", "2") if GPUS >= 2 else
                     ("--backend", "gloo", "--ntrainer", "0", "--ncudatrainer", "2"))
STREAM_MISMATCH = "The AccumulateGrad node's stream does not match"
CUDA_RPC = ("--backend", "gloo", "--ntrainer", "0", "--ncudatrainer", "2", "--nserver", "0", "--ncudaserver", "1")


def buckets(results: dict) -> list[int]:
    """The dense bucket sizes (B) DDP built."""
    return [b["bytes"] for b in results["config"]["model_size"]["ddp_buckets"] if not b["sparse"]]


def allreduced(results: dict, trainers: int, halve: bool = False) -> int:
    """What a ring all-reduce of the run's buckets moves per trainer (each way)."""
    return sum(allreduce_bytes(size // 2 if halve else size, trainers) for size in buckets(results))


def job(bench_runs, *args: str) -> dict:
    run = bench_runs.get(*args, timeout_s=300)  # bench.py itself: its ranks' warnings are in its output
    assert run.returncode == 0, run.output
    results = run.results
    check_contract(results)
    assert results["env"]["cuda_devices"], "the run did not see the GPU"
    # every call to a trainer issues its work on one stream: backward feeds DDP's accumulators there
    assert STREAM_MISMATCH not in run.output
    return results


def lossless(results: dict) -> None:
    assert results["replicas"]["identical"] is True, results["replicas"]
    assert results["verify"]["buckets_checked"] > 0 and results["verify"]["grad_rel_error_max"] <= 1e-6


def test_nccl_all_reduce_with_one_trainer(bench_runs):
    results = job(bench_runs, "--backend", "nccl", "--ntrainer", "1", "--nserver", "0", "--hook", "allreduce",
                  "--verify", *QUICK)
    lossless(results)
    assert results["bytes"]["trainer_sent_per_iter"] == 0  # alone: nothing crosses a wire
    assert results["memory"]["trainer"]["peak_cuda_bytes"] > 0


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs or more: NCCL takes one GPU per trainer")
def test_nccl_all_reduce_with_a_trainer_on_every_gpu(bench_runs):
    results = job(bench_runs, "--backend", "nccl", "--ntrainer", str(GPUS), "--nserver", "0", "--hook", "allreduce",
                  "--verify", *QUICK)
    lossless(results)
    assert results["bytes"]["trainer_sent_per_iter"] == allreduced(results, GPUS)


def test_more_nccl_trainers_than_gpus_is_refused_before_anything_starts():
    run = run_bench("--backend", "nccl", "--ntrainer", str(GPUS + 1), "--nserver", "0", "--hook", "allreduce",
                    timeout_s=120)
    assert run.returncode == 2, run.output
    assert run.stderr.count("\n") == 1 and run.stdout == ""
    assert f"needs one GPU per trainer: {GPUS + 1} trainers on this node, {GPUS} GPUs" in run.stderr


@pytest.mark.parametrize("server", ["average", "average_batch"])
@pytest.mark.parametrize("mapping", ["shard", "group"])
def test_cuda_tensors_cross_rpc_through_device_maps(mapping, server, bench_runs):
    results = job(bench_runs, *CUDA_RPC, "--hook", "ps", "--mapping", mapping, "--server", server, "--verify",
                  *QUICK)
    lossless(results)
    dense = results["config"]["model_size"]["dense_gradient_bytes"]
    moved = results["bytes"]
    assert moved["trainer_sent_per_iter"] == moved["trainer_recv_per_iter"] == dense
    assert moved["server_recv_per_iter"] == moved["server_sent_per_iter"] == 2 * dense  # one server, two trainers
    assert results["memory"]["server"]["peak_cuda_bytes"] > 0  # the server added on the GPU


@pytest.mark.parametrize("hook, servers", [("ps_node", "2"), ("hierarchical", "0")])
def test_host_strategies_hand_ddp_finished_buckets_on_the_gpu(hook, servers, bench_runs):
    """4 trainers on the GPU, 2 a host, summing within the host over gloo on CUDA tensors (and,
    ps_node, pushing to CUDA servers through device maps): what DDP copies back into a bucket is
    the finished answer. A hook future that carried no CUDA events let DDP read buckets still
    being written (resnet18's replicas 1e-3 apart). A round of two iterations keeps one timed."""
    results = job(bench_runs, "--backend", "gloo", "--ntrainer", "0", "--ncudatrainer", "4",
                  "--per-host", "2", "--nserver", "0", "--ncudaserver", servers, "--hook", hook,
                  "--model", "resnet18", "--verify", *QUICK)
    lossless(results)
    assert 0 < results["verify"]["iterations"] < results["throughput"]["iterations"]
    assert any(row["role"] == "trainer" and row["metric"] == "batch" for row in results["summary"])


def test_rpc_floors_over_device_maps_send_cuda_tensors(bench_runs):
    """``--limits`` where the run's tensors cross RPC on the GPU: the RPC floor's do too. With CPU
    tensors the floor of resnet18's buckets took 41.8 ms p50 on an H100, above the 24.8 ms batch
    of the run it was the floor of."""
    results = job(bench_runs, *CUDA_RPC, "--hook", "ps", "--model", "resnet18", "--limits", *QUICK)
    floor = results["limits"]["rpc"]
    assert floor["tensors"] == "cuda", floor
    batch = next(r["p50"] for r in results["summary"] if r["role"] == "trainer" and r["metric"] == "batch")
    assert floor["p50_ms"] < batch, (floor, batch)


def test_pieces_sent_from_callbacks_on_the_gpu(bench_runs):
    """resnet18's buckets in 4 MiB pieces, one in flight: each piece after a bucket's first
    leaves from the callback of the one before, on the stream that cut it, not the callback's."""
    results = job(bench_runs, *CUDA_RPC, "--hook", "ps", "--model", "resnet18", "--hook-option",
                  "partition_mb=4", "--hook-option", "window=1", "--verify", *QUICK)
    lossless(results)


@pytest.mark.parametrize("hook, servers", [("hybrid", "0"), ("sparse_ps", "1"), ("ps", "2")])
def test_multi_backend_with_sparse_gradients(hook, servers, bench_runs):
    """Sparse gradients on ``multi``: gloo carries them, NCCL the dense ones. ``ps`` deals the
    dense pieces over both servers and the sparse bucket whole; ``--limits``'s collective floor
    all-gathers the sparse bucket, as gloo's sparse all-reduce does."""
    trainers = str(min(GPUS, 2))
    results = job(bench_runs, "--backend", "multi", "--ntrainer", trainers, "--nserver", servers, "--hook", hook,
                  "--model", "DummyModelSparse", "--data", "DummyData", "--verify", "--limits", *QUICK)
    lossless(results)
    assert results["config"]["model_size"]["sparse_gradient_bytes"] > 0
    sparse = [b["index"] for b in results["config"]["model_size"]["ddp_buckets"] if b["sparse"]]
    assert results["limits"]["collective"]["all_gathered"] == sparse
    if hook != "hybrid":
        assert results["bytes"]["server_recv_per_iter"] > 0  # the buckets went to the server(s)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd", "batched_powersgd", "topk"])
def test_compression_on_the_gpu(hook, bench_runs):
    """Lossy on the device and measured as such; what the strategy keeps between iterations
    (error feedback's residuals, PowerSGD's P and Q) counted from the hook's CUDA tensors, as
    predict counts it from the model on the meta device."""
    results = job(bench_runs, *TWO_CUDA_TRAINERS, "--nserver", "0", "--hook", hook, "--verify", *QUICK)
    assert results["replicas"]["identical"] is True, results["replicas"]
    assert results["verify"]["grad_rel_error_p50"] > 1e-6  # lossy, and measured as such
    sent = results["bytes"]["trainer_sent_per_iter"]
    if hook in ("fp16", "bf16"):
        assert sent == allreduced(results, 2, halve=True)
    else:
        assert 0 < sent < allreduced(results, 2)
    facts = model_buckets(results["config"]["model"], results["config"]["bucket_cap_mb"])[3]
    kept = results["memory"]["trainer"]["buffers_bytes"]
    assert kept == kept_bytes(hook, facts) and (kept > 0) == (hook not in ("fp16", "bf16")), kept


@pytest.mark.parametrize("args", [
    ("--backend", "nccl", "--ntrainer", "1", "--nserver", "0", "--hook", "allreduce", "--precision", "fp16"),
    (*CUDA_RPC, "--hook", "ps", "--precision", "bf16"),
], ids=["fp16-nccl", "bf16-cuda-rpc"])
def test_autocast_and_micro_batches_on_the_gpu(args, bench_runs):
    """--precision under torch.autocast on the device (fp16 with its gradient scaler), with the
    gradients of 2 micro-batches accumulated before they are synchronised; --limits's compute-only
    iteration does the same (micro-batches, autocast, scaler) with nothing synchronised."""
    results = job(bench_runs, *args, "--grad-accum", "2", "--batch-size", "8", "--verify", "--limits", *QUICK)
    assert results["replicas"]["identical"] is True, results["replicas"]
    assert results["config"]["grad_accum"] == 2 and results["throughput"]["samples_per_iteration"] == 16
    assert math.isfinite(results["loss"]["last"])  # the scaler kept fp16 from overflowing
    assert results["limits"]["compute"]["p50_ms"] > 0


def test_half_precision_to_a_cuda_server(bench_runs):
    results = job(bench_runs, *CUDA_RPC, "--hook", "ps_fp16", "--verify", *QUICK)
    assert results["replicas"]["identical"] is True
    dense = results["config"]["model_size"]["dense_gradient_bytes"]
    assert results["bytes"]["trainer_sent_per_iter"] * 2 == dense
    assert results["bytes"]["server_recv_per_iter"] == dense  # two trainers' halves


def test_floors_on_nccl_next_to_the_run(bench_runs):
    trainers = str(min(GPUS, 2))
    results = job(bench_runs, "--backend", "nccl", "--ntrainer", trainers, "--nserver", "0", "--hook", "allreduce",
                  "--limits", *QUICK)
    limits = results["limits"]
    assert limits["collective"]["backend"] == "nccl" and limits["collective"]["p50_ms"] > 0
    assert "busbw_gbps" in limits["collective"] and limits["compute"]["p50_ms"] > 0
    assert results["efficiency"]["floor"] == "collective"
    assert results["memory"]["trainer"]["peak_cuda_bytes"] > 0


@pytest.mark.parametrize("args", [CUDA_RPC + ("--hook", "ps"),
                                  ("--backend", "nccl", "--ntrainer", "1", "--nserver", "0", "--hook", "allreduce")],
                         ids=["ps-cuda-rpc", "allreduce-nccl"])
def test_a_zoo_model_on_the_gpu(args, bench_runs):
    results = job(bench_runs, *args, "--model", "resnet18", "--batch-size", "16", "--verify", *QUICK)
    lossless(results)
    assert results["config"]["model_size"]["parameters"] > 11_000_000


def test_gpu_batch_times_are_wall_clock_times(bench_runs, tmp_path):
    """CUDA events, synchronised before the clock is read: an iteration's batch time is the time it
    really took, so the p50 matches the round's wall-clock time per iteration (an unsynchronised
    reading would see only the kernel launches). The device's work must outlast the launches for
    that to show (ResNet-50 at 128 images, not ResNet-18 at 32, whose launches take as long as its
    kernels on an H200), and a round long enough that what it does after its last iteration (the
    master's call, the samples gathered) is a few per cent of it. Under ``--profile`` the traced
    iterations (the profiler's start alone takes most of a second on a GPU) are left out of the
    throughput as of the batch samples, so samples/s still says the same."""
    results = job(bench_runs, "--backend", "nccl", "--ntrainer", "1", "--nserver", "0", "--hook", "allreduce",
                  "--model", "resnet50", "--batch-size", "128", "--epochs", "32",
                  "--profile", str(tmp_path / "traces"), *QUICK)
    batch = next(r for r in results["summary"] if r["role"] == "trainer" and r["metric"] == "batch")
    throughput = results["throughput"]
    assert throughput["untimed_s"] > 0
    wall_ms = 1000 * throughput["samples_per_iteration"] / throughput["samples_per_s"]  # one trainer
    assert batch["p50"] == pytest.approx(wall_ms, rel=0.10), (batch, wall_ms)


def test_a_gpu_run_records_its_bucket_timeline_on_the_devices_clock(bench_runs):
    """CUDA events recorded as DDP hands each bucket over: every bucket of resnet18 has a ready
    time within backward, in the order DDP built them, which is what ``predict --compute`` reads."""
    results = job(bench_runs, "--backend", "nccl", "--ntrainer", "1", "--nserver", "0", "--hook", "allreduce",
                  "--model", "resnet18", "--batch-size", "32", "--epochs", "8", *QUICK)
    backward = next(r["p50"] for r in results["summary"] if r["role"] == "trainer" and r["metric"] == "backward")
    timeline = results["timeline"]
    assert timeline and len(timeline) == len(buckets(results)), timeline
    assert [row["index"] for row in timeline] == sorted(row["index"] for row in timeline)
    for row in timeline:
        assert 0 < row["ready_ms"] <= row["done_ms"] <= backward * 1.5, (row, backward)
