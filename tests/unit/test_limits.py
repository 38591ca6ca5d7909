"""Floors arithmetic (--limits), the analytic parameter-server bounds, and peak memory."""

import pytest
import torch

from ps_bench.metrics import costs, limits, messages
from ps_bench.metrics.costs import Link
from ps_bench.metrics.memory import combine_peaks, peak_memory
from ps_bench.results.printed import render_limits, render_memory
from ps_bench.strategies import HOOKS

MB = 1e6
GB_S = Link.of(0.0, 8.0)  # 1 GB/s, no latency


def test_bandwidths_follow_nccl_tests():
    assert limits.algbw_gbps(2e9, 1000.0) == pytest.approx(2.0)
    assert costs.busbw_gbps(2.0, 2) == pytest.approx(2.0)  # 2(n-1)/n = 1 for two ranks
    assert costs.busbw_gbps(2.0, 4) == pytest.approx(3.0)
    assert costs.busbw_gbps(2.0, 1) == 0.0  # one rank moves nothing


def test_efficiency_is_floor_over_cost():
    assert limits.efficiency(9.0, 10.0) == pytest.approx(0.9)
    assert limits.efficiency(None, 10.0) is None
    assert limits.efficiency(9.0, 0.0) is None


def test_parameter_server_bound_is_set_by_the_busier_side():
    # 4 trainers, 1 server, 100 MB at 1 GB/s: the server moves 400 MB each way
    assert costs.ps_bound_ms(4, 1, 100 * MB, GB_S) == pytest.approx(400.0)
    # as many servers as trainers: each side moves M
    assert costs.ps_bound_ms(4, 4, 100 * MB, GB_S) == pytest.approx(100.0)


def test_byteps_optimum_matches_its_special_cases():
    n, m = 8, 100 * MB
    # no servers: all-reduce's 2(n-1)/n · M / B
    assert costs.byteps_bound_ms(n, 0, m, GB_S) == pytest.approx(2 * (n - 1) / n * m / 1e9 * 1000)
    # as many servers as workers: M / B
    assert costs.byteps_bound_ms(n, n, m, GB_S) == pytest.approx(m / 1e9 * 1000)


def test_floor_summary_and_memcpy():
    summary = limits.floor_summary([3.0, 1.0, 2.0], nbytes=2_000_000, world=4)
    assert summary["count"] == 3 and summary["p50_ms"] == 2.0 and summary["p90_ms"] == 3.0
    assert summary["algbw_gbps"] == pytest.approx(1.0) and summary["busbw_gbps"] == pytest.approx(1.5)
    copy = limits.memcpy_floor(1 << 20, repeat=3)
    assert copy["bytes"] == 1 << 20 and copy["gbps"] > 0


def test_rpc_floor_target_adds_into_its_preallocated_buffer():
    """One buffer for each message, keyed by (bucket, place): a bucket whole, or each piece."""
    target = limits.RpcFloorTarget({0: [(4, "float32")], 3: [(2, "float16"), (1, "float16")]})
    assert set(target.buffers) == {(0, 0), (3, 0), (3, 1)}
    buffer = target.buffers[3, 0]

    class LocalRef:
        def local_value(self):
            return target

    answer = limits.RpcFloorTarget.add_and_answer(LocalRef(), (3, 0), torch.ones(2, dtype=torch.float16))
    assert answer is buffer and answer.dtype == torch.float16 and answer.tolist() == [1.0, 1.0]
    assert target.buffers[0, 0].dtype == torch.float32 and target.buffers[0, 0].numel() == 4


# A made-up layout: bucket 0 holds a 512 x 256 weight, its bias and a 64 x 3 x 3 x 3 convolution
# (viewed 64 x 27); bucket 1 a 1000-row, 8-wide embedding and nothing else; bucket 2 is sparse.
LAYOUT = [
    {"index": 0, "bytes": 4 * (512 * 256 + 512 + 64 * 27), "sparse": False, "shapes": [[512, 256], [512], [64, 3, 3, 3]]},
    {"index": 1, "bytes": 4 * 8000, "sparse": False, "shapes": [[1000, 8]]},
    {"index": 2, "bytes": 1200, "sparse": True, "shapes": []},
]
HOOK_DEFAULTS = {"matrix_approximation_rank": 2, "min_compression_rate": 2.0}


def test_each_strategys_floor_moves_what_it_sends_derived_by_hand():
    records = {name: HOOKS.record(name) for name in ("allreduce", "fp16", "bf16", "ps_fp16", "powersgd",
                                                     "batched_powersgd", "noop", "ps", "ps_node", "hierarchical",
                                                     "sparse_ps")}
    float32 = messages.floor_messages(records["allreduce"], LAYOUT, {})
    assert float32 == {0: [(131072 + 512 + 1728, "float32")], 1: [(8000, "float32")], 2: [(300, "float32")]}
    half = messages.floor_messages(records["fp16"], LAYOUT, {})
    assert half[0] == [(133312, "float16")] and half[2] == [(300, "float32")]  # sparse buckets go as they are
    assert messages.message_bytes(half) == 2 * 133312 + 2 * 8000 + 1200
    assert messages.floor_messages(records["bf16"], LAYOUT, {})[1] == [(8000, "bfloat16")]
    assert messages.floor_messages(records["ps_fp16"], LAYOUT, {})[1] == [(8000, "float16")]
    # PowerSGD, rank 2: 512 x 256 -> P 1024, Q 512 ((512 + 256) * 2 * 2 < 131072); the bias is 1-D;
    # 64 x 27 -> (64 + 27) * 2 * 2 = 364 < 1728, P 128, Q 54; 1000 x 8 -> 1008 * 2 * 2 = 4032 < 8000,
    # P 2000, Q 16
    low_rank = messages.floor_messages(records["powersgd"], LAYOUT, HOOK_DEFAULTS)
    assert low_rank[0] == [(512, "float32"), (1024 + 128, "float32"), (512 + 54, "float32")]
    assert low_rank[1] == [(2000, "float32"), (16, "float32")]  # nothing uncompressed: no message for it
    # at rank 4, 1000 x 8 is not worth it: 1008 * 4 * 2 = 8064 >= 8000, so it goes whole
    assert messages.floor_messages(records["powersgd"], LAYOUT, {**HOOK_DEFAULTS, "matrix_approximation_rank": 4})[1] \
        == [(8000, "float32")]
    # batched: bucket 1's 8000 elements as a 90 x 90 matrix (ceil(sqrt(8000)) = 90): P and Q of 90 x 2
    assert messages.floor_messages(records["batched_powersgd"], LAYOUT, HOOK_DEFAULTS)[1] == [(180, "float32"),
                                                                                             (180, "float32")]
    assert messages.floor_messages(records["noop"], LAYOUT, {}) == {0: [], 1: [], 2: []}
    # made for sparse buckets: they go to the servers, the dense ones are all-reduced (its own steps)
    assert messages.floor_messages(records["sparse_ps"], LAYOUT, {}) == {0: [], 1: [], 2: [(300, "float32")]}
    # node-aggregated servers: each of a host's 3 trainers pushes a third of each bucket, rounded up
    slices = records["ps_node"].rpc_slices(3)
    assert slices == 3 and records["ps"].rpc_slices(3) == 1 and records["hierarchical"].rpc_slices(3) == 1
    assert messages.floor_messages(records["ps_node"], LAYOUT, {}, slices=slices)[1] == [(2667, "float32")]


def test_peak_memory_per_role():
    peaks = peak_memory(torch.device("cpu"))
    assert peaks["peak_rss_bytes"] > 10 * 2**20 and peaks["peak_cuda_bytes"] is None
    assert combine_peaks([{"peak_rss_bytes": 5, "peak_cuda_bytes": None},
                          {"peak_rss_bytes": 7, "peak_cuda_bytes": None}]) == {"peak_rss_bytes": 7,
                                                                                "peak_cuda_bytes": None}
    assert "trainer" in render_memory({"trainer": peaks, "server": None})


def test_limits_render_after_the_tables():
    floors = {"bytes_per_iter": 100, "buckets": 1,
              "rpc": {"count": 2, "p50_ms": 2.0, "p90_ms": 3.0, "algbw_gbps": 0.1},
              "collective": {"count": 2, "p50_ms": 1.0, "p90_ms": 1.5, "algbw_gbps": 0.2, "busbw_gbps": 0.2,
                             "backend": "gloo"},
              "memcpy": {"bytes": 100, "count": 2, "p50_ms": 0.1, "gbps": 1.0},
              "compute": {"count": 2, "p50_ms": 5.0}}
    text = render_limits(floors, {"floor": "rpc", "floor_ms": 2.0, "cost": "trainer comm p50", "cost_ms": 4.0,
                                  "value": 0.5, "exposed_ms": 2.5, "exposed_value": 0.8})
    assert "raw RPC round trip" in text and "raw all-reduce (gloo)" in text and "efficiency: 0.500" in text
    assert "compute only" in text and "exposed: 0.800" in text
    # a periodic strategy whose period outlasts the run: nothing timed to hold its floor to
    idle = render_limits(floors, {"floor": "collective", "floor_ms": 2.0, "cost": "trainer comm mean",
                                  "cost_ms": 0.0, "value": None, "exposed_ms": 2.5, "exposed_value": 0.8})
    assert "efficiency: - (trainer comm mean 0.000 ms: no communication in the timed rounds" in idle
    short = render_limits(floors, {"floor": "collective", "floor_ms": 2.0, "cost": "trainer comm mean",
                                   "cost_ms": 0.05, "value": None, "period": 16, "timed_iterations": 8})
    assert ("efficiency: - (trainer comm mean 0.050 ms over 8 timed iterations a trainer, fewer than the "
            "period, 16: run more rounds)") in short


def test_scaling_view_puts_each_point_next_to_its_bound():
    from ps_bench.report import Row, scaling_table

    def point(ntrainer: int, nserver: int, comm_ms: float) -> Row:
        return Row(f"{ntrainer}x{nserver}", {
            "status": "ok", "config": {"hook": "ps", "ntrainer": ntrainer, "nserver": nserver},
            "summary": [{"role": "trainer", "metric": "comm", "p50": comm_ms},
                        {"role": "trainer", "metric": "batch", "p50": 2 * comm_ms}],
            "bytes": {"trainer_sent_per_iter": 100e6}, "limits": {"memcpy": {"gbps": 2.0}}})

    headers, body = scaling_table([point(4, 2, 400.0), point(2, 1, 150.0)], link_gbps=None)
    by_point = {(line[1], line[2]): dict(zip(headers, line)) for line in body}
    assert [key for key in by_point] == [(2, 1), (4, 2)]
    assert by_point[(4, 2)]["PS bound ms"] == "100.000"  # 4 x 100 MB / 2 servers at 2 GB/s
    assert by_point[(4, 2)]["comm / PS bound"] == "4.00"
    assert by_point[(2, 1)]["BytePS optimum ms"] == "50.000"  # 2·2·1·M / (4 + 2 - 2) / B = M / B
    _, linked = scaling_table([point(2, 1, 150.0)], link_gbps=1.0)
    assert linked[0][7] == "200.000"
    # all-reduce started beside an idle server (--nserver 1): no server bound, and
    # BytePS's optimum with k = 0 servers, the ring's 2(n-1)/n M / B
    ring = point(4, 1, 200.0)
    ring.results["config"]["hook"] = "allreduce"
    [line] = scaling_table([ring], link_gbps=None)[1]
    assert line[2] == 0 and line[7] is None and line[8] == "75.000"


def test_a_slow_floor_takes_fewer_repetitions_and_no_more_warm_up():
    assert limits.affordable(20, 1.0) == (limits.FLOOR_WARMUP - 1, 20)  # quick: all of them
    assert limits.affordable(20, 0.0) == (limits.FLOOR_WARMUP - 1, 20)
    assert limits.affordable(20, 150.0) == (0, int(limits.FLOOR_BUDGET_MS // 150))  # about the budget
    assert limits.affordable(20, 1340.0) == (0, limits.FLOOR_MIN_TIMED)  # 16 MiB over 200 Mbit/s: never fewer
    assert limits.affordable(2, 1340.0) == (0, 2)  # never more than asked


def test_timed_runs_what_the_agreed_first_repetition_affords():
    calls = []
    samples = limits._timed(20, lambda: calls.append("once"), lambda: calls.append("sync"), lambda ms: 500.0)
    assert len(samples) == 4 and calls.count("once") == 5 and calls.count("sync") == 5  # 1 untimed, 4 timed


class Counting(torch.nn.Module):
    """A linear classifier that notes each forward's batch and whether autocast was on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.seen: list[tuple[int, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((len(x), torch.is_autocast_enabled("cpu")))
        return self.linear(x)


def test_the_compute_only_iteration_is_the_runs_micro_batches_precision_and_optimizer():
    """--grad-accum 3, bf16 autocast, AdamW: each repetition is three forwards of a micro-batch
    under autocast, then one step of the run's optimizer (an iteration of the run, unsynchronised)."""
    model, built = Counting(), []

    def adamw(parameters):
        built.append(torch.optim.AdamW(parameters, lr=0.1))
        return built[-1]

    before = model.linear.weight.detach().clone()
    samples = limits.compute_floor_ms(model, (torch.randn(12, 4),), torch.randint(0, 3, (12,)), 2, None,
                                      adamw, repeat=2, micro_batches=3,
                                      autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    # the untimed first one, and the rest of the warm-up unless that first one was slow (a busy
    # machine: affordable)
    repetitions = len(model.seen) // 3
    assert repetitions in (len(samples) + 1, len(samples) + limits.FLOOR_WARMUP), (len(samples), model.seen)
    assert model.seen == [(2, True)] * 3 * repetitions
    assert len(built) == 1 and built[0].state[model.linear.weight]["step"] == repetitions
    assert not torch.equal(model.linear.weight, before)
    plain = Counting()
    limits.compute_floor_ms(plain, (torch.randn(12, 4),), torch.randint(0, 3, (12,)), 4, None,
                            lambda parameters: torch.optim.SGD(parameters, lr=0.1), repeat=2)
    assert set(plain.seen) == {(4, False)}  # no --grad-accum, fp32: one batch, no autocast
    scaled, scaler = Counting(), torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    limits.compute_floor_ms(scaled, (torch.randn(12, 4),), torch.randint(0, 3, (12,)), 4, None,
                            lambda parameters: torch.optim.SGD(parameters, lr=0.1), repeat=2, scaler=scaler)
    assert scaler._get_growth_tracker() == len(scaled.seen)  # fp16's scaler stepped every repetition


def test_the_compute_only_iterations_scaler_starts_where_the_runs_is():
    """fp16: the compute-only copy steps a gradient scaler of its own, from the run's scale and
    growth tracker (a fresh one's 2**16 overflows fp16 gradients and skips its first steps)."""
    from ps_bench.trainers.probes import scaler_like

    run = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=5)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for factor in (float("inf"), 1.0, 1.0):  # one overflow (the scale halves), two good steps
        optimizer.zero_grad()
        run.scale((weight * factor).sum()).backward()
        run.step(optimizer)
        run.update()
    own = scaler_like(run, "cpu")
    assert own is not run and own.get_scale() == run.get_scale() == 2.0 ** 15
    assert own._get_growth_tracker() == run._get_growth_tracker() == 2
