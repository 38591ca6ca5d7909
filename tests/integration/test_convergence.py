"""Time to a target loss, for real: trainers on learnable data until the averaged model's
smoothed loss meets the target, recorded, reported and plotted."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ps_bench.metrics.wire import ByteCounter
from ps_bench.metrics.stats import SMOOTHING
from ps_bench.trainers.convergence import Convergence
from tests.benchrun import ROOT
from tests.contract import check_contract

# measured on the development machine (configs/sweeps/convergence_lr.json): at this learning rate
# allreduce reaches 0.2 after 265 iterations, and noop's replicas diverge after about 250
TARGET, LR, WITHIN = "0.2", "0.4", 350
COMMON = ("--target-loss", TARGET, "--lr", LR, "--max-iterations", "600")


def run(bench_runs, hook: str) -> dict:
    servers = ("--nserver", "0") if hook in ("allreduce", "noop") else ("--nserver", "1")
    results = bench_runs.ok("--hook", hook, *servers, *COMMON, timeout_s=180)
    check_contract(results)
    return results


def test_allreduce_reaches_the_target_and_says_when(bench_runs):
    results = run(bench_runs, "allreduce")
    convergence = results["convergence"]
    assert convergence["reached"] is True and convergence["stopped_by"] == "target"
    assert SMOOTHING <= convergence["iterations"] < WITHIN
    curve = convergence["loss_curve"]
    assert [point[0] for point in curve] == list(range(convergence["iterations"] + 1))
    seconds = [point[1] for point in curve]
    assert seconds[0] == 0 and all(b > a for a, b in zip(seconds, seconds[1:]))
    assert convergence["seconds"] == seconds[-1]
    assert convergence["final_loss"] <= float(TARGET) < sum(p[2] for p in curve[-SMOOTHING - 1:-1]) / SMOOTHING
    assert curve[0][2] >= 10 * convergence["final_loss"]  # learnable: ten times lower within a few hundred
    held_out = convergence["held_out"]
    assert held_out[0][0] == 0 and held_out[-1][0] == convergence["iterations"] and len(held_out) >= 3
    assert held_out[-1][2] < held_out[0][2] / 2
    assert results["config"]["labels"] == "teacher"


def test_lossless_parameter_servers_reach_it_in_the_same_iterations(bench_runs):
    allreduce, ps = run(bench_runs, "allreduce")["convergence"], run(bench_runs, "ps")["convergence"]
    assert ps["reached"] and ps["iterations"] == allreduce["iterations"]
    for mine, theirs in zip(ps["loss_curve"], allreduce["loss_curve"]):
        assert mine[2] == pytest.approx(theirs[2], rel=1e-5, abs=1e-6)


def test_no_communication_never_reaches_it_and_says_so(bench_runs):
    """At the learning rate synchronous training sustains for its global batch, noop's
    replicas, each stepping on its own batch alone, diverge: the run ends ok, not reached."""
    noop, allreduce = run(bench_runs, "noop"), run(bench_runs, "allreduce")["convergence"]
    assert noop["status"] == "ok" and noop["replicas"]["identical"] is False
    convergence = noop["convergence"]
    assert convergence["reached"] is False and convergence["stopped_by"] == "diverged"
    assert convergence["iterations"] < 600 and convergence["final_loss"] is None
    losses = [loss for _, _, loss in convergence["loss_curve"]]
    windows = [losses[i:i + SMOOTHING] for i in range(len(losses) - SMOOTHING + 1)]
    assert min(sum(w) / SMOOTHING for w in windows if None not in w) > float(TARGET)
    assert convergence["loss_curve"][1:SMOOTHING] != allreduce["loss_curve"][1:SMOOTHING]


# measured on the development machine: iterations to the target at each preset's learning rate
FAMILIES = [("gpt2_tiny", "0.5", "0.5", 193), ("dlrm_small", "0.1", "0.05", 173)]


@pytest.mark.parametrize("model, lr, target, measured", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_each_family_learns_its_teacher_tenfold_in_a_few_hundred_iterations(bench_runs, model, lr, target, measured):
    results = bench_runs.ok("--model", model, "--hook", "allreduce", "--nserver", "0", "--target-loss", target,
                            "--lr", lr, "--max-iterations", "1000", timeout_s=180)
    check_contract(results)
    convergence = results["convergence"]
    assert results["config"]["labels"] == "teacher" and convergence["reached"] is True
    assert convergence["iterations"] < 1.5 * measured
    classes = 512 if model == "gpt2_tiny" else 2  # a uniform guess's loss is ln(classes)
    assert 10 * convergence["final_loss"] <= math.log(classes)
    held_out = convergence["held_out"]
    assert held_out[-1][2] < held_out[0][2] / 3 and held_out[-1][2] < math.log(classes) / 2  # it generalises


def test_a_bound_too_small_ends_ok_and_not_reached(bench_runs):
    results = bench_runs.ok("--hook", "allreduce", "--nserver", "0", "--target-loss", TARGET, "--lr", LR,
                            "--max-iterations", "20", timeout_s=120)
    check_contract(results)
    convergence = results["convergence"]
    assert convergence["reached"] is False
    assert convergence["stopped_by"] == "max_iterations" and convergence["iterations"] == 20
    assert len(convergence["loss_curve"]) == 21 and results["throughput"]["iterations"] <= 20
    assert results["rounds_completed"] >= 1


def test_report_shows_time_to_target_and_plots_loss_against_seconds(bench_runs, tmp_path):
    files = [tmp_path / f"{hook}.json" for hook in ("allreduce", "ps", "noop")]
    for file in files:  # the runs the tests above read, as results files
        file.write_text(json.dumps(run(bench_runs, file.stem)))
    plot = tmp_path / "loss.png"
    done = subprocess.run([sys.executable, str(ROOT / "bench.py"), "report", *map(str, files), "--baseline",
                           "hook=allreduce", "--plot", str(plot)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    header, _, *lines = done.stdout.splitlines()
    assert "iterations to target" in header and "seconds to target" in header and "speedup to target" in header
    allreduce = json.loads(files[0].read_text())["convergence"]
    assert f"{allreduce['iterations']}" in lines[0] and "1.00x" in lines[0]
    assert "not reached (diverged)" in lines[2]
    assert plot.stat().st_size > 10_000  # with a diverged curve among them


# -- the averaged model, between two real processes ------------------------------------------
def averaged_loss(rank: int, port: int, out: str) -> None:
    """One of two trainers with parameters of its own: what the tracker saw, saved to ``out``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    torch.manual_seed(rank)
    network = nn.Linear(4, 3)
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 + rank))
    tracker = Convergence(network, nn.CrossEntropyLoss(), dist.group.WORLD, ByteCounter(), 0.01, 5, None)
    tracker.check(0, [inputs], LABELS)
    torch.save({"parameters": network.state_dict(), "inputs": inputs, "loss": tracker.curve[0][1]}, out)
    dist.destroy_process_group()


LABELS = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])


def test_the_loss_is_the_averaged_models_over_every_trainer(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = "import sys; from tests.integration.test_convergence import averaged_loss; " \
           "averaged_loss(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])"
    workers = [subprocess.Popen([sys.executable, "-c", code, str(rank), str(port), str(tmp_path / f"{rank}.pt")],
                                cwd=ROOT, start_new_session=True) for rank in range(2)]
    try:
        for worker in workers:
            assert worker.wait(timeout=60) == 0
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    got = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    assert not torch.equal(got[0]["parameters"]["weight"], got[1]["parameters"]["weight"])
    mean = nn.Linear(4, 3)
    mean.load_state_dict({key: (got[0]["parameters"][key] + got[1]["parameters"][key]) / 2
                          for key in got[0]["parameters"]})
    expected = sum(nn.CrossEntropyLoss()(mean(each["inputs"]), LABELS).item() for each in got) / 2
    assert got[0]["loss"] == got[1]["loss"] == pytest.approx(expected, rel=1e-6)
