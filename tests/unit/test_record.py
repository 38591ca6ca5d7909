"""The results object built from made-up rounds: no processes, every number derivable by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ps_bench.config import RunConfig
from ps_bench.job import validate
from ps_bench.processes.kept import SnapshotPacing
from ps_bench.results.files import failed_results, read_snapshot, write_snapshot
from ps_bench.results.record import RunRecord, replica_summary, replicas_alike
from ps_bench.strategies.base import fingerprint, parameter_norm
from ps_bench.results.files import write_results
from ps_bench.results.printed import held_line, print_report
from ps_bench.metrics.timers import (TIMELINE_ITERATIONS, ahead_ms, clock_id, clock_offset,
                                     server_offsets)
from ps_bench.runtime.topology import PIECES, Topology
from ps_bench.servers.state import ServerBooks
from tests.contract import TRAINER_METRICS, check_contract, check_failed_minimum, metrics_of

ITERATIONS = 4
BATCH = 16


def trainer_round(offset: float, sent: int, losses: list[float], errors: tuple[float, ...] = ()) -> dict:
    """What ``DdpTrainer.run_round`` returns, made up: ``ITERATIONS`` iterations, ``sent`` bytes
    each way per iteration."""
    phases = {"forward": 1.0, "backward": 2.0, "optimizer": 0.5}
    samples = {metric: [value + offset] * ITERATIONS for metric, value in phases.items()}
    samples["batch"] = [sum(phases.values()) + 3 * offset] * ITERATIONS
    samples["comm"] = [1.5 + offset] * ITERATIONS
    samples["exposed"] = [0.5 + offset] * ITERATIONS
    samples["bytes_sent"] = samples["bytes_recv"] = [sent] * ITERATIONS
    return {"samples": samples, "iterations": ITERATIONS, "samples_processed": ITERATIONS * BATCH,
            "bytes_sent": sent * ITERATIONS, "bytes_recv": sent * ITERATIONS, "losses": losses,
            "verified_iterations": 1 if errors else 0, "grad_errors": list(errors),
            "memory": {"peak_rss_bytes": 100 + int(offset), "peak_cuda_bytes": None}}


def server_round(recv: int) -> dict:
    return {"samples": {"straggler": [0.1] * ITERATIONS, "aggregate": [0.01] * ITERATIONS,
                        "round": [0.2] * ITERATIONS},
            "bytes": {"recv": recv, "sent": recv}, "memory": {"peak_rss_bytes": 50, "peak_cuda_bytes": None}}


def make_record(**options) -> RunRecord:
    cfg = RunConfig(**options)
    job = validate(cfg, gpus=0)
    topology = Topology(cfg.ntrainer, cfg.ncudatrainer, cfg.nserver, cfg.ncudaserver, cfg.mapping)
    return RunRecord(job, topology, ["bench.py"], {"torch": torch.__version__, "python": "3", "hostname": "h",
                                                   "cuda_devices": [], "backend": cfg.backend})


def two_rounds(record: RunRecord) -> None:
    for elapsed, losses in ((0.5, [2.0, 1.0]), (0.25, [1.0, 0.5])):
        record.add_round(elapsed, [trainer_round(0.0, 3200, losses, errors=(1e-7,)),
                                   trainer_round(1.0, 3200, losses, errors=(3e-7,))], [server_round(2 * 3200 * 4)])


def test_an_ok_run_meets_the_contract_with_numbers_derived_from_the_rounds():
    record = make_record(verify=True)
    two_rounds(record)
    record.buckets = [{"index": 0, "bytes": 3200, "sparse": False}]
    record.replicas = replica_summary([torch.ones(3), torch.ones(3)])
    results = record.results("ok")
    check_contract(results)
    assert results["rounds_completed"] == 2
    assert metrics_of(results, "trainer") == TRAINER_METRICS and metrics_of(results, "server") == {
        "straggler", "aggregate", "round"}
    batch = next(r for r in results["summary"] if r["role"] == "trainer" and r["metric"] == "batch")
    assert batch["count"] == 2 * 2 * ITERATIONS and batch["min"] == 3.5 and batch["max"] == 6.5
    each = {"iterations": 2 * ITERATIONS, "samples_per_s": 2 * ITERATIONS * BATCH / 0.75}
    assert results["throughput"] == {"samples_per_s": 2 * 2 * ITERATIONS * BATCH / 0.75,
                                     "samples_per_iteration": BATCH, "iterations": 2 * ITERATIONS, "timed_s": 0.75,
                                     "untimed_s": 0.0,
                                     "per_trainer": [{"index": 0, "rank": 0, **each}, {"index": 1, "rank": 1, **each}]}
    assert results["bytes"] == {"trainer_sent_per_iter": 3200, "trainer_recv_per_iter": 3200,
                                "server_recv_per_iter": 6400, "server_sent_per_iter": 6400,
                                "server_recv_busiest_per_iter": 6400}
    assert results["loss"] == {"first": 1.5, "last": 0.75}
    assert results["verify"] == {"grad_rel_error_p50": 2e-7, "grad_rel_error_max": 3e-7, "iterations": 2,
                                 "buckets_checked": 4}
    assert results["memory"]["trainer"] == {"peak_rss_bytes": 101, "peak_cuda_bytes": None}
    assert results["replicas"] == {"identical": True, "param_norm": 3 ** 0.5, "max_abs_diff": 0.0,
                                   "checked_at": "every iteration"}
    assert results["config"]["model_size"]["ddp_buckets"] == record.buckets
    assert [entry["name"] for entry in results["samples"]] == ["trainer0", "trainer1", "server2"]
    assert results["samples"][1]["metrics"]["comm"] == [2.5] * 2 * ITERATIONS
    assert "limits" not in results  # no --limits
    assert results["timeline"] is None  # the rounds had none (a GPU's clocks)


def test_throughput_leaves_out_the_iterations_verify_checks_and_profile_traces():
    """As the batch samples leave them out: their wall time comes off the round's (the least any
    trainer spent on them, waits for the others included, so that every trainer's timed
    iterations still fit in what is left), and their samples off the samples processed."""
    record = make_record(verify=True)
    first, second = trainer_round(0.0, 3200, [1.0]), trainer_round(1.0, 3200, [1.0])
    first.update(untimed_s=0.1, untimed_samples=BATCH)
    second.update(untimed_s=0.2, untimed_samples=BATCH)
    record.add_round(0.5, [first, second], [server_round(0)])
    record.replicas = replica_summary([torch.ones(1), torch.ones(1)])
    throughput = record.results("ok")["throughput"]
    assert throughput["timed_s"] == pytest.approx(0.4) and throughput["untimed_s"] == 0.1
    assert throughput["iterations"] == ITERATIONS  # every iteration ran; 3 of them timed
    assert throughput["samples_per_s"] == pytest.approx(2 * (ITERATIONS - 1) * BATCH / 0.4)
    assert [each["samples_per_s"] for each in throughput["per_trainer"]] == pytest.approx(
        [(ITERATIONS - 1) * BATCH / 0.4] * 2)


def test_the_bucket_timeline_is_p50_over_trainers_and_iterations_in_ready_order():
    record = make_record()
    record.buckets = [{"index": 0, "bytes": 3200, "sparse": False}, {"index": 1, "bytes": 800, "sparse": False}]
    first, second = trainer_round(0.0, 4000, [1.0]), trainer_round(1.0, 4000, [1.0])
    first["timeline"] = {0: [(9.0, 12.0), (11.0, 14.0)], 1: [(2.0, 5.0)]}
    second["timeline"] = {0: [(10.0, 13.0)], 1: [(4.0, 6.0)]}
    record.add_round(0.5, [first, second], [server_round(0)])
    record.replicas = replica_summary([torch.ones(1), torch.ones(1)])
    results = record.results("ok")
    check_contract(results)
    assert results["timeline"] == [{"index": 1, "bytes": 800, "ready_ms": 3.0, "done_ms": 5.5},
                                   {"index": 0, "bytes": 3200, "ready_ms": 10.0, "done_ms": 13.0}]


def test_the_bucket_timeline_says_how_long_the_hook_held_backward_on_the_cpu(capsys):
    record = make_record()
    record.buckets = [{"index": 0, "bytes": 3200, "sparse": False}, {"index": 1, "bytes": 800, "sparse": False}]
    first, second = trainer_round(0.0, 4000, [1.0]), trainer_round(1.0, 4000, [1.0])
    first["timeline"] = {0: [(2.0, 12.0, 4.0), (3.0, 14.0, 6.0)], 1: [(9.0, 15.0, 1.0)]}
    second["timeline"] = {0: [(2.0, 13.0, 5.0)], 1: [(10.0, 16.0, 3.0)]}
    record.add_round(0.5, [first, second], [server_round(0)])
    record.replicas = replica_summary([torch.ones(1), torch.ones(1)])
    results = record.results("ok")
    check_contract(results)
    assert [(row["index"], row["held_ms"]) for row in results["timeline"]] == [(0, 5.0), (1, 2.0)]
    print_report(results, record.rows())
    assert "hooks held backward: 7.0 ms an iteration (bucket 0 5.0 ms) before their" in capsys.readouterr().out


def test_the_servers_lane_places_each_answer_in_the_iteration_whose_backward_began_last():
    """Trainer 0's last backward starts 100, 200 and 300 ms; the server's answers of piece 5 (at
    150, 260, 340 ms, and one of an earlier iteration at 90) go to 100, 200 and 300, the earlier
    one left out; a server on another clock has no lane."""
    began = {"clock": "boot-a", "ms": [100.0, 200.0, 300.0]}
    spans = {5: [(80.0, 85.0, 90.0), (120.0, 140.0, 150.0), (230.0, 250.0, 260.0),
                 (310.0, 330.0, 340.0)], 2: [(140.0, 141.0, 142.0)]}
    assert server_offsets(began, {"clock": "boot-a", "spans": spans}) == {
        5: [(20.0, 40.0, 50.0), (30.0, 50.0, 60.0), (10.0, 30.0, 40.0)], 2: [(40.0, 41.0, 42.0)]}
    assert server_offsets(began, {"clock": "boot-b", "spans": spans}) == {}
    assert server_offsets(None, {"clock": "boot-a", "spans": spans}) == {}
    record = make_record(hook="ps", nserver=2, ntrainer=2)
    first, second = trainer_round(0.0, 4000, [1.0]), trainer_round(1.0, 4000, [1.0])
    first["backward_began"] = began
    record.add_round(0.5, [first, second], [
        {**server_round(0), "recent": {"clock": "boot-a", "spans": spans}},
        {**server_round(0), "recent": {"clock": "boot-a", "spans": {9: [(205.0, 210.0, 215.0)]}}}])
    record.replicas = replica_summary([torch.ones(1), torch.ones(1)])
    results = record.results("ok")
    check_contract(results)
    assert results["server_timeline"] == [
        {"server": 1, "slice": 9 // PIECES, "piece": 9 % PIECES, "first_ms": 5.0, "last_ms": 10.0,
         "answered_ms": 15.0},
        {"server": 0, "slice": 5 // PIECES, "piece": 5 % PIECES, "first_ms": 20.0, "last_ms": 40.0,
         "answered_ms": 50.0},
        {"server": 0, "slice": 2 // PIECES, "piece": 2 % PIECES, "first_ms": 40.0, "last_ms": 41.0,
         "answered_ms": 42.0}]


def test_a_server_on_a_clock_of_its_own_is_placed_by_the_measured_offsets():
    """The same answers read on a server clock 5000 ms ahead of trainer 0's: with the offsets the
    master measured (``env.clocks``), the lane is the one on a shared clock; without, none."""
    began = {"clock": "boot-a", "ms": [100.0, 200.0]}
    spans = {5: [(120.0, 140.0, 150.0), (230.0, 250.0, 260.0)]}
    ahead = {5: [tuple(at + 5000.0 for at in span) for span in spans[5]]}
    shared = server_offsets(began, {"clock": "boot-a", "spans": spans})
    clocks = [{"rank": 0, "offset_ms": -1000.0}, {"rank": 2, "offset_ms": 4000.0}]
    assert ahead_ms(clocks, 2, 0) == 5000.0 and ahead_ms(clocks, 3, 0) is None
    assert server_offsets(began, {"clock": "boot-b", "spans": ahead}, ahead_ms(clocks, 2, 0)) == shared
    assert server_offsets(began, {"clock": "boot-b", "spans": ahead}, None) == {}


def test_a_clock_is_read_against_the_masters_within_half_the_shortest_round_trip():
    """Cristian's estimate over three round trips to a rank whose clock runs 1000 ms ahead, each
    trip's reading taken somewhere inside it: the shortest trip (0.4 ms) bounds the offset to
    0.2 ms, and the truth is within it; a rank on the master's own clock is 0 exactly."""
    trips = [(10.0, 1011.9, 13.0), (20.0, 1020.1, 20.4), (30.0, 1030.5, 30.6)]  # sent, reading, back
    samples = [(sent, ("boot-b", reading), back) for sent, reading, back in trips]
    clock = clock_offset("boot-a", samples)
    assert clock["trip_ms"] == pytest.approx(0.4) and clock["error_ms"] == pytest.approx(0.2)
    assert clock["offset_ms"] == clock["measured_ms"] == pytest.approx(1020.1 - 20.2)
    assert abs(clock["offset_ms"] - 1000.0) <= clock["error_ms"] and not clock["shared"]
    same = clock_offset("boot-b", samples)
    assert same["shared"] and same["offset_ms"] == same["error_ms"] == 0.0
    assert same["measured_ms"] == clock["measured_ms"]


def test_a_servers_books_keep_each_pieces_last_answers_for_the_lane():
    books = ServerBooks()
    for iteration in range(TIMELINE_ITERATIONS + 3):
        books.record((7, 10.0 * iteration, 10.0 * iteration + 1, 10.0 * iteration + 2), round=2.0)
    taken = books.take()["recent"]
    assert taken["clock"] == clock_id() and len(taken["spans"][7]) == TIMELINE_ITERATIONS
    last = 10.0 * (TIMELINE_ITERATIONS + 2)
    assert taken["spans"][7][-1] == (last, last + 1, last + 2)
    assert books.take()["recent"]["spans"] == {}  # each round's own


def test_hooks_that_held_backward_for_no_time_get_no_line():
    """--hook local_sgd's hook returns at once: "hooks held backward: 0.0 ms an iteration ...:
    backward waited" said backward waited for nothing."""
    assert held_line([{"index": 0, "held_ms": 0.01}, {"index": 1, "held_ms": 0.02}]) is None
    assert held_line([{"index": 0, "held_ms": 0.04}, {"index": 1, "held_ms": 0.02}]).startswith(
        "hooks held backward: 0.1 ms an iteration (bucket 0 0.0 ms)")


def test_units_live_in_the_rows():
    record = make_record()
    two_rounds(record)
    units = {(row.metric, row.unit) for row in record.rows()}
    assert ("bytes_sent", "B") in units and ("batch", "ms") in units and ("round", "ms") in units
    assert all(row["unit"] == "ms" for row in record.results("ok")["summary"])  # bytes are not in the summary
    assert {row.rank for row in record.rows(split_ranks=True)} == {None, 0, 1, 2}


def test_a_run_that_failed_after_a_round_keeps_it():
    record = make_record()
    two_rounds(record)
    results = record.results("failed", error="trainer 1 (rank 1, trainer1) was killed by SIGKILL")
    check_contract(results, status="failed")
    assert results["replicas"] is None and results["rounds_completed"] == 2


def test_a_run_that_finished_nothing_still_says_what_was_asked(tmp_path):
    config = RunConfig().to_dict()
    results = failed_results(None, "interrupted by SIGINT", config=config, argv=["bench.py"], env={"torch": "x"})
    check_failed_minimum(results)
    assert results["config"] == config and results["error"] == "interrupted by SIGINT"
    assert read_snapshot(tmp_path) is None
    record = make_record()
    two_rounds(record)
    write_snapshot(record.results("failed", error="the job ended before it finished"), tmp_path)
    kept = failed_results(read_snapshot(tmp_path), "interrupted by SIGTERM", config=config)
    check_contract(kept, status="failed")
    assert kept["error"] == "interrupted by SIGTERM" and kept["rounds_completed"] == 2


def test_snapshots_are_paced_by_what_writing_them_costs_not_by_the_first_ones_one_off_cost():
    pacing = SnapshotPacing()
    assert pacing.due(0.0)
    pacing.wrote(0.0, 0.25)  # the first: imports and a cold cache, paid once
    assert pacing.due(0.3)  # the rounds that finish next are kept
    pacing.wrote(0.3, 0.32)  # cheap: every round
    assert pacing.due(0.33)
    pacing.wrote(0.4, 0.6)  # a large snapshot: written again only after ten times its cost
    assert not pacing.due(1.5) and pacing.due(2.6)


def test_a_paced_out_snapshot_leaves_the_pacing_behind_until_the_next_is_written():
    # behind: what the master's SIGTERM handler writes before the job is stopped
    pacing = SnapshotPacing()
    pacing.wrote(0.0, 0.25)
    pacing.wrote(0.3, 0.5)
    assert not pacing.behind
    assert not pacing.due(0.6) and pacing.behind
    assert pacing.due(2.6) and pacing.behind  # due, not yet written
    pacing.wrote(2.6, 2.7)
    assert not pacing.behind


def test_floors_and_efficiency_follow_the_strategys_record():
    record = make_record(limits=True)
    two_rounds(record)
    record.floor_messages = {0: [(800, "float32")]}
    record.add_floors([{"rpc_ms": [1.0, 3.0], "collective_ms": [0.5], "compute_ms": [2.0]},
                       {"rpc_ms": [2.0], "collective_ms": [1.5], "compute_ms": [4.0]}])
    assert record.limits() is None  # not before the memcpy floor is in, once the rounds are over
    record.memcpy = {"bytes": 3200, "count": 1, "p50_ms": 0.01, "gbps": 0.32}
    results = record.results("ok")
    assert results["limits"]["rpc"]["p50_ms"] == 2.0 and results["limits"]["rpc"]["count"] == 3
    assert results["limits"]["collective"]["busbw_gbps"] == results["limits"]["collective"]["algbw_gbps"]
    assert results["limits"]["compute"] == {"count": 2, "p50_ms": 3.0}
    efficiency = results["efficiency"]
    assert efficiency["floor"] == "rpc" and efficiency["floor_ms"] == 2.0  # ps is held against the RPC floor
    assert efficiency["cost_ms"] == 2.0 and efficiency["value"] == 1.0  # comm p50 over both trainers
    assert efficiency["exposed_ms"] == pytest.approx(5.0 - 3.0)
    assert results["limits"]["own"] is None and efficiency["floor_of"] == "its float32 buckets"
    assert efficiency["gain_over_float32"] == efficiency["value"]  # it sends float32: no gain to speak of
    json.dumps(results)


def test_a_compressing_strategy_is_held_against_its_own_bytes_and_gains_over_float32():
    record = make_record(limits=True, hook="ps_fp16")
    two_rounds(record)
    record.floor_messages, record.own_messages = {0: [(800, "float32")]}, {0: [(800, "float16")]}
    record.add_floors([{"rpc_ms": [4.0], "own_ms": [2.0], "collective_ms": [0.5], "compute_ms": [2.0]},
                       {"rpc_ms": [4.0], "own_ms": [1.0, 3.0], "collective_ms": [1.5], "compute_ms": [4.0]}])
    record.memcpy = {"bytes": 3200, "count": 1, "p50_ms": 0.01, "gbps": 0.32}
    results = record.results("ok")
    own = results["limits"]["own"]
    assert own["bytes_per_iter"] == 1600 and own["p50_ms"] == 2.0 and own["transport"] == "rpc"
    efficiency = results["efficiency"]
    assert efficiency["floor_of"] == "its own messages" and efficiency["floor_ms"] == 2.0
    assert efficiency["value"] == 1.0  # 2 ms of floor over 2 ms of comm
    assert efficiency["float32_floor_ms"] == 4.0 and efficiency["gain_over_float32"] == 2.0


def test_a_sparse_buckets_busbw_counts_it_once_for_each_other_trainer():
    """3 trainers, fp16 on a model with a sparse bucket (0, all-gathered in float32 as gloo sends
    it) and a dense one (1): each trainer's link carries 2(n-1)/n of the dense bytes and n-1
    times the sparse ones, in the float32 floor and in the strategy's own alike."""
    record = make_record(limits=True, hook="fp16", ntrainer=3, nserver=0)
    rounds = [trainer_round(0.0, 3200, [1.0]) for _ in range(3)]
    record.add_round(0.5, rounds, [])
    record.floor_messages = {0: [(500, "float32")], 1: [(750, "float32")]}
    record.own_messages = {0: [(500, "float32")], 1: [(750, "float16")]}
    record.floor_gathered = [0]
    record.add_floors([{"collective_ms": [1.0], "own_ms": [1.0], "compute_ms": [1.0]}] * 3)
    record.memcpy = {"bytes": 5000, "count": 1, "p50_ms": 0.01, "gbps": 0.5}
    limits = record.results("ok")["limits"]
    assert limits["collective"]["all_gathered"] == [0]
    assert limits["collective"]["busbw_gbps"] == pytest.approx((2 * 2000 + 4 / 3 * 3000) / 1e-3 / 1e9)
    assert limits["own"]["busbw_gbps"] == pytest.approx((2 * 2000 + 4 / 3 * 1500) / 1e-3 / 1e9)


def test_the_printed_report_and_the_file_come_from_the_same_record(tmp_path, capsys):
    record = make_record()
    two_rounds(record)
    record.replicas = replica_summary([torch.ones(2), torch.tensor([1.0, 1.5])])
    results = record.results("ok")
    print_report(results, record.rows())
    printed = capsys.readouterr().out
    assert "Trainers (timed rounds)" in printed and "Parameter servers (timed rounds)" in printed
    assert "replicas: identical=false" in printed and "max_abs_diff=0.5" in printed
    assert "bytes per iteration: trainer sent 3200, recv 3200; server recv 6400, sent 6400" in printed
    assert json.loads(write_results(results, tmp_path / "r.json").read_text()) == results


def test_a_run_without_servers_prints_no_server_bytes(capsys):
    """--hook allreduce starts no server: its bytes line had ended "server recv 0, sent 0"."""
    record = make_record(hook="allreduce", nserver=0)
    for elapsed, losses in ((0.5, [2.0, 1.0]), (0.25, [1.0, 0.5])):
        record.add_round(elapsed, [trainer_round(0.0, 3200, losses), trainer_round(1.0, 3200, losses)], [])
    record.replicas = replica_summary([torch.ones(2), torch.ones(2)])
    results = record.results("ok")
    print_report(results, record.rows())
    printed = capsys.readouterr().out.splitlines()
    [line] = [line for line in printed if line.startswith("bytes per iteration")]
    assert line == "bytes per iteration: trainer sent 3200, recv 3200"
    results["throughput"]["iterations"] = 1  # a round of one iteration: it said "1 iterations"
    print_report(results, record.rows())
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("throughput")]
    assert line.endswith(" over 1 iteration per trainer")


def test_replicas_that_diverged_alike_are_identical_and_the_report_says_they_diverged(capsys):
    nan = float("nan")
    alike = replica_summary([torch.tensor([1.0, nan]), torch.tensor([1.0, nan])])
    assert alike["identical"] is True and math.isnan(alike["param_norm"]) and alike["max_abs_diff"] == 0.0
    crossed = replica_summary([torch.tensor([1.0, nan]), torch.tensor([nan, 1.0])])
    assert crossed["identical"] is False and crossed["max_abs_diff"] == math.inf
    apart = replica_summary([torch.tensor([1.0, nan]), torch.tensor([2.0, nan])])
    assert apart["identical"] is False and apart["max_abs_diff"] == 1.0
    inf = float("inf")
    assert replica_summary([torch.tensor([inf, -inf]), torch.tensor([inf, -inf])])["max_abs_diff"] == 0.0
    record = make_record()
    two_rounds(record)
    record.replicas = alike
    print_report(record.results("ok"), record.rows())
    printed = capsys.readouterr().out
    assert ("identical=true param_norm=nan max_abs_diff=0 (parameters not finite: the training diverged; "
            "a smaller --lr?)") in printed


def test_servers_that_receive_unevenly_are_named_by_the_busiest(capsys):
    """Three servers and one piece: the mean per server (a third) hid that one took everything."""
    record = make_record(nserver=3)
    for elapsed in (0.5, 0.25):
        record.add_round(elapsed, [trainer_round(0.0, 3200, [1.0]), trainer_round(1.0, 3200, [1.0])],
                         [server_round(2 * 3200 * ITERATIONS), server_round(0), server_round(0)])
    record.replicas = replica_summary([torch.ones(1), torch.ones(1)])
    results = record.results("ok")
    check_contract(results)
    assert results["bytes"]["server_recv_per_iter"] == pytest.approx(6400 / 3)
    assert results["bytes"]["server_recv_busiest_per_iter"] == 6400
    print_report(results, record.rows())
    assert "server recv 2133 (the busiest server 6400), sent 2133" in capsys.readouterr().out
    two_rounds(even := make_record())
    even.replicas = results["replicas"]
    print_report(even.results("ok"), even.rows())
    assert "server recv 6400, sent 6400\n" in capsys.readouterr().out


def test_a_report_whose_every_iteration_was_verified_says_why_it_has_no_batch_times(capsys):
    record = make_record()
    two_rounds(record)
    record.replicas = replica_summary([torch.ones(2), torch.ones(2)])
    results = record.results("ok")
    results["verify"] = {"buckets_checked": 0, "iterations": 2}
    print_report(results, record.rows())
    assert "no batch times" not in capsys.readouterr().out
    print_report(results, [row for row in record.rows() if row.metric != "batch"])
    assert "no batch times: --verify checked every iteration" in capsys.readouterr().out


def progress(curve: list[tuple[int, float]], batch_ms: list[float], held_out=(), stopped=False, reached_at=None,
             diverged=False) -> dict:
    """What a --target-loss round adds on one trainer, made up."""
    return {"convergence": {"curve": curve, "held_out": list(held_out), "batch_ms": batch_ms, "stopped": stopped,
                            "reached_at": reached_at, "diverged": diverged}}


def test_time_to_target_counts_every_iteration_on_the_slowest_trainer():
    record = make_record(target_loss=1.5, max_iterations=30)
    losses = [2.0] * 10 + [1.0] * 10  # the mean of the last 10 meets 1.5 first after 15 iterations
    curve = list(enumerate(losses))
    assert not record.progress.add([progress(curve[:11], [1.0] * 10, held_out=[(0, 2.5)]),
                                    progress(curve[:11], [2.0] * 10)])  # a warmup round counts too
    assert record.progress.add([progress(curve[11:16], [1.0] * 5, held_out=[(15, 1.2)], stopped=True, reached_at=15),
                                progress(curve[11:16], [3.0] * 5, stopped=True, reached_at=15)])
    convergence = record.results("ok")["convergence"]
    assert convergence["reached"] and convergence["stopped_by"] == "target" and convergence["iterations"] == 15
    assert convergence["seconds"] == pytest.approx((10 * 2.0 + 5 * 3.0) / 1000)  # trainer 1 is slower
    assert convergence["loss_curve"][10] == [10, pytest.approx(0.020), 1.0]
    assert convergence["held_out"] == [[0, 0.0, 2.5], [15, pytest.approx(0.035), 1.2]]
    assert convergence["final_loss"] == pytest.approx(sum(losses[6:16]) / 10)
    assert "| 15/30 iterations" in record.progress.line()


def test_a_diverged_run_is_not_reached_and_stays_plain_json():
    record = make_record(target_loss=0.5)
    record.progress.add([progress([(0, 2.0), (1, float("nan"))], [1.0], stopped=True, diverged=True)] * 2)
    convergence = record.results("ok")["convergence"]
    assert not convergence["reached"] and convergence["stopped_by"] == "diverged"
    assert convergence["loss_curve"][1][2] is None and convergence["max_iterations"] == 1000
    json.loads(json.dumps(convergence, allow_nan=False))


def test_fingerprints_decide_only_bit_identical_finite_replicas():
    """The master compares fingerprints first and fetches the parameters only when they cannot
    decide: any differing bit (here -0.0 against 0.0, equal as numbers) or a non-finite one."""
    vector = torch.tensor([1.0, 2.0, 0.0, -2.0])
    same = [fingerprint(vector.clone()) for _ in range(2)]
    assert replicas_alike(same) == replica_summary([vector, vector.clone()])
    assert replicas_alike(same)["param_norm"] == pytest.approx(3.0, rel=1e-15)
    signed_zero = vector.clone()
    signed_zero[2] = -0.0
    assert replicas_alike([same[0], fingerprint(signed_zero)]) is None
    assert replica_summary([vector, signed_zero])["identical"] is True  # the vectors then decide
    not_finite = vector.clone()
    not_finite[0] = float("nan")
    assert replicas_alike([fingerprint(not_finite)] * 2) is None


def test_the_norm_in_chunks_is_the_float64_norm():
    vector = torch.randn(10_001)
    assert parameter_norm(vector, chunk=1000) == pytest.approx(vector.double().norm().item(), rel=1e-12)
