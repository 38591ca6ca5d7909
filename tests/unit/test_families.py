"""The strategy families without processes: their records, what they send by arithmetic, their
options, and every way a run of them is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ps_bench.cli import main
from ps_bench.config import ConfigError
from ps_bench.runfiles import build_config
from ps_bench.job import validate
from ps_bench.metrics.costs import collective_bytes
from ps_bench.options import parse_run_options
from ps_bench.strategies import HOOKS, option_types
from ps_bench.strategies.record import (ALLREDUCE, AT_SYNCHRONISATION, FAMILIES, FSDP, GATHERED,
                                        LOCAL, SERVERS, SHARDED, expected_bytes)

ROOT = Path(__file__).resolve().parents[2]


def checked(*argv: str):
    cfg = build_config(*parse_run_options(list(argv)))
    validate(cfg, gpus=0)
    return cfg


def test_every_family_has_its_module_and_its_strategies():
    by_family = {family: {name for name in HOOKS.names() if HOOKS.record(name).family == family} for family in FAMILIES}
    assert by_family[SHARDED] == {"fsdp", "hsdp", "zero1", "deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3"}
    assert by_family[LOCAL] == {"local_sgd", "diloco", "torchft_local_sgd", "torchft_diloco"}
    assert {"allreduce", "fp16", "powersgd", "noop"} <= by_family[ALLREDUCE]
    assert {"ps", "sparse_ps", "ps_fp16"} <= by_family[SERVERS]
    for family in FAMILIES:
        module = ROOT / "ps_bench" / "strategies" / f"{family}.py"
        assert module.exists(), module
    # an engine's strategies live in a module of its own, beside torch's of their family
    modules = {"deepspeed": "deepspeed_zero", "torchft": "torchft_local"}
    for name in HOOKS.names():
        engine = HOOKS.record(name).engine
        assert engine is None or HOOKS.get(name).__module__ == f"ps_bench.strategies.{modules[engine]}", name
    for name in by_family[SHARDED] | by_family[LOCAL]:
        assert not HOOKS.record(name).takes_servers and not HOOKS.record(name).needs_servers
    assert HOOKS.record("fsdp").wrap == FSDP and HOOKS.record("fsdp").identical == GATHERED
    assert HOOKS.record("local_sgd").identical == HOOKS.record("diloco").identical == AT_SYNCHRONISATION


def test_no_module_of_the_package_is_over_400_lines():
    for path in (ROOT / "ps_bench").rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 400, path


def test_what_each_collective_moves_per_rank():
    assert collective_bytes("all_reduce", 4000, 4) == 6000  # 2(n-1)/n
    assert collective_bytes("all_gather", 4000, 4) == collective_bytes("broadcast", 4000, 4) == 3000  # (n-1)/n
    assert collective_bytes("reduce_scatter", 4000, 4, "nccl") == 3000
    assert collective_bytes("reduce_scatter", 4000, 4, "gloo") == 6000  # gloo runs it as an all-reduce
    assert collective_bytes("all_reduce", 4000, 1) == 0


def test_what_each_strategy_sends_besides_its_hook_amortised_over_its_period():
    assert expected_bytes(HOOKS.record("local_sgd"), 3200, 2, period=4) == 800
    assert expected_bytes(HOOKS.record("diloco"), 3200, 2, period=16) == 200
    assert expected_bytes(HOOKS.record("zero1"), 3200, 2) == 1600
    assert expected_bytes(HOOKS.record("fsdp"), 3200, 2, backend="gloo") == 1600 + 1600 + 3200
    assert expected_bytes(HOOKS.record("fsdp"), 3200, 2, backend="nccl") == 3 * 1600
    assert expected_bytes(HOOKS.record("allreduce"), 3200, 2) == 0  # a hook's bytes come from its buckets


def test_the_local_strategies_options_and_their_defaults():
    assert {key: default for key, (_, default) in option_types("local_sgd").items()} == {"period": 4, "warmup_steps": 0}
    assert {key: default for key, (_, default) in option_types("diloco").items()} == {
        "period": 16, "outer_lr": 0.7, "outer_momentum": 0.9}
    assert option_types("fsdp") == option_types("zero1") == option_types("hsdp") == {}
    assert checked("--hook", "hsdp", "--nserver", "0", "--ntrainer", "4", "--per-host", "2").per_host == 2
    cfg = checked("--hook", "diloco", "--nserver", "0", "--hook-option", "period=64", "--optimizer", "adamw")
    assert cfg.hook_options == {"period": 64} and cfg.weight_decay == 0.01
    assert checked("--hook", "DiLoCo", "--nserver", "0").hook == "diloco"
    assert checked("--hook", "fsdp", "--nserver", "0").weight_decay == 0.0


@pytest.mark.parametrize("argv, message", [
    (("--hook", "local_sgd", "--nserver", "0", "--hook-option", "period=0"), "'period' must be at least 1"),
    (("--hook", "diloco", "--nserver", "0", "--hook-option", "period=-2"), "'period' must be at least 1"),
    (("--hook", "local_sgd", "--nserver", "0", "--hook-option", "warmup_steps=-1"), "'warmup_steps' must be 0 or more"),
    (("--hook", "diloco", "--nserver", "0", "--hook-option", "outer_momentum=1"), "'outer_momentum' must be in"),
    (("--hook", "fsdp", "--nserver", "1"), r"trains without parameter servers: leave --nserver out \(got --nserver 1"),
    (("--hook", "diloco", "--nserver", "2", "--ntrainer", "3"), "trains without parameter servers"),
    (("--hook", "zero1", "--nserver", "0", "--ncudaserver", "1"), "trains without parameter servers"),
    (("--hook", "local_sgd", "--nserver", "0", "--staleness", "2"), "it needs --hook ps"),
    (("--hook", "fsdp", "--nserver", "0", "--hook-option", "period=4"), "hook 'fsdp' has no option 'period'"),
    (("--hook", "local_sgd", "--nserver", "0", "--hook-option", "outer_lr=1"), "has no option 'outer_lr'"),
    (("--hook", "fsdp", "--nserver", "0", "--gradient-as-bucket-view"), "cannot be combined with "
                                                                        "--gradient-as-bucket-view"),
    (("--hook", "ps_node", "--ntrainer", "4", "--per-host", "2", "--nserver", "3", "--mapping", "group"),
     "--mapping group gives each server a group of hosts: 3 servers need 3 hosts; got 2"),
    (("--hook", "ps_node", "--nserver", "2"), "it needs 2 hosts or more"),
    (("--hook", "ps_node", "--ntrainer", "4", "--per-host", "2", "--model", "DummyModelSmallSparse"),
     "cannot sum within a host"),
    (("--hook", "fsdp", "--nserver", "0", "--model", "DummyModelSmallSparse"), "sparse gradients"),
    (("--hook", "hsdp", "--nserver", "0"), "it needs 2 hosts or more"),
    (("--hook", "hsdp", "--nserver", "0", "--ntrainer", "4", "--per-host", "4"), "got 4 trainers on 1 host"),
    (("--ntrainer", "4", "--per-host", "3"), "--per-host 3 does not divide the 4 trainers"),
    (("--per-host", "0"), "--per-host must be at least 1"),
    (("--optimizer", "adamw", "--momentum", "0.9"), "--momentum is SGD's"),
    (("--momentum", "-1"), r"--momentum must be in \[0, 1\)"),
    (("--weight-decay", "-0.1"), "--weight-decay must be 0 or more"),
    (("--staleness", "1", "--optimizer", "adamw"), "plain SGD"),
    (("--straggler", "any:20ms:0"), r"P must be a probability in \(0, 1\]"),
    (("--straggler", "any:20ms:1.2"), r"P must be a probability in \(0, 1\]"),
    (("--straggler", "any:fast:0.2"), "DELAY must be a number"),
])
def test_bad_input_is_refused_with_one_sentence(argv, message):
    with pytest.raises(ConfigError, match=message):
        checked(*argv)


def test_an_unknown_optimizer_exits_2_with_one_line_before_anything_starts():
    run = subprocess.run([sys.executable, "bench.py", "--optimizer", "adam", "--hook", "diloco", "--nserver", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "invalid choice: 'adam'" in run.stderr


def test_fsdp_units_share_no_parameter_and_hold_what_their_forward_reads():
    """A GPT's tied token embedding and output projection (one parameter, two modules) stay with
    the root; ``nn.MultiheadAttention`` is one unit with its ``out_proj``, whose weight its forward
    reads without calling it."""
    from ps_bench.models.transformer import GPT
    from ps_bench.strategies.sharded import shard_units

    network = GPT(vocab_size=64, context_length=8, layers=2, heads=2, width=8)
    units = shard_units(network)
    held = [id(parameter) for unit in units for parameter in unit.parameters()]
    assert len(held) == len(set(held))  # no parameter sharded by two units
    assert network.token not in units and network.head not in units
    assert id(network.token.weight) not in held
    attention = [block.self_attn for block in network.blocks]
    assert all(unit in units for unit in attention)
    assert not any(block.self_attn.out_proj in units for block in network.blocks)
    assert network.position in units and network.norm in units



def test_compile_with_an_engine_that_compiles_its_own_way_is_one_line_exit_2(capsys):
    """DeepSpeed's engine owns the model's modules: --compile with it is refused before anything
    starts, naming why and what to do."""
    code = main(["--hook", "deepspeed_zero3", "--nserver", "0", "--compile", "--dry-run"])
    error = capsys.readouterr().err.strip()
    assert code == 2 and len(error.splitlines()) == 1
    assert error.startswith("ps_bench: error: --compile: --hook deepspeed_zero3 is not compiled here")
    assert error.endswith("run it without --compile")
