"""Strategy plumbing that needs no processes: byte accounting, hook options, sampling."""

import pickle

import pytest
import torch

from ps_bench.metrics.timers import tensor_bytes
from ps_bench.metrics.costs import allgather_bytes, allreduce_bytes
from ps_bench.metrics.wire import ByteCounter
from ps_bench.config import ConfigError, RunConfig
from ps_bench.job import validate
from ps_bench.strategies import COLLECTIVE, HOOKS, RPC, SPARSE_ALLREDUCE, SPARSE_GLOO, Strategy, check_hook_options
from ps_bench.trainers.rounds import VERIFIED_PER_ROUND, verified_steps


@pytest.mark.parametrize(
    "nbytes, world, sparse, expected",
    [
        (4000, 1, False, 0),  # alone: nothing moves
        (4000, 2, False, 4000),  # ring: 2(n-1)/n of the buffer
        (4000, 4, False, 6000),
        (1000, 8, False, 1750),
        (400, 4, True, 1200),  # sparse over gloo: every payload to every other rank
    ],
)
def test_allreduce_bytes(nbytes, world, sparse, expected):
    assert allreduce_bytes(nbytes, world, sparse) == expected


def test_allgather_bytes():
    assert allgather_bytes(100, 1) == 0
    assert allgather_bytes(100, 5) == 400


def test_compressed_payloads_are_smaller():
    bucket = torch.zeros(1000)
    assert tensor_bytes(bucket) == 4000
    assert tensor_bytes(bucket.half()) == tensor_bytes(bucket.bfloat16()) == 2000


def test_byte_counter_adds_up_and_pauses():
    counter = ByteCounter()
    counter.add(sent=10, recv=4)
    counter.paused = True
    counter.add(sent=1000)
    counter.paused = False
    counter.add(recv=6)
    assert (counter.sent, counter.recv) == (10, 10)


def test_every_strategy_is_registered_with_its_upstream_alias():
    assert set(HOOKS.names()) >= {"allreduce", "ps", "sparse_ps", "noop", "hybrid", "fp16", "bf16", "ps_fp16",
                                  "ps_bf16", "powersgd", "batched_powersgd"}
    for alias, name in [("allreduce_hook", "allreduce"), ("rpc_hook", "ps"), ("sparse_rpc_hook", "sparse_ps"),
                        ("hybrid_hook", "hybrid")]:
        assert HOOKS.canonical(alias) == name


def test_powersgd_options_are_checked():
    assert check_hook_options("powersgd", {"matrix_approximation_rank": 4, "min_compression_rate": 1}) == {
        "matrix_approximation_rank": 4, "min_compression_rate": 1.0}
    with pytest.raises(ValueError, match="no option 'rank'; its options: matrix_approximation_rank"):
        check_hook_options("powersgd", {"rank": 4})
    with pytest.raises(ValueError, match="'matrix_approximation_rank' must be a whole number"):
        check_hook_options("batched_powersgd", {"matrix_approximation_rank": "4"})
    with pytest.raises(ValueError, match="must be more than 1 with error feedback"):
        check_hook_options("powersgd", {"start_powerSGD_iter": 1})
    check_hook_options("powersgd", {"start_powerSGD_iter": 1, "use_error_feedback": False, "warm_start": False})
    for rate in (-1.0, float("nan")):  # a JSON config's NaN is a float
        with pytest.raises(ValueError, match="'min_compression_rate' must be 0 or more"):
            check_hook_options("powersgd", {"min_compression_rate": rate})
    assert check_hook_options("powersgd", {"min_compression_rate": 0}) == {"min_compression_rate": 0.0}
    with pytest.raises(ValueError, match="takes no options"):
        check_hook_options("fp16", {"x": 1})


@pytest.mark.parametrize("iterations", [1, 2, 3, 4, 5, 32, 101])
def test_verified_iterations_are_few_and_spread(iterations):
    steps = verified_steps(iterations)
    assert 1 <= len(steps) <= VERIFIED_PER_ROUND
    assert min(steps) == 0 and max(steps) < iterations
    assert not any(step + 1 in steps for step in steps)  # a short round keeps timed iterations


def test_each_strategy_has_its_floor():
    assert HOOKS.record("ps").floor == HOOKS.record("ps_fp16").floor == HOOKS.record("sparse_ps").floor == RPC
    assert {HOOKS.record(name).floor for name in ("allreduce", "powersgd", "hybrid", "fp16")} == {COLLECTIVE}
    assert HOOKS.record("noop").floor is None
    assert HOOKS.record("rpc_hook") is HOOKS.record("ps")  # aliases reach the record


def test_a_lossy_strategy_names_the_lossless_one_it_compresses():
    for name in HOOKS.names():
        record = HOOKS.record(name)
        if record.uncompressed:
            baseline = HOOKS.record(record.uncompressed)
            assert baseline.lossless and baseline.transport == record.transport, name
    with pytest.raises(ValueError, match="names the lossless one it compresses"):
        Strategy(RPC, "float16", lossless=False, sparse_buckets=None)
    with pytest.raises(ValueError, match="bad strategy record"):
        Strategy("carrier pigeon", "float32", lossless=True, sparse_buckets=None)


def test_a_strategy_without_a_record_is_refused():
    with pytest.raises(TypeError, match="hook 'unrecorded' needs a Strategy record"):
        HOOKS.register("unrecorded")(lambda ctx: None)


@pytest.fixture
def made_up_strategies(monkeypatch):
    """Registers strategies for one test: a new strategy is its function and its record."""
    for table in ("_entries", "_records", "_canonical"):
        monkeypatch.setattr(HOOKS, table, dict(getattr(HOOKS, table)))

    def register(name: str, record: Strategy) -> None:
        HOOKS.register(name, record=record)(lambda ctx: None)

    return register


def test_validation_reads_a_new_strategys_record(made_up_strategies):
    made_up_strategies("ps_half", Strategy(RPC, "float16", lossless=False, sparse_buckets=None, uncompressed="ps"))
    made_up_strategies("ring_half", Strategy(COLLECTIVE, "float16", lossless=False, sparse_buckets=SPARSE_ALLREDUCE,
                                             uncompressed="allreduce"))
    made_up_strategies("gloo_sparse", Strategy(COLLECTIVE, "float32", lossless=True, sparse_buckets=SPARSE_GLOO))
    with pytest.raises(ConfigError, match="--hook ps_half sends gradients to parameter servers: set --nserver"):
        validate(RunConfig(hook="ps_half", nserver=0), gpus=0)
    validate(RunConfig(hook="ring_half", nserver=0), gpus=0)
    with pytest.raises(ConfigError, match="sparse gradients, which NCCL cannot all-reduce .--hook ring_half"):
        validate(RunConfig(hook="ring_half", backend="nccl", ntrainer=1, model="DummyModelSmallSparse"), gpus=1)
    with pytest.raises(ConfigError, match="--hook gloo_sparse all-reduces sparse gradients over gloo"):
        validate(RunConfig(hook="gloo_sparse", backend="nccl", ntrainer=1, model="DummyModelSmallSparse"), gpus=1)
    validate(RunConfig(hook="gloo_sparse", backend="multi", ntrainer=1, model="DummyModelSmallSparse"), gpus=1)


def test_every_strategy_record_pickles_as_it_travels_into_the_ranks():
    """The job's spec, its strategy's record among it, is pickled into every spawned rank: a
    record may hold module functions and partials of them, not lambdas."""
    for name in HOOKS.names():
        record = pickle.loads(pickle.dumps(HOOKS.record(name)))
        assert record.transport == HOOKS.record(name).transport, name
