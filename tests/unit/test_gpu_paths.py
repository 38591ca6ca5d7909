"""What the GPU paths need, checked without a GPU: the GPU page's examples (docs/gpus.md) are valid jobs on a
node with enough GPUs, and what does not fit one GPU is refused in one line before anything
starts (scripts/gpu_check.sh counts on both)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from ps_bench.config import ConfigError
from ps_bench.runfiles import build_config
from ps_bench.job import validate
from ps_bench.processes.launch import LaunchSpec
from ps_bench.options import parse_run_options

GPU_PAGE = Path(__file__).resolve().parents[2] / "docs" / "gpus.md"


def gpu_examples() -> list[list[str]]:
    section = GPU_PAGE.read_text()
    return [shlex.split(line, comments=True)[2:] for line in section.splitlines() if line.startswith("python bench.py")]


def test_the_gpu_page_shows_gpu_examples():
    assert len(gpu_examples()) >= 3


@pytest.mark.parametrize("argv", gpu_examples(), ids=lambda argv: " ".join(argv))
def test_each_gpu_example_is_a_valid_job_with_a_gpu_per_nccl_trainer(argv):
    cfg = build_config(*parse_run_options(argv))
    job = validate(cfg, gpus=max(1, cfg.num_trainers))
    spec = LaunchSpec(job, argv, "", "r.json", cfg.world_size, max(1, cfg.num_trainers))
    devices = [spec.device_of(info.rank) for info in spec.topology().trainers]
    assert all(device is not None for device in devices)  # every trainer computes on a GPU
    if cfg.backend != "gloo":
        assert len(set(devices)) == len(devices)  # NCCL: a GPU of its own for each trainer
    if len(devices) > 1:  # more than one trainer: one GPU is not enough for NCCL, and says so in one line
        if cfg.backend != "gloo":
            with pytest.raises(ConfigError, match=f"needs one GPU per trainer: {len(devices)} trainers on this node, "
                                                  f"1 GPU;"):
                validate(build_config(*parse_run_options(argv)), gpus=1)
        else:
            validate(build_config(*parse_run_options(argv)), gpus=1)  # CUDA-RPC ranks share the GPU


def test_cuda_servers_share_a_gpu_with_the_trainers_on_one_gpu():
    cfg = build_config(*parse_run_options(["--ntrainer", "0", "--ncudatrainer", "2", "--nserver", "0",
                                           "--ncudaserver", "1", "--hook", "ps"]))
    spec = LaunchSpec(validate(cfg, gpus=1), [], "", "r.json", cfg.world_size, 1)
    topology = spec.topology()
    assert [spec.device_of(rank) for rank in range(cfg.world_size)] == [0, 0, 0, None]  # the master has none
    assert topology.device_maps(0, cfg.world_size, 1) == {"server2": {0: 0}}
    assert topology.device_maps(2, cfg.world_size, 1) == {"trainer0": {0: 0}, "trainer1": {0: 0}}
