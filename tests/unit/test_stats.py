import math

import numpy as np
import pytest

from ps_bench.metrics.stats import SummaryRow, summarize, summary_rows
from ps_bench.metrics.timers import IntervalTracker, tensor_bytes

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


def test_interval_tracker_counts_overlaps_once():
    tracker = IntervalTracker()
    for start, end in [(0, 2), (1, 3), (5, 6), (5.5, 5.7)]:
        tracker.add(start, end)
    assert tracker.drain() == pytest.approx(4.0)
    assert tracker.drain() == 0.0


def test_tensor_bytes_dense_and_sparse():
    assert tensor_bytes(torch.zeros(10, dtype=torch.float32)) == 40
    assert tensor_bytes(torch.zeros(3, dtype=torch.float16)) == 6
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (5,), check_invariants=True)
    assert tensor_bytes(sparse) == 2 * 8 + 2 * 4  # int64 indices + fp32 values
