"""``--trace``'s merged file: every rank's events on the master's clock."""

from __future__ import annotations

import json

from ps_bench.metrics import traces


def test_a_rank_of_another_host_is_moved_onto_the_masters_clock_by_its_measured_offset(tmp_path):
    """Two ranks saw one event at the same instant: a trainer on the master's host (its profiler's
    stamps 100 us behind its monotonic clock) and a server of a host whose clock runs 5000 ms
    ahead. Merged, both events sit at one time, and the file says what each rank was moved by."""
    (tmp_path / "trainer0-rank0.json").write_text(json.dumps({
        "traceEvents": [{"ph": "X", "name": "forward", "pid": 7, "tid": 1, "ts": 900.0, "dur": 5.0}],
        "ps_bench_clock": {"monotonic_minus_trace_us": 100.0}}))
    (tmp_path / "server0-rank1.json").write_text(json.dumps({
        "traceEvents": [{"ph": "X", "name": "piece 0.0: receive", "pid": 0, "tid": 1, "ts": 5_001_000.0,
                         "dur": 5.0}], "ps_bench_clock": {"monotonic_minus_trace_us": 0.0}}))
    clocks = [{"offset_ms": 0.0, "error_ms": 0.0}, {"offset_ms": 5000.0, "error_ms": 0.15}]
    path, missing = traces.merge(str(tmp_path), [
        (str(tmp_path / "trainer0-rank0.json"), "trainer", 0, 0, clocks[0]),
        (str(tmp_path / "server0-rank1.json"), "server", 0, 1, clocks[1]),
        (str(tmp_path / "trainer1-rank2.json"), "trainer", 1, 2, None)])
    merged = json.loads(open(path).read())
    assert missing == ["trainer1-rank2.json"]
    stamps = {event["pid"]: event["ts"] for event in merged["traceEvents"] if event["ph"] == "X"}
    assert stamps == {0: 1000.0, 1: 1000.0}
    ranks = {rank["rank"]: rank for rank in merged["ps_bench"]["ranks"]}
    assert (ranks[1]["ahead_of_master_us"], ranks[1]["ahead_error_us"]) == (5_000_000.0, 150.0)
    assert ranks[0]["ahead_of_master_us"] == 0.0 and ranks[0]["monotonic_minus_trace_us"] == 100.0
