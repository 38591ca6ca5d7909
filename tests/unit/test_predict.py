"""``bench.py predict``: each model against values computed by hand, the bucket pipeline on a
made-up timeline, the calibration from a made-up results file, and bad input."""

from __future__ import annotations

import ast
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from ps_bench.cli import main
from ps_bench.metrics.limits import fit_link, link_summary
from ps_bench.metrics import costs, messages
from ps_bench.predict import pipelines
from ps_bench.predict import predictor as predictor_module
from ps_bench.metrics.costs import Link
from ps_bench.predict.pipelines import Phases
from ps_bench.predict.calibration import compute_ready, from_compute_ms
from ps_bench.predict.calibration import low_rank_ratios
from ps_bench.predict.inputs import TargetLink, model_buckets
from ps_bench.predict.predictor import calibrate, predict
from ps_bench.predict.rows import prediction_rows
from ps_bench.predict.runs import Run, runs_of
from ps_bench.predict.tables import describe_calibration, plot_series, render_winners, winners
from ps_bench.strategies import COLLECTIVE, HOOKS, Cost, Strategy

# 1 MB per ms (8 Gbit/s), 10 µs per message: round numbers to compute by hand
LINK = Link(latency_ms=0.01, bytes_per_ms=1e6)
MB = 1e6


def whole(buckets: list[tuple[float, float]], servers: int) -> list[tuple[float, float, int]]:
    """Buckets pushed whole, dealt over the servers as the run deals them."""
    return pipelines.server_pieces(buckets, servers)


def test_ring_allreduce_is_2_n_minus_1_latencies_plus_2_n_minus_1_over_n_of_the_bytes():
    assert costs.ring_allreduce_ms(1, 8 * MB, LINK) == 0.0  # one trainer: nothing to combine
    assert costs.ring_allreduce_ms(2, 8 * MB, LINK) == pytest.approx(2 * 0.01 + 8.0)
    assert costs.ring_allreduce_ms(4, 8 * MB, LINK) == pytest.approx(6 * 0.01 + 1.5 * 8.0)
    assert costs.ring_allreduce_ms(4, 8 * MB, LINK, steps_per_message=3) == pytest.approx(18 * 0.01 + 12.0)


def test_allgather_moves_n_minus_1_payloads():
    assert costs.allgather_ms(1, MB, LINK) == 0.0
    assert costs.allgather_ms(3, MB, LINK) == pytest.approx(2 * 0.01 + 2.0)


def test_byteps_bound_runs_from_allreduce_at_k_0_to_one_payload_at_k_n():
    assert costs.byteps_bound_ms(4, 0, 8 * MB, LINK) == pytest.approx(1.5 * 8.0)
    assert costs.byteps_bound_ms(4, 4, 8 * MB, LINK) == pytest.approx(8.0)
    assert costs.byteps_bound_ms(1, 1, 8 * MB, LINK) == 0.0


def test_pipeline_starts_each_transfer_when_ready_and_after_the_previous():
    # ready at 10 and 20 ms, 15 ms each: the second waits for the first (10 + 15 = 25), ends at 40
    assert pipelines.pipeline([(10.0, 15.0), (20.0, 15.0)], lambda ms: ms) == pytest.approx(40.0)
    # ready far apart: each runs as soon as it is ready; the last ends at 50 + 15
    assert pipelines.pipeline([(0.0, 15.0), (50.0, 15.0)], lambda ms: ms) == pytest.approx(65.0)
    assert pipelines.pipeline([], lambda ms: ms) == 0.0


def test_one_trainer_one_server_is_a_round_trip():
    # out (1 ms on the trainer's link, then the server's), back (1 ms), a latency each way
    assert pipelines.ps_pipeline(whole([(0.0, MB)], 1), 1, 1, LINK) == pytest.approx(2.0 + 2 * 0.01)


def test_one_server_carries_every_trainers_bytes_both_ways():
    # 4 trainers, one 8 MB bucket ready at once: 32 MB in through the server's link, 32 MB out
    assert pipelines.ps_pipeline(whole([(0.0, 8 * MB)], 1), 4, 1, LINK) == pytest.approx(64.0 + 2 * 0.01)
    # ... and the aggregation of the last copy at 4 MB/ms between them
    assert pipelines.ps_pipeline(whole([(0.0, 8 * MB)], 1), 4, 1, LINK,
                                 aggregate_bytes_per_ms=4 * MB) == pytest.approx(
        64.0 + 2.0 + 2 * 0.01)


def test_servers_beyond_the_buckets_do_nothing_and_shards_pipeline():
    buckets = [(0.0, 6 * MB), (0.0, 2 * MB)]
    two = pipelines.ps_pipeline(whole(buckets, 2), 2, 2, LINK)
    # server 0 holds the 6 MB bucket: 12 MB in (the trainers' links send 6 MB first), 12 MB back
    assert two == pytest.approx(24.0 + 2 * 0.01)
    assert pipelines.ps_pipeline(whole(buckets, 8), 2, 8, LINK) == pytest.approx(two)  # k > n, buckets
    # one server: the 6 MB bucket is in at 12 and answered by 24, overlapping the 2 MB bucket's
    # arrival (in at 16); its answer (4 ms) follows the first on the server's link: 28 ms
    assert pipelines.ps_pipeline(whole(buckets, 1), 2, 1, LINK) == pytest.approx(
        max(12.0 + 12.0, 16.0) + 4.0 + 2 * 0.01)


def test_group_mapping_sends_everything_to_the_groups_server():
    # 4 trainers in 2 groups: each server hears from 2 trainers, 8 MB each: 16 in, 16 out
    assert pipelines.ps_pipeline(whole([(0.0, 8 * MB)], 2), 4, 2, LINK, mapping="group") == pytest.approx(
        32.0 + 2 * 0.01)


def test_iteration_overlaps_backward_with_the_transfers():
    phases = Phases(forward=5.0, backward=30.0, optimizer=2.0)
    assert pipelines.iteration_ms(phases, communication_end=20.0) == pytest.approx(37.0)  # hidden behind backward
    assert pipelines.iteration_ms(phases, communication_end=50.0, own_ms=3.0) == pytest.approx(60.0)


def test_the_link_fit_recovers_latency_and_bandwidth():
    latency_ms, per_byte = 0.05, 1 / 125e3  # 50 µs, 1 Gbit/s
    points = [(size, 2 * latency_ms + 2 * size * per_byte) for size in (4096, 1 << 20, 16 << 20)]
    fitted = fit_link(points, "rpc", 1)
    assert fitted["latency_us"] == pytest.approx(50.0, rel=1e-6)
    assert fitted["bandwidth_gbit_s"] == pytest.approx(1.0, rel=1e-6)
    ring = [(size, 2 * 3 * latency_ms + 1.5 * size * per_byte) for size in (4096, 1 << 20)]  # 4 trainers
    assert link_summary({size: [ms] for size, ms in ring}, "allreduce", 4)["bandwidth_gbit_s"] == pytest.approx(1.0)
    assert link_summary({4096: [1.0]}, "allreduce", 2) is None  # one size cannot separate the two


def test_the_link_fit_takes_the_rate_large_messages_get():
    """A 1 Gbit/s shaped link's probe (two trainers, all-reduce): its burst speeds the 1 MiB
    message and its 4 KiB one paid a stray 4 ms. The bandwidth is what the 16 MiB message got
    (TCP's payload, 0.95 of the line), not a compromise pulled above the line by the others."""
    points = [(4096, 3.98), (1 << 20, 8.65), (16 << 20, 141.69)]  # measured p50s, ms
    fitted = fit_link(points, "allreduce", 2)
    assert fitted["bandwidth_gbit_s"] == pytest.approx(0.946, abs=0.001)
    assert fitted["latency_us"] == pytest.approx(1973, abs=2)  # the stray 4 KiB time, 2 steps
    largest = 2 * fitted["latency_us"] / 1e3 + (16 << 20) * 8 / (fitted["bandwidth_gbit_s"] * 1e6)
    assert largest == pytest.approx(141.69, rel=0.03)


def test_a_results_file_of_an_earlier_fit_is_refitted_from_its_points(tmp_path):
    points = [(4096, 3.98), (1 << 20, 8.65), (16 << 20, 141.69)]
    link = {"method": "allreduce", "peers": 2, "latency_us": 1804.0, "bandwidth_gbit_s": 1.234,
            "points": [{"bytes": size, "p50_ms": ms} for size, ms in points]}
    path = results_file(tmp_path)
    results = json.loads(Path(path).read_text())
    results["limits"]["link"] = link
    Path(path).write_text(json.dumps(results))
    run = Run.load(path)
    assert run.link["bandwidth_gbit_s"] == pytest.approx(fit_link(points, "allreduce", 2)["bandwidth_gbit_s"])
    assert run.link["bandwidth_gbit_s"] == pytest.approx(0.946, abs=0.001)
    assert run.link["points"] == link["points"]  # what was measured stays as it was


def results_file(tmp_path, name: str = "r.json", hook: str = "allreduce", trainers: int = 2, servers: int = 0,
                 batch_ms: float = 100.0, limits: bool = True, status: str = "ok", **extra) -> str:
    """A made-up results file: 10 ms forward, 2 ms optimizer, compute-only 52 ms, two 10 MB
    buckets ready at 15 and 40 ms, a link of 10 µs and 8 Gbit/s."""
    results = {
        "schema": "ps_bench.result/1", "status": status,
        "config": {"hook": hook, "ntrainer": trainers, "ncudatrainer": 0, "nserver": servers, "ncudaserver": 0,
                   "mapping": "shard", "batch_size": 32, "model": "DummyModel",
                   "model_size": {"ddp_buckets": [{"index": 0, "bytes": 10 * MB, "sparse": False},
                                                  {"index": 1, "bytes": 10 * MB, "sparse": False}]}},
        "summary": [{"role": "trainer", "metric": metric, "p50": value}
                    for metric, value in (("batch", batch_ms), ("forward", 10.0), ("optimizer", 2.0))],
        "timeline": [{"index": 0, "bytes": 10 * MB, "ready_ms": 15.0, "done_ms": 30.0},
                     {"index": 1, "bytes": 10 * MB, "ready_ms": 40.0, "done_ms": 60.0}],
        "bytes": {"trainer_sent_per_iter": 20 * MB}, "env": {},
        **({"limits": {"compute": {"p50_ms": 52.0}, "memcpy": {"gbps": 0.0},
                       "link": {"latency_us": 10.0, "bandwidth_gbit_s": 8.0}}} if limits else {}),
        **extra,
    }
    path = tmp_path / name
    path.write_text(json.dumps(results))
    return str(path)


def test_predict_reads_a_sweep_folder_as_the_runs_it_holds(tmp_path, capsys):
    """A sweep's folder (its results.jsonl), or that file, calibrates as the runs it holds, as
    report and compare read it, its failed points passed over; a folder whose every run failed
    is one line and exit 2 (it was "not JSON: Extra data at line 2")."""
    ar, ps, failed = (json.loads(open(results_file(tmp_path, name, **kw)).read()) for name, kw in (
        ("ar.json", {"batch_ms": 80.0}), ("ps.json", {"hook": "ps", "servers": 1, "batch_ms": 150.0}),
        ("fp16.json", {"hook": "fp16", "status": "failed", "error": "trainer 1 exited"})))
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (ar, failed, ps)))
    predictions = []
    for sources in ([tmp_path / "ar.json", tmp_path / "ps.json"], [sweep], [sweep / "results.jsonl"]):
        out = tmp_path / "predict.json"
        assert main(["predict", *map(str, sources), "--trainers", "8", "--out", str(out)]) == 0
        predictions.append(json.loads(out.read_text())["predictions"])
    assert predictions[0] == predictions[1] == predictions[2]
    assert {row["strategy"] for row in predictions[0]} >= {"allreduce", "ps"}
    (sweep / "results.jsonl").write_text(json.dumps(failed) + "\n")
    capsys.readouterr()
    assert main(["predict", str(sweep), "--trainers", "8"]) == 2
    assert capsys.readouterr().err == (f"ps_bench: error: {sweep}: every run of this sweep folder failed "
                                       f"(1 run): predict from runs that finished\n")


def test_runs_on_stale_synchronous_servers_are_not_predicted(tmp_path, capsys):
    """predict models synchronous strategies: a run with --staleness (recorded as hook ps) stood
    in ps's measured column and fitted its own compute; named on its own it is refused, in a
    sweep's folder passed over as a failed run is."""
    sync = json.loads(open(results_file(tmp_path, "ps.json", hook="ps", servers=1)).read())
    stale = {**sync, "config": {**sync["config"], "staleness": "inf"}}
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    assert main(["predict", str(tmp_path / "stale.json"), "--trainers", "2"]) == 2
    assert capsys.readouterr().err == (f"ps_bench: error: {tmp_path / 'stale.json'} ran --staleness inf: "
                                       f"predict models synchronous strategies; give runs without --staleness\n")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text(json.dumps(stale) + "\n" + json.dumps(sync) + "\n")
    assert [run.hook for run in runs_of([str(sweep)])] == ["ps"]
    (sweep / "results.jsonl").write_text(json.dumps(stale) + "\n")
    assert main(["predict", str(sweep), "--trainers", "2"]) == 2
    assert "every run of this sweep folder failed or ran --staleness (1 run)" in capsys.readouterr().err


def test_a_periodic_strategy_is_measured_by_its_mean_iteration(tmp_path):
    """local SGD and DiLoCo synchronise once a period: their p50 iteration synchronises nothing,
    so predict, which amortises the period, takes their mean (it put local_sgd's p50 of 42 ms
    beside a prediction of 141 amortised, and fitted its own compute below 0); every other
    strategy its p50."""
    batches = {}
    for hook in ("local_sgd", "diloco", "allreduce"):
        results = json.loads(open(results_file(tmp_path, f"{hook}.json", hook=hook)).read())
        results["summary"] = [{**row, "p50": 42.0, "mean": 130.0} if row["metric"] == "batch"
                              else row for row in results["summary"]]
        batches[hook] = Run.of(results, hook).batch_ms
    assert batches == {"local_sgd": 130.0, "diloco": 130.0, "allreduce": 42.0}


def test_a_run_faster_than_its_own_compute_allows_gets_no_negative_own_compute(tmp_path):
    # the model gives a 2-trainer all-reduce 62.02 ms with this run's compute and link (below);
    # a batch of 40 ms means its compute-only iteration ran slower than its rounds
    calibration = calibrate([Run.load(results_file(tmp_path, "ar.json", batch_ms=40.0))])
    assert calibration.own_ms["allreduce"] == 0.0
    assert predict(calibration, "allreduce", 2, 0)["batch_ms"] == pytest.approx(62.02)
    note, = calibration.notes
    assert note.startswith("allreduce's run took 22.0 ms less than the model gives it")
    assert f"note: {note}" in describe_calibration(calibration)
    assert calibration.to_dict()["notes"] == [note]


def test_calibration_reads_phases_timeline_and_link_and_fits_each_strategys_own_compute(tmp_path):
    allreduce = Run.load(results_file(tmp_path, "ar.json", batch_ms=80.0))
    ps = Run.load(results_file(tmp_path, "ps.json", hook="ps", servers=1, batch_ms=150.0))
    calibration = calibrate([allreduce, ps])
    assert calibration.phases == Phases(forward=10.0, backward=40.0, optimizer=2.0)
    assert [(bucket.ready_ms, bucket.nbytes) for bucket in calibration.buckets] == [(15.0, 10 * MB), (40.0, 10 * MB)]
    assert calibration.link == LINK
    # all-reduce at 2 trainers: 10 ms per bucket (+ 20 µs); bucket 1 starts at 40, ends at 50.02;
    # the iteration is 10 + 50.02 + 2 = 62.02 by the model, 80 measured: 17.98 ms its own
    assert calibration.own_ms["allreduce"] == pytest.approx(80.0 - 62.02)
    assert predict(calibration, "allreduce", 2, 0)["batch_ms"] == pytest.approx(80.0)  # its calibration point
    # at 4 trainers each bucket takes 15 ms (+ 60 µs): bucket 1 ends at 55.06
    assert predict(calibration, "allreduce", 4, 0)["batch_ms"] == pytest.approx(10 + 55.06 + 2 + 17.98)
    assert predict(calibration, "ps", 2, 1)["batch_ms"] == pytest.approx(150.0)
    assert predict(calibration, "fp16", 2, 0)["own_ms"] == pytest.approx(80.0 - 62.02)  # no run: allreduce's
    assert predict(calibration, "ps_fp16", 2, 1)["own_ms"] == calibration.own_ms["ps"]
    # no run of ps_node: ps's, the same servers answering a round trip per bucket
    node_ps = predict(replace(calibration, intra_link=LINK), "ps_node", 4, 2, per_node=2)
    assert node_ps["own_ms"] == calibration.own_ms["ps"] > 0
    assert predict(calibration, "noop", 2, 0)["own_ms"] == 0.0
    assert predict(calibration, "powersgd", 2, 0) is None  # its bytes are known only from a run of it


def test_sparse_ps_pushes_its_sparse_buckets_and_all_reduces_its_dense_ones(tmp_path):
    """As it sends them: on a dense model it is all-reduce; with a sparse bucket, that bucket's
    push to the servers and the dense ones' ring run at once, and the later ends it."""
    calibration = calibrate([Run.load(results_file(tmp_path, "ar.json", batch_ms=80.0))])
    for trainers in (2, 8):
        assert predict(calibration, "sparse_ps", trainers, 1)["communication_end_ms"] == pytest.approx(
            predict(calibration, "allreduce", trainers, 0)["communication_end_ms"])
    # bucket 1 sparse, pushed whole to the one server: its link carries 2 trainers' 10 MB in, 20 ms,
    # then out, 20 ms, from 40 (and a latency each way); the dense bucket's ring ends at 15 + 10.02
    mixed = replace(calibration, buckets=[(15.0, 10 * MB, False), (40.0, 10 * MB, True)])
    assert predict(mixed, "sparse_ps", 2, 1)["communication_end_ms"] == pytest.approx(40 + 20 + 20 + 0.02)
    assert predict(replace(mixed, buckets=mixed.buckets[:1]), "allreduce", 2, 0)["communication_end_ms"] \
        == pytest.approx(25.02)
    # a small sparse bucket first (1 MB: 2 ms in, 2 ms out, from 15): the dense ring, 40 to 50.02, ends it
    small = replace(calibration, buckets=[(15.0, 1 * MB, True), (40.0, 10 * MB, False)])
    assert predict(small, "sparse_ps", 2, 1)["communication_end_ms"] == pytest.approx(50.02)
    assert predict(mixed, "sparse_ps", 2, 0) is None  # a sparse bucket and no server to push it to


def test_what_a_hook_held_backward_for_is_its_strategys_own_compute_not_the_models(tmp_path):
    """A hook that encodes on backward's thread (held_ms: a CPU compressor) delays every later
    bucket: that delay is its strategy's cost, so the timeline the model computes overlap from
    leaves it out, and the strategy's own compute holds it."""
    allreduce = Run.load(results_file(tmp_path, "ar.json", batch_ms=80.0))
    held = [{"index": 0, "bytes": 10 * MB, "ready_ms": 15.0, "done_ms": 40.0, "held_ms": 20.0},
            {"index": 1, "bytes": 10 * MB, "ready_ms": 60.0, "done_ms": 70.0, "held_ms": 1.0}]
    fp16 = Run.load(results_file(tmp_path, "fp16.json", hook="fp16", batch_ms=100.0, timeline=held))
    calibration = calibrate([allreduce, fp16])
    assert [bucket.ready_ms for bucket in calibration.buckets] == [15.0, 40.0]  # not the median of 40 and 60
    assert calibration.phases.backward == 40.0
    # fp16 at 2 trainers on that timeline: 5 MB a bucket, 5.02 ms; the second ends at 45.02, and
    # 10 + 45.02 + 2 leaves 42.98 ms of the measured 100 to fp16 itself, the 21 ms held among it
    assert calibration.own_ms["fp16"] == pytest.approx(100.0 - 57.02)
    assert predict(calibration, "fp16", 2, 0)["batch_ms"] == pytest.approx(100.0)  # its calibration point
    assert calibration.own_ms["allreduce"] == pytest.approx(80.0 - 62.02)  # unchanged by fp16's run
    # medians over iterations need not subtract exactly: never before the bucket ready before it
    assert compute_ready([{"index": 0, "ready_ms": 1.0, "held_ms": 5.0}, {"index": 1, "ready_ms": 4.0}]) == \
        {0: 1.0, 1: 1.0}


def test_with_another_devices_compute_a_strategys_own_compute_runs_at_that_devices_speed(tmp_path):
    """--compute from a device whose forward takes twice the run's: the all-reduce's own 17.98 ms
    (see the calibration test) runs beside the model's compute on that device, at its speed."""
    run = Run.load(results_file(tmp_path, "ar.json", batch_ms=80.0))
    device = Path(results_file(tmp_path, "noop.json", hook="noop", batch_ms=60.0))
    results = json.loads(device.read_text())
    results["summary"] = [{"role": "trainer", "metric": metric, "p50": value}
                          for metric, value in (("batch", 60.0), ("forward", 20.0), ("optimizer", 2.0))]
    device.write_text(json.dumps(results))
    slower = calibrate([run], compute=Run.load(str(device)))
    assert slower.phases.forward == 20.0
    assert slower.overlap_from == f"the phases and bucket timeline of --compute {device}"  # it was "of 1 run"
    assert slower.own_ms["allreduce"] == pytest.approx(2 * calibrate([run]).own_ms["allreduce"]) \
        == pytest.approx(2 * 17.98)


def test_a_target_link_replaces_the_fitted_one(tmp_path):
    run = Run.load(results_file(tmp_path, limits=False))
    calibration = calibrate([run], TargetLink("--link", 100e9, "ethernet", 1.0, 5e-6))
    assert calibration.link.latency_ms == pytest.approx(0.005) and calibration.link.bytes_per_ms == pytest.approx(12.5e6)
    assert calibration.phases.backward == 40.0  # without --limits: the last bucket's ready time
    assert calibration.own_ms == {}  # no fitted link: the run's own network is unknown
    assert ("own compute, from its run: none: it is fitted only from runs whose link is known "
            "(made with --limits, or on an emulated link at --link's rate)") in describe_calibration(calibration)


def test_own_compute_is_measured_on_the_runs_network_and_carried_to_the_target(tmp_path):
    run = Run.load(results_file(tmp_path))  # 100 ms measured; 62.02 by the model on its fitted 8 Gbit/s link
    calibration = calibrate([run], TargetLink("--link", 100e9, "ethernet", 1.0, 10e-6))
    assert calibration.own_ms["allreduce"] == pytest.approx(100.0 - 62.02)
    # at 100 Gbit/s (latency the fitted 10 µs) a 10 MB bucket takes 0.8 ms + 20 µs: the
    # second ends at 40.82, inside nothing: 10 + 40.82 + 2 + 37.98
    assert predict(calibration, "allreduce", 2, 0)["batch_ms"] == pytest.approx(10 + 40.82 + 2 + 37.98)


def test_predict_prints_the_table_with_measured_and_error(tmp_path, capsys):
    calibrating, compared = results_file(tmp_path, "ar.json", batch_ms=80.0), results_file(tmp_path, "ar4.json",
                                                                                             trainers=4, batch_ms=90.0)
    out = tmp_path / "p.json"
    assert main(["predict", calibrating, "--compare", compared, "--trainers", "2,4,1024", "--servers", "1,auto",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "winner per trainer count:" in printed and "(cal.)" in printed
    predictions = json.loads(out.read_text())
    rows = {(row["strategy"], row["trainers"]): row for row in predictions["predictions"]}
    four = rows["allreduce", 4]  # predicted from the 2-trainer run alone (see the calibration test)
    assert four["batch_ms"] == pytest.approx(10 + 55.06 + 2 + 17.98) and four["calibration"] is False
    assert four["measured_ms"] == 90.0 and four["error_pct"] == pytest.approx((four["batch_ms"] - 90) / 90 * 100)
    assert rows["allreduce", 2]["calibration"] is True and rows["allreduce", 1024]["measured_ms"] is None
    assert {row["strategy"] for row in predictions["predictions"]} == {"allreduce", "ps", "fp16"}
    assert predictions["calibration"]["link"]["bandwidth_gbit_s"] == pytest.approx(8.0)


BAD_INPUTS = [
    (lambda p: [results_file(p, status="failed", error="trainer 1 (rank 1) exited with code 1")],
     "is a failed run (trainer 1 (rank 1) exited with code 1)"),
    (lambda p: [results_file(p), "--trainers", "0"], "--trainers must be at least 1; got 0"),
    (lambda p: [results_file(p), "--trainers", "8,many"], "--trainers: expected whole numbers"),
    (lambda p: [results_file(p), "--link", "10"], "--link: expected a rate with its unit"),
    (lambda p: [results_file(p), "--link", "10gbps"], "--link 10gbps: 'gbps' means bytes a second to tc (80gbit)"),
    (lambda p: [results_file(p), "--link", "0gbit"], "--link must be at least 1kbit; got '0gbit'"),
    (lambda p: [results_file(p), "--link", "-10gbit"], "--link must be at least 1kbit; got '-10gbit'"),
    (lambda p: [results_file(p), "--link", "-10gbps"], "--link must be at least 1kbit; got '-10gbps'"),
    (lambda p: [results_file(p), "--link", "1gbit", "--latency", "-5us"], "--latency must be 0 or more; got '-5us'"),
    (lambda p: [results_file(p, limits=False)], "no link to predict with: give runs made with --limits"),
    (lambda p: [str(p / "missing.json")], "missing.json' does not exist"),
    (lambda p: [results_file(p), "--hooks", "powersgd"], "give a run of powersgd to calibrate it"),
    (lambda p: [results_file(p), "--bucket-cap-mb", "0"], "--bucket-cap-mb must be positive; got 0.0"),
    (lambda p: ["--model", "resnet18", "--batch-size", "8", "--link", "10gbit",
                "--compute-ms", "forward=nan,backward=2,optimizer=0"], "each phase takes a number of ms, 0 or more"),
    (lambda p: [results_file(p), "--out", str(Path(results_file(p)) / "p.json")], "is not a folder"),
    (lambda p: [results_file(p), "--hook-option", "topk:ratio=-1"],
     "--hook-option topk: hook option 'ratio' must be above 0 and at most 1; got -1"),
    (lambda p: [results_file(p), "--hook-option", "topk:bogus=1"], "hook 'topk' has no option 'bogus'"),
    (lambda p: [results_file(p), "--hook-option", "psnode:partition_mb=2"],
     "--hook-option: unknown hook 'psnode'; did you mean 'ps_node'? known: allreduce,"),
    # named before anything that needs the runs (here, a link they lack)
    (lambda p: [results_file(p, limits=False), "--hooks", "allreduce,alreduce"],
     "--hooks: unknown hook 'alreduce'; did you mean 'allreduce'? known: allreduce,"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[message[:40] for _, message in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    assert main(["predict", *argv(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_strategies_within_one_percent_tie_and_a_crossover_needs_different_winners():

    def row(trainers, strategy, ms):
        return {"trainers": trainers, "strategy": strategy, "servers": None, "batch_ms": ms}

    rows = [row(8, "allreduce", 361.3), row(8, "hierarchical", 361.3), row(8, "ps", 500.0),
            row(64, "allreduce", 400.0), row(64, "hierarchical", 380.0), row(64, "ps", 383.0),
            row(512, "fp16", 300.0), row(512, "allreduce", 420.0)]
    best = winners(rows)
    assert [w["tied_with"] for w in best] == [["hierarchical"], ["ps"], []]
    text = render_winners(best)
    assert "8: tie: allreduce, hierarchical, 64: tie: hierarchical, ps, 512: fp16" in text
    assert "crossover: allreduce wins" not in text  # hierarchical won at 8 as much as allreduce did
    assert "crossover: hierarchical and ps tie at 64 trainers, fp16 at 512" in text


def test_a_strategy_that_synchronises_nothing_is_shown_but_never_wins():
    """noop, the compute-only headroom, is always fastest: its replicas drift apart, so the
    winner is the fastest strategy that trains one model (a server count named in the singular)."""
    rows = [{"trainers": 8, "strategy": "noop", "servers": None, "batch_ms": 100.0},
            {"trainers": 8, "strategy": "ps", "servers": 1, "batch_ms": 150.0},
            {"trainers": 8, "strategy": "allreduce", "servers": None, "batch_ms": 151.0}]
    best = winners(rows)
    assert [(w["strategy"], w["tied_with"]) for w in best] == [("ps", ["allreduce"])]
    assert "8: tie: ps (1 server), allreduce" in render_winners(best)
    assert winners(rows[:1]) == []
    assert "winner per trainer count: none: noop synchronises nothing" in render_winners([], "noop synchronises nothing")


def declared_here(monkeypatch, name: str, record) -> None:
    """Registers a strategy for one test: the registry's tables are copies the test restores."""
    for table in ("_entries", "_records", "_canonical"):
        monkeypatch.setattr(HOOKS, table, dict(getattr(HOOKS, table)))
    HOOKS.register(name, record=record)(lambda ctx: None)


def test_a_strategy_declared_in_a_test_predicts_from_its_record_alone(monkeypatch):
    """What predict knows of a strategy is its record: a new one with a cost of its own (each
    bucket two rings, a fixed term a micro-batch, the own compute of allreduce) is predicted with
    no line of ``predict/`` naming it."""
    def twice(nodes, nbytes, gloo):
        return 2 * costs.flat_ring_ms(nodes, nbytes)

    def fixed(nodes, nbytes):
        return 3.0

    declared_here(monkeypatch, "two_rings", Strategy(
        COLLECTIVE, "float16", lossless=False, sparse_buckets=None, uncompressed="allreduce",
        cost=Cost(bucket_ms=twice, micro_batch_ms=fixed)))
    calibration = from_compute_ms("m", 8, Phases(1.0, 2.0, 0.5), [(8 * MB, False), (4 * MB, False)], LINK, "test")
    calibration.own_ms = {"allreduce": 0.25}
    got = predict(calibration, "two_rings", 4, 0)
    # buckets ready at 2/3 and 2 ms of backward (spread by bytes), each two rings of its 16-bit half
    ring = {size: 2 * costs.ring_allreduce_ms(4, size / 2, LINK) for size in (8 * MB, 4 * MB)}
    end = pipelines.pipeline([(2.0 * 8 / 12, ring[8 * MB]), (2.0, ring[4 * MB])], lambda ms: ms) + 3.0
    assert got["communication_end_ms"] == pytest.approx(end)
    assert got["own_ms"] == 0.25  # allreduce's, the one it compresses
    assert got["batch_ms"] == pytest.approx(1.0 + max(2.0, end) + 0.5 + 0.25)


def test_predict_compares_no_strategy_name():
    """How a strategy costs is in its record: no comparison, membership test or table in
    ``ps_bench/predict`` is keyed by a strategy's name."""
    names = {name for name in HOOKS.names()} | {alias for name in HOOKS.names() for alias in HOOKS.aliases(name)}
    found = []
    for path in sorted((Path(predictor_module.__file__).parent).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            keyed = (node.comparators + [node.left] if isinstance(node, ast.Compare)
                     else node.keys if isinstance(node, ast.Dict) else [])
            constants = [item for key in keyed if key is not None for item in ast.walk(key)
                         if isinstance(item, ast.Constant) and item.value in names]
            found += [f"{path.name}:{item.lineno} {item.value!r}" for item in constants]
    assert found == []


def test_counts_of_one_read_in_the_singular(capsys):
    """A batch of 1 was "a forward of 1 samples"; one bucket, "1 bucket(s)"."""
    assert main(["predict", "--model", "gpt2_tiny", "--batch-size", "1", "--compute-ms",
                 "forward=10,backward=20,optimizer=1", "--hooks", "allreduce", "--trainers", "2",
                 "--link", "10gbit"]) == 0
    printed = capsys.readouterr().out
    assert "calibration: gpt2_tiny at batch 1, from 0 runs\n" in printed
    assert "; 1 bucket, " in printed and "FLOPs of a forward of 1 sample of --data" in printed


def test_a_small_models_memory_reads_in_its_own_units(capsys):
    """A test-sized model's memory line, gradient bytes and cells are not rounded to nothing
    (0.000 B parameters, 0.00 MB, 0.0 GiB): its 43.9 K parameters, its 171.5 KiB of gradients,
    its states in three figures."""
    assert main(["predict", "--model", "gpt2_tiny", "--batch-size", "8", "--compute-ms",
                 "forward=10,backward=20,optimizer=1", "--hooks", "allreduce", "--trainers", "2",
                 "--link", "10gbit"]) == 0
    printed = capsys.readouterr().out
    assert "memory: 43.9 K parameters, the largest layer 16.38 K" in printed
    assert f"bucket, {43_904 * 4 / 1024:.1f} KiB, ready at" in printed
    states = next(line for line in printed.splitlines() if line.startswith("2 ")).split()[-2]
    assert states == f"{43_904 * 4 * 2 / 2 ** 30:.3g}"  # parameters and gradients, float32


def test_low_rank_strategies_are_predicted_from_the_model_alone(capsys):
    """With --compute-ms the model is built on the meta device: PowerSGD's factors follow from
    its layers in DDP's buckets (per tensor; batched: each bucket as one square matrix), so no
    run of it is needed. DummyModel's buckets hold 2-D layers that rank 2 compresses."""
    facts = model_buckets("DummyModel", 25.0)[3]
    ratios = low_rank_ratios(facts.bucket_shapes)
    per_tensor = sum(sum(messages.low_rank_factors(shapes, 2, 2.0)) for shapes in facts.bucket_shapes)
    side = [math.isqrt(sum(math.prod(s) for s in shapes) - 1) + 1 for shapes in facts.bucket_shapes]
    assert ratios["powersgd"] == pytest.approx(per_tensor / facts.parameters) and ratios["powersgd"] < 0.5
    assert ratios["batched_powersgd"] == pytest.approx(sum(2 * 2 * n for n in side) / facts.parameters)
    assert main(["predict", "--model", "DummyModel", "--batch-size", "8", "--compute-ms",
                 "forward=10,backward=20,optimizer=1", "--hooks", "allreduce,powersgd,batched_powersgd",
                 "--trainers", "8", "--link", "1gbit"]) == 0
    printed = capsys.readouterr().out
    counted = "(counted from the model's layers, default options)"
    assert (f"low-rank payloads, of the float32 gradient's bytes: batched_powersgd "
            f"{ratios['batched_powersgd']:.2%} {counted}, powersgd {ratios['powersgd']:.2%} {counted}") in printed
    rows = {line.split()[1]: float(line.split()[3]) for line in printed.splitlines() if line.startswith("8 ")}
    assert rows["powersgd"] < rows["allreduce"]  # a thirtieth of the bytes on a slow link
    assert main(["predict", "--model", "DummyModel", "--batch-size", "8", "--compute-ms",
                 "forward=10,backward=20,optimizer=1", "--hooks", "allreduce,fsdp", "--link", "1gbit"]) == 0
    assert "low-rank payloads" not in capsys.readouterr().out  # of strategies not asked about


def test_strategies_that_encode_with_no_run_of_their_own_are_named(tmp_path, capsys):
    """An all-reduce run alone predicts topk with all-reduce's own compute: on a CPU topk's
    selecting took 270 ms an iteration where all-reduce's was 16, and topk was predicted at 71
    ms against 308 measured. The calibration names each strategy predicted that encodes the
    gradients and whose own compute no run fitted; a run of it fitted, it is not named."""
    allreduce = results_file(tmp_path, "ar.json", batch_ms=80.0)
    assert main(["predict", allreduce, "--hooks", "allreduce,topk,fp16,ps_fp16,ps,local_sgd",
                 "--trainers", "4"]) == 0
    [note] = [line for line in capsys.readouterr().out.splitlines() if "encode the gradients" in line]
    assert note.startswith("  note: topk, fp16, ps_fp16 encode the gradients, and no run of theirs fitted")
    assert "(allreduce +" in note and "; ps 0 ms, none fitted)" in note
    assert main(["predict", allreduce, "--hooks", "allreduce,topk", "--trainers", "4"]) == 0
    assert "note: topk encodes the gradients, and no run of it fitted" in capsys.readouterr().out
    calibration = calibrate([Run.load(path) for path in (allreduce, results_file(tmp_path, "topk.json",
                                                                                hook="topk", batch_ms=90.0))])
    assert "topk" in calibration.own_ms
    assert "encode the gradients" not in describe_calibration(calibration, ["allreduce", "topk"])


def test_a_run_that_records_its_buckets_shapes_predicts_the_low_rank_strategies_it_did_not_run(tmp_path, capsys):
    """An all-reduce run whose two 10 MB buckets each hold one 2500 x 1000 gradient: powersgd
    sends (2500 + 1000) x 2 elements a bucket, batched_powersgd 2 x 1582 x 2 (ceil(sqrt(2500 x
    1000)) = 1582), with no run of either; a run of powersgd would have measured its own."""
    shaped = [{"index": i, "bytes": 10 * MB, "sparse": False, "shapes": [[2500, 1000]]} for i in (0, 1)]
    path = results_file(tmp_path, config={"hook": "allreduce", "ntrainer": 2, "nserver": 0, "batch_size": 32,
                                          "model": "DummyModel", "model_size": {"ddp_buckets": shaped}})
    assert main(["predict", path, "--hooks", "allreduce,powersgd,batched_powersgd", "--trainers", "8",
                 "--out", str(tmp_path / "p.json")]) == 0
    calibration = json.loads((tmp_path / "p.json").read_text())["calibration"]
    assert calibration["payload_ratio"] == pytest.approx({"powersgd": 7000 / 2.5e6, "batched_powersgd": 6328 / 2.5e6})
    assert set(calibration["payload_from"].values()) == {"counted from the model's layers, default options"}
    assert "powersgd 0.28% (counted from the model's layers, default options)" in capsys.readouterr().out


def with_options(path: str, options: dict) -> str:
    """The results file at ``path``, run with these ``--hook-option``s."""
    results = json.loads(Path(path).read_text())
    results["config"]["hook_options"] = options
    Path(path).write_text(json.dumps(results))
    return path


def test_each_strategy_is_predicted_at_the_hook_options_its_runs_had(tmp_path):
    """A run of topk at ratio 0.1 and one of local_sgd averaging every 8 iterations: predicted at
    those, not at the defaults (0.01, 4); where a strategy's runs differ, its defaults, and only
    its runs at those calibrate it and stand beside it."""
    allreduce = results_file(tmp_path, "ar.json", batch_ms=80.0)
    topk = with_options(results_file(tmp_path, "topk.json", hook="topk", batch_ms=90.0), {"ratio": 0.1})
    local = with_options(results_file(tmp_path, "ls.json", hook="local_sgd", batch_ms=60.0), {"period": 8})
    calibration = calibrate([Run.load(path) for path in (allreduce, topk, local)])
    assert calibration.options == {"topk": {"ratio": 0.1}, "local_sgd": {"period": 8}}
    assert ("hook options, as every run of the strategy had them or --hook-option gives them: local_sgd period=8; "
            "topk ratio=0.1") in \
        describe_calibration(calibration)
    # each 10 MB bucket (2.5 M values): 10 % kept, 8 bytes each, all-gathered among 4; the last
    # bucket is ready at 40 ms
    for options, kept in ((calibration.options, 250_000), ({}, 25_000)):
        at = replace(calibration, options=options)
        assert predict(at, "topk", 4, 0)["communication_end_ms"] == pytest.approx(
            40.0 + costs.allgather_ms(4, 8 * kept, LINK))
    assert predict(calibration, "local_sgd", 4, 0)["sends_ms"] == pytest.approx(
        predict(replace(calibration, options={}), "local_sgd", 4, 0)["sends_ms"] / 2)
    default = results_file(tmp_path, "topk-default.json", hook="topk", batch_ms=95.0)
    mixed = calibrate([Run.load(path) for path in (allreduce, topk, default)])
    assert mixed.options == {}
    assert mixed.notes == ["the runs of topk ran with different hook options: it is predicted at its defaults, "
                           "and compared with its runs at those alone"]
    alone = calibrate([Run.load(path) for path in (allreduce, default)])
    assert mixed.own_ms["topk"] == pytest.approx(alone.own_ms["topk"])  # the default run's alone
    row = prediction_rows(mixed, ["topk"], [2], [1], "shard", None)[0]
    assert row["runs"] == [default] and row["measured_ms"] == 95.0


def test_hook_options_given_to_predict_override_the_runs_and_keep_their_own_compute(tmp_path):
    """--hook-option: a strategy predicted at options none of its runs had; its own compute is
    fitted to its run at the run's options (the same as without the flag), its run no longer
    stands in its measured column, and a note says so."""
    allreduce = Run.load(results_file(tmp_path, "ar.json", batch_ms=80.0))
    topk = Run.load(results_file(tmp_path, "topk.json", hook="topk", batch_ms=90.0))  # at ratio 0.01
    as_ran = calibrate([allreduce, topk])
    given = calibrate([allreduce, topk], options={"topk": {"ratio": 0.1}})
    assert given.options == {"topk": {"ratio": 0.1}} and as_ran.options == {}
    assert given.own_ms["topk"] == pytest.approx(as_ran.own_ms["topk"]) and as_ran.own_ms["topk"] > 0
    note, = given.notes
    assert note.startswith("topk is predicted at ratio=0.1 (--hook-option), where its runs had other options")
    # ten times the values all-gathered: its communication ends later, by the formula's bytes
    assert (predict(given, "topk", 8, 0)["communication_end_ms"]
            > predict(as_ran, "topk", 8, 0)["communication_end_ms"])
    rows = {row["strategy"]: row for row in prediction_rows(given, ["allreduce", "topk"], [2], [0], "shard",
                                                            None, [])}
    assert rows["topk"]["measured_ms"] is None and rows["allreduce"]["measured_ms"] == 80.0
    # given as its run had them: nothing changes, no note
    same = calibrate([allreduce, topk], options={"topk": {"ratio": 0.01}})
    assert same.options == {} and same.notes == [] and same.own_ms == as_ran.own_ms


def test_a_hook_option_without_its_hook_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["predict", results_file(tmp_path), "--hook-option", "ratio=0.1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "expected HOOK:KEY=VALUE, got 'ratio=0.1'" in err


def test_hook_options_given_with_compute_ms_set_the_low_rank_payload(capsys):
    argv = ["predict", "--model", "DummyModel", "--batch-size", "8", "--compute-ms", "forward=10,backward=20,optimizer=1",
            "--hooks", "allreduce,powersgd", "--trainers", "8", "--link", "1gbit"]
    facts = model_buckets("DummyModel", 25.0)[3]
    for rank in (4, 8):  # its default is 2
        assert main([*argv, "--hook-option", f"powersgd:matrix_approximation_rank={rank}"]) == 0
        ratio = low_rank_ratios(facts.bucket_shapes, {"powersgd": {"matrix_approximation_rank": rank}})["powersgd"]
        out = capsys.readouterr().out
        assert f"powersgd {ratio:.2%} (counted from the model's layers, matrix_approximation_rank={rank})" in out
        assert "each strategy's own compute, from its run: none: no runs given" in out
    assert low_rank_ratios(facts.bucket_shapes, {"powersgd": {"matrix_approximation_rank": 8}})["powersgd"] > \
        3 * low_rank_ratios(facts.bucket_shapes)["powersgd"]


def test_the_memory_predict_adds_is_at_the_options_the_runs_had(tmp_path, capsys):
    """A topk run without error feedback keeps no residual: predict's memory row says 0 for it,
    where at topk's defaults it keeps a float32 copy of every bucket."""
    out = tmp_path / "predict.json"
    kept = {}
    for options in ({"error_feedback": False}, {}):
        run = with_options(results_file(tmp_path, "topk.json", hook="topk", batch_ms=90.0), options)
        assert main(["predict", run, "--trainers", "2", "--hooks", "topk", "--gpu-memory", "80GB",
                     "--out", str(out)]) == 0
        row, = json.loads(out.read_text())["predictions"]
        kept[bool(options)] = row["kept_bytes"]
    assert kept[True] == 0 < kept[False]
    capsys.readouterr()


def test_runs_to_compare_are_predicted_at_their_trainer_counts_by_default(tmp_path):
    """Runs of 2 trainers given with --compare stood beside nothing: the default trainer counts
    (8, 64, 256, 1024) left out theirs, and their measured column was empty (and a run of 2
    servers, where the calibration's runs had none, beside 1); --trainers given is what it says."""
    allreduce = results_file(tmp_path, "ar.json", batch_ms=80.0)
    topk = results_file(tmp_path, "topk.json", hook="topk", trainers=3, batch_ms=90.0)
    ps = results_file(tmp_path, "ps.json", hook="ps", trainers=3, servers=2, batch_ms=120.0)

    def rows(*flags: str) -> dict:
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        assert main(["predict", allreduce, "--compare", topk, ps, "--out", str(out), *flags]) == 0
        return {(row["trainers"], row["strategy"], row["servers"]): row["measured_ms"]
                for row in json.loads(out.read_text())["predictions"]}

    assert rows()[(3, "topk", None)] == 90.0 and rows()[(3, "ps", 2)] == 120.0
    assert {n for n, _, _ in rows()} == {3, 8, 64, 256, 1024}
    assert {n for n, _, _ in rows("--trainers", "8")} == {8}


@pytest.mark.parametrize("given, message", [
    ("results", "ran --grad-accum 4: calibrate from runs of one micro-batch a step, and give predict --grad-accum"),
    ("--compare", "ran --grad-accum 4: give --compare runs of the --grad-accum predicted, 1")])
def test_runs_of_several_micro_batches_a_step_are_refused_where_they_do_not_fit(given, message, tmp_path, capsys):
    accumulated = results_file(tmp_path, "ga.json")
    results = json.loads(Path(accumulated).read_text())
    results["config"]["grad_accum"] = 4
    Path(accumulated).write_text(json.dumps(results))
    argv = [accumulated] if given == "results" else [results_file(tmp_path, "ar.json"), "--compare", accumulated]
    assert main(["predict", *argv]) == 2
    assert capsys.readouterr().err == f"ps_bench: error: {accumulated} {message}\n"


def test_the_plot_draws_each_server_placement_as_a_line_of_its_own(tmp_path):
    """ps_node's best dedicated and best co-located servers were one line, which went up and down
    between the two at each trainer count; now each line has one point a count."""
    out, plotted = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["predict", "--model", "DummyModel", "--batch-size", "8", "--compute-ms",
                 "forward=10,backward=20,optimizer=1", "--nodes", "1,2,4", "--per-node", "2",
                 "--intra-link", "100gbit", "--link", "1gbit", "--hooks", "allreduce,ps_node",
                 "--servers-on", "dedicated,colocated", "--servers", "auto,2", "--out", str(out),
                 "--plot", str(plotted)]) == 0
    series = plot_series(json.loads(out.read_text())["predictions"])
    assert {"allreduce", "ps_node (best servers)", "ps_node (best colocated servers)",
            "ps_node (2 servers)", "ps_node (2 colocated servers)"} <= set(series)
    for members in series.values():
        assert len({row["trainers"] for row in members}) == len(members)
    assert plotted.stat().st_size > 0


def test_memory_from_a_run_counts_the_activations_of_its_own_data(tmp_path, capsys):
    """A run of DummyModel on --data DummyData (1024 indices a sample) was counted on the
    model's default data (16 a sample): its activations a 64th of its own."""
    entry = {"id": "DummyData", "class": "DummyData", "source": "configs/data_configurations.json",
             "configurations": {"max_val": 1024, "sample_count": 1024, "sample_length": 1024}}
    for name, extra, forward in (("own.json", {"data_config": entry}, "32x1024 DummyData "),
                                 ("default.json", {}, "32x16 DummyDataSmall ")):
        path = results_file(tmp_path, name)
        results = json.loads(Path(path).read_text())
        results["config"].update(extra)
        Path(path).write_text(json.dumps(results))
        assert main(["predict", path, "--trainers", "2", "--gpu-memory", "80GB"]) == 0
        assert f"saved for backward by a forward of {forward}" in capsys.readouterr().out


def test_runs_of_another_precision_are_said_and_not_measured_against(tmp_path, capsys):
    """An fp32 run predicted at --precision bf16 stood in the measured column as the bf16
    prediction's calibration, and nothing said that its compute was fp32's."""
    path = results_file(tmp_path, "ar.json", batch_ms=80.0)
    for flags, measured in (([], 80.0), (["--precision", "bf16"], None)):
        out = tmp_path / f"{len(flags)}.json"
        assert main(["predict", path, "--trainers", "2", "--hooks", "allreduce", "--out", str(out), *flags]) == 0
        [row] = json.loads(out.read_text())["predictions"]
        assert row["measured_ms"] == measured
        noted = "note: the runs computed in fp32: their forward, backward and step stand in this bf16 prediction"
        assert (noted in capsys.readouterr().out) == bool(flags)
