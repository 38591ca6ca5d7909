import math
import time

import numpy as np
import pytest

from ps_bench.metrics.stats import SummaryRow, summarize, summary_rows
from ps_bench.metrics.timers import (IntervalTracker, StepTimer, bucket_offsets, covered_ms, exposed_ms, folded,
                                     sent_bytes, tensor_bytes)
from ps_bench.trainers.rounds import collective_ms, round_samples

import torch


def test_summarize_known_values():
    stats = summarize([1.0, 2.0, 3.0, 4.0])
    assert stats["count"] == 4
    assert stats["mean"] == 2.5
    assert stats["min"] == 1.0 and stats["max"] == 4.0
    assert stats["p50"] == 2.5
    assert math.isclose(stats["std"], np.std([1, 2, 3, 4], ddof=1))
    assert math.isclose(stats["p90"], np.percentile([1, 2, 3, 4], 90))


def test_single_sample_has_zero_std():
    stats = summarize([7.5])
    assert stats == {"count": 1, "mean": 7.5, "std": 0.0, "min": 7.5, "p50": 7.5, "p90": 7.5, "p99": 7.5, "max": 7.5}


def test_no_samples_is_an_error():
    with pytest.raises(ValueError):
        summarize([])


def test_rows_pool_ranks_and_split_on_request():
    per_rank = {0: {"batch": [1.0, 3.0]}, 1: {"batch": [5.0]}}
    pooled = summary_rows("trainer", per_rank, ["batch", "comm"])
    assert len(pooled) == 1  # comm has no samples: no row
    assert pooled[0].count == 3 and pooled[0].mean == 3.0 and pooled[0].rank is None
    split = summary_rows("trainer", per_rank, ["batch"], split_ranks=True)
    assert [(r.rank, r.count) for r in split] == [(None, 3), (0, 2), (1, 1)]


def test_row_renders_same_numbers_as_json_and_table():
    row = SummaryRow("server", "round", "ms", **summarize([2.0, 4.0]))
    as_dict = row.to_dict()
    assert "rank" not in as_dict
    assert row.table_row() == ["server", "round", "ms"] + [as_dict[k] for k in
                                                         ("count", "mean", "std", "min", "p50", "p90", "p99", "max")]


def test_interval_tracker_counts_overlaps_once_per_iteration():
    tracker = IntervalTracker()
    # seconds; iteration 7 overlaps itself, iteration 8's interval overlaps 7's in time but is its own
    for start, end in [(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (5.5, 5.7)]:
        tracker.add((7, start, end))
    tracker.add((8, 1.0, 1.5))
    assert covered_ms(tracker.drain()) == {7: pytest.approx(4000.0), 8: pytest.approx(500.0)}
    assert tracker.drain() == []


def test_bucket_offsets_are_ms_after_the_iterations_backward_began():
    # sorted, as drain() gives them: an iteration's k-th interval is its bucket k
    intervals = [(3, 10.002, 10.010), (3, 10.005, 10.012), (4, 20.001, 20.003), (5, 30.0, 30.1)]
    offsets = bucket_offsets(intervals, {3: 10.0, 4: 20.0})  # iteration 5 is not timed
    assert offsets[0] == [pytest.approx((2.0, 10.0, 0.0)), pytest.approx((1.0, 3.0, 0.0))]
    assert offsets[1] == [pytest.approx((5.0, 12.0, 0.0))]


def test_bucket_offsets_say_how_long_each_hook_held_backward():
    """A hook's own work before it returned (an encoding on backward's thread) is matched to its
    bucket by the hand-over reading both intervals share."""
    intervals = [(3, 10.002, 10.010), (3, 10.005, 10.012)]
    held = [(3, 10.002, 10.0045), (3, 10.005, 10.0051)]
    offsets = bucket_offsets(intervals, {3: 10.0}, held)
    assert offsets[0] == [pytest.approx((2.0, 10.0, 2.5))]
    assert offsets[1] == [pytest.approx((5.0, 12.0, 0.1))]


def test_step_timer_turns_cpu_readings_into_phase_milliseconds():
    timer = StepTimer(torch.device("cpu"))
    assert timer.clock is timer.stop is time.perf_counter  # the loop pays for a C call, nothing else
    phases = timer.phases([(10.0, 10.002, 10.005, 10.006), (20.0, 20.001, 20.001, 20.004)])
    assert phases == pytest.approx(np.array([[2.0, 3.0, 1.0], [1.0, 0.0, 3.0]]))


def test_round_samples_leave_untimed_steps_out_of_times_but_not_bytes():
    phases = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    moved = np.array([[100, 10], [200, 20], [300, 30]])
    comm = {11: 0.5, 13: 1.5}  # iteration 12 had no communication
    samples = round_samples(phases, moved, comm, first_iteration=11, untimed={0})
    assert samples["forward"] == [4.0, 7.0] and samples["optimizer"] == [6.0, 9.0]
    assert samples["batch"] == [15.0, 24.0]
    assert samples["comm"] == [0.0, 1.5]
    assert samples["bytes_sent"] == [100, 200, 300] and samples["bytes_recv"] == [10, 20, 30]
    assert all(type(b) is int for b in samples["bytes_sent"])


def test_collective_ms_counts_overlapping_collectives_of_a_kind_once_and_kinds_apart():
    # (iteration, start s, end s, kind): two all-reduces overlapping in iteration 1
    timings = [(1, 0.0, 0.004, "all_reduce"), (1, 0.002, 0.006, "all_reduce"),
               (2, 0.010, 0.011, "all_reduce"), (1, 0.003, 0.005, "all_gather")]
    assert collective_ms(timings) == pytest.approx({"all_gather": 2.0, "all_reduce": 7.0})
    assert list(collective_ms(timings)) == ["all_gather", "all_reduce"]
    assert collective_ms([]) == {}


def test_tensor_bytes_dense_and_sparse():
    assert tensor_bytes(torch.zeros(10, dtype=torch.float32)) == 40
    assert tensor_bytes(torch.zeros(3, dtype=torch.float16)) == 6
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (5,), check_invariants=True)
    assert tensor_bytes(sparse) == 2 * 8 + 2 * 4  # int64 indices + fp32 values


def test_a_sparse_tensor_is_sent_with_its_repeated_places_summed():
    """What gloo's sparse all-reduce and the parameter servers send: each place once (an
    embedding's gradient has a row per lookup), counted without coalescing."""
    embedding = torch.nn.EmbeddingBag(50, 3, sparse=True)
    embedding(torch.tensor([[1, 4, 4, 7], [4, 1, 9, 9]])).sum().backward()
    rows = embedding.weight.grad
    assert not rows.is_coalesced() and tensor_bytes(rows) == 8 * (8 + 3 * 4)
    assert sent_bytes(rows) == tensor_bytes(rows.coalesce()) == 4 * (8 + 3 * 4)  # rows 1, 4, 7, 9
    grid = torch.sparse_coo_tensor(torch.tensor([[0, 2, 0, 2, 1], [1, 3, 1, 0, 3]]), torch.ones(5, 2), (3, 4, 2),
                                   check_invariants=True)
    assert sent_bytes(grid) == tensor_bytes(grid.coalesce()) == 4 * (2 * 8 + 2 * 4)  # (0,1) twice
    assert sent_bytes(grid.coalesce()) == tensor_bytes(grid.coalesce())
    assert sent_bytes(torch.zeros(10)) == 40


def test_micro_batches_fold_into_one_iterations_forward_and_backward():
    # readings: start, then each micro-batch's end of forward and of backward, then the step's end
    readings = np.array([[0.0, 1.0, 3.0, 4.0, 6.0, 6.5]])  # two micro-batches, then the optimizer
    phases = np.diff(readings, axis=1)
    assert folded(phases, 1).tolist() == [[2.0, 4.0, 0.5]]  # forward 1+1, backward 2+2, optimizer
    one = np.array([[1.0, 2.0, 0.5]])
    assert folded(one, 1) is one  # one micro-batch: as it was


def test_exposed_communication_is_what_no_computation_hid():
    """An iteration computing from 0 to 10 (its backward's end): a hook's bucket handed over at 4
    and done at 12 hides 4 to 8 behind the later buckets' computation, the last handed over at 8
    (12 - 8 = 4 exposed of 8 open); a collective after backward (12 to 15) is exposed whole; a
    collective inside backward that is no hook's own and does not block cannot be told apart:
    None; one that blocks (its caller waited in it, as FSDP2's do on the CPU) computes nothing
    while it lasts: exposed whole, and it hides nothing of a bucket open across it."""
    handed = [(1, 4.0, 12.0), (1, 8.0, 9.0)]
    assert exposed_ms(handed, [], {1: (0.0, 10.0)}) == {1: pytest.approx(4000.0)}
    assert exposed_ms([], [(1, 12.0, 15.0, False)], {1: (0.0, 10.0)}) == {1: pytest.approx(3000.0)}
    assert exposed_ms(handed, [(1, 4.5, 6.0, False)], {1: (0.0, 10.0)}) == {1: pytest.approx(4000.0)}  # the hook's own
    assert exposed_ms(handed, [(1, 1.0, 2.0, False)], {1: (0.0, 10.0)}) is None
    blocking = [(1, 1.0, 2.0, True), (1, 3.0, 4.5, True), (1, 12.0, 13.0, True)]
    assert exposed_ms([], blocking, {1: (0.0, 10.0)}) == {1: pytest.approx(3500.0)}
    # 4 to 12 open; computing only 4 to 5 and 7 to 8 of it (the last hand-over at 8)
    assert exposed_ms(handed, [(1, 5.0, 7.0, True)], {1: (0.0, 10.0)}) == {1: pytest.approx(6000.0)}
