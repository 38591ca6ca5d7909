"""``bench.py compare``: the interval and the verdict on made-up samples (a known shift is found,
no shift is not, tiny samples give a wide interval and say so), matching, the outputs, and bad
input, from made-up results files."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from ps_bench.cli import main
from ps_bench.compare import (COMPARISON_SCHEMA, METRICS, runs_interval, t_quantile, verdict,
                              within_run_interval)

BATCH_P50 = METRICS[0]
SAMPLES_PER_S = next(metric for metric in METRICS if metric.name == "samples/s")


def lognormal(rng: np.random.Generator, count: int, median: float, spread: float) -> np.ndarray:
    return median * np.exp(rng.normal(0.0, spread, count))


# ---------------------------------------------------------------------------- the interval


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (30, 2.042), (2.5, 3.575),
                                          (1e9, 1.960)])
def test_t_quantile_matches_the_table(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=2e-3)


def test_a_known_shift_between_runs_is_found_and_the_interval_holds_it():
    rng = np.random.default_rng(1)
    base, new = lognormal(rng, 10, 4.0, 0.03), lognormal(rng, 10, 4.8, 0.03)  # +20 %
    interval = runs_interval(base, new)
    assert interval.method == "runs" and interval.excludes_zero
    assert interval.low < 0.20 < interval.high and interval.change == pytest.approx(0.20, abs=0.03)
    assert verdict(interval, 0.05, higher_is_better=False) == ("slower", True)
    assert verdict(interval, 0.05, higher_is_better=True) == ("faster", True)  # e.g. samples/s going up
    assert interval.note == ""


def test_no_shift_is_not_called_a_change():
    rng = np.random.default_rng(2)
    base, new = lognormal(rng, 10, 4.0, 0.03), lognormal(rng, 10, 4.0, 0.03)
    interval = runs_interval(base, new)
    assert interval.low < 0 < interval.high
    assert verdict(interval, 0.05, higher_is_better=False) == ("no significant change", False)


def test_a_real_change_under_the_threshold_is_no_significant_change():
    rng = np.random.default_rng(3)
    base, new = lognormal(rng, 20, 4.0, 0.002), lognormal(rng, 20, 4.08, 0.002)  # +2 %, clearly measured
    interval = runs_interval(base, new)
    assert interval.excludes_zero and interval.change == pytest.approx(0.02, abs=0.005)
    assert verdict(interval, 0.05, higher_is_better=False) == ("no significant change", False)
    assert verdict(interval, 0.01, higher_is_better=False) == ("slower", True)


def test_tiny_samples_give_a_wide_interval_and_say_so():
    rng = np.random.default_rng(4)
    base, new = lognormal(rng, 10, 4.0, 0.05), lognormal(rng, 10, 4.4, 0.05)  # +10 %
    plenty, tiny = runs_interval(base, new), runs_interval(base[:2], new[:2])
    assert tiny.width > 4 * plenty.width
    assert "only 2 and 2 runs: the interval is wide" in tiny.note
    one = runs_interval(base[:1], new[:3])
    assert math.isinf(one.width) and "one run on a side" in one.note
    assert verdict(one, 0.05, higher_is_better=False) == ("no significant change", False)
    few_iterations = within_run_interval(base[:5], new[:5], BATCH_P50.statistic, 0.1)
    assert "only 5 and 5 samples: the interval is wide" in few_iterations.note


def test_every_run_alike_gives_the_exact_change():
    interval = runs_interval([3200, 3200, 3200], [1600, 1600, 1600])
    assert interval.change == interval.low == interval.high == pytest.approx(-0.5)
    assert verdict(interval, 0.05, False, ("fewer bytes", "more bytes")) == ("fewer bytes", True)
    assert runs_interval([0, 0, 0], [0, 0, 0]).change == 0.0


def test_within_run_bootstrap_finds_a_shift_and_says_it_is_optimistic():
    rng = np.random.default_rng(5)
    base, new = lognormal(rng, 300, 2.0, 0.3), lognormal(rng, 300, 2.6, 0.3)  # +30 % per iteration
    change = float(np.median(new) / np.median(base) - 1)
    interval = within_run_interval(base, new, BATCH_P50.statistic, change)
    assert interval.method == "within-run" and "optimistic" in interval.note
    assert 0 < interval.low < change < interval.high
    assert verdict(interval, 0.05, higher_is_better=False) == ("slower", True)
    same = lognormal(rng, 300, 2.0, 0.3)
    unchanged = within_run_interval(base, same, BATCH_P50.statistic, float(np.median(same) / np.median(base) - 1))
    assert unchanged.low < 0 < unchanged.high
    # samples/s: the inverse of the mean batch time falls as the batch time grows
    throughput = within_run_interval(base, new, SAMPLES_PER_S.statistic, float(base.mean() / new.mean() - 1))
    assert throughput.high < 0
    assert verdict(throughput, 0.05, higher_is_better=True) == ("slower", True)


# ---------------------------------------------------------------------------- made-up results files

CONFIG = {"ntrainer": 2, "nserver": 1, "hook": "ps", "model": "DummyModelSmall", "data": "DummyDataSmall",
          "batch_size": 16, "straggler": [], "out": "x.json", "master_port": None}


def results(seed: int, median_ms: float, spread: float = 0.2, count: int = 100, schema: str = "ps_bench.result/1",
            point: dict | None = None, **config) -> dict:
    rng = np.random.default_rng(seed)
    per_trainer = [lognormal(rng, count, median_ms, spread) for _ in range(2)]
    pooled = np.concatenate(per_trainer)
    made = {
        "schema": schema, "status": "ok", "config": {**CONFIG, **config, "out": f"run{seed}.json"},
        "env": {"torch": "2.14.1", "hostname": "devbox"},
        "summary": [{"role": "trainer", "metric": metric, "unit": "ms", "count": len(pooled),
                     "p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90))}
                    for metric, values in (("batch", pooled), ("comm", pooled / 2))],
        "throughput": {"samples_per_s": 2 * 16 * 1000 / float(pooled.mean()), "iterations": count},
        "bytes": {"trainer_sent_per_iter": 3200.0},
        "samples": [{"role": "trainer", "rank": rank, "metrics": {
            "batch": values.tolist(), "comm": (values / 2).tolist(), "bytes_sent": [3200.0] * count}}
            for rank, values in enumerate(per_trainer)],
    }
    if point is not None:
        made["point"] = point
    return made


def write_runs(folder: Path, made: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for number, entry in enumerate(made):
        (folder / f"run{number}.json").write_text(json.dumps(entry))
    return folder


def run_compare(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["compare", *argv])
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def row_of(out: str, metric: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(metric))


def test_three_runs_a_side_with_a_shift_are_slower_and_fail_the_gate(tmp_path, capsys):
    # run-to-run spread of about 3 %, a 30 % slowdown
    base = write_runs(tmp_path / "base", [results(s, 2.0 * (1 + 0.03 * d)) for s, d in ((1, -1), (2, 0), (3, 1))])
    new = write_runs(tmp_path / "new", [results(s, 2.6 * (1 + 0.03 * d)) for s, d in ((4, 1), (5, -1), (6, 0))])
    code, out, err = run_compare(capsys, str(base), str(new), "--fail-over", "5", "--json", str(tmp_path / "c.json"),
                                 "--csv", str(tmp_path / "c.csv"))
    assert code == 1, err
    assert "slower" in row_of(out, "batch p50") and "3 vs 3 runs" in row_of(out, "batch p50")
    assert "slower" in row_of(out, "samples/s")
    assert "no significant change" in row_of(out, "bytes/iter")
    assert "--fail-over 5: FAILED" in out and "optimistic" not in out
    record = json.loads((tmp_path / "c.json").read_text())
    assert record["schema"] == COMPARISON_SCHEMA and record["exit_status"] == 1
    assert record["points"][0]["interval_from"] == "runs" and record["points"][0]["base_runs"] == 3
    batch = next(m for m in record["metrics"] if m["metric"] == "batch p50")
    assert batch["verdict"] == "slower" and batch["ci_low_pct"] > 0 and batch["change_pct"] == pytest.approx(30, abs=6)
    with open(tmp_path / "c.csv") as stream:
        rows = list(csv.DictReader(stream))
    assert [r["metric"] for r in rows] == [m["metric"] for m in record["metrics"]]
    assert rows[0]["verdict"] == "slower"
    # the same comparison under a looser gate passes
    code, out, _ = run_compare(capsys, str(base), str(new), "--fail-over", "50")
    assert code == 0 and "--fail-over 50: passed" in out


def test_the_trainers_memory_is_compared_beside_the_time_and_does_not_fail_the_time_gate(tmp_path, capsys):
    """Each run's trainer peak (its Memory table's): the same time, 40 % more memory in every run
    of the new side is "more memory"; --fail-over gates the time alone."""
    def held(seed: int, mib: float) -> dict:
        made = results(seed, 2.0)
        made["memory"] = {"trainer": {"peak_bytes": int(mib * 2 ** 20)}}
        return made

    base = write_runs(tmp_path / "base", [held(s, 100.0) for s in (1, 2, 3)])
    new = write_runs(tmp_path / "new", [held(s, 140.0) for s in (1, 2, 3)])
    code, out, err = run_compare(capsys, str(base), str(new), "--fail-over", "5")
    assert code == 0, err
    assert row_of(out, "trainer MiB").split()[:5] == ["trainer", "MiB", "100.0", "140.0", "+40.0%"]
    assert "more memory" in row_of(out, "trainer MiB") and "no significant change" in row_of(out, "batch p50")


def test_one_run_a_side_compares_the_iterations_and_warns(tmp_path, capsys):
    base, new = tmp_path / "a.json", tmp_path / "b.json"
    base.write_text(json.dumps(results(1, 2.0)))
    new.write_text(json.dumps(results(2, 2.0)))
    code, out, err = run_compare(capsys, str(base), str(new), "--fail-over", "5")
    assert code == 0, err
    assert "200 vs 200 iterations (within-run)" in row_of(out, "batch p50")
    assert "optimistic" in out and "1 point matched by configuration" in out


def test_a_side_says_how_many_of_its_runs_diverged(tmp_path, capsys):
    """Runs whose parameters ended not finite are compared (their times hold), and their side's
    line says how many there are: their training did not."""
    lost = results(2, 2.0)
    lost["replicas"] = {"identical": True, "param_norm": None, "max_abs_diff": 0.0}
    new = write_runs(tmp_path / "new", [lost, results(3, 2.0)])
    code, out, err = run_compare(capsys, str(write_runs(tmp_path / "base", [results(1, 2.0)])), str(new))
    assert code == 0, err
    base_line, new_line = out.splitlines()[:2]
    assert "diverged" not in base_line
    assert new_line.endswith("2 runs, torch 2.14.1; 1 run diverged: parameters not finite, their times hold, "
                             "their training did not)"), new_line


def test_a_few_iterations_say_their_interval_is_wide(tmp_path, capsys):
    base, new = tmp_path / "a.json", tmp_path / "b.json"
    base.write_text(json.dumps(results(1, 2.0, count=3)))
    new.write_text(json.dumps(results(2, 2.0, count=3)))
    code, out, err = run_compare(capsys, str(base), str(new))
    assert code == 0, err
    assert "batch p50: only 6 and 6 samples: the interval is wide" in out


def test_time_to_target_compares_where_both_sides_reached_it(tmp_path, capsys):
    def converged(seed: int, seconds: float, iterations: int) -> dict:
        return {**results(seed, 2.0), "convergence": {"reached": True, "seconds": seconds, "iterations": iterations}}

    base = write_runs(tmp_path / "base", [converged(s, 10.0 + s / 10, 200) for s in (1, 2, 3)])
    new = write_runs(tmp_path / "new", [converged(s, 5.0 + s / 10, 100) for s in (4, 5, 6)])
    code, out, err = run_compare(capsys, str(base), str(new))
    assert code == 0, err
    assert "faster" in row_of(out, "seconds to target") and "-46.1%" in row_of(out, "seconds to target")
    assert "faster" in row_of(out, "iterations to target")
    code, out, _ = run_compare(capsys, str(base / "run0.json"), str(new / "run0.json"))
    assert "-" in row_of(out, "seconds to target").split()[-1]  # no interval from one run a side
    assert "seconds to target: one value a run: an interval needs 3 runs a side" in out


def test_goodput_compares_where_both_sides_have_a_recovery_block(tmp_path, capsys):
    def failing(seed: int, goodput: float) -> dict:
        return {**results(seed, 2.0), "recovery": {"goodput": {"samples_per_s": goodput}}}

    base = write_runs(tmp_path / "base", [failing(s, 1000.0 + s) for s in (1, 2, 3)])
    new = write_runs(tmp_path / "new", [failing(s, 1500.0 + s) for s in (4, 5, 6)])
    code, out, err = run_compare(capsys, str(base), str(new))
    assert code == 0, err
    assert "more goodput" in row_of(out, "goodput samples/s")
    code, out, _ = run_compare(capsys, str(write_runs(tmp_path / "plain", [results(7, 2.0)])), str(new))
    assert not any(line.startswith("goodput") for line in out.splitlines())  # one side has none


def test_points_match_by_configuration_and_the_rest_is_listed(tmp_path, capsys):
    base = write_runs(tmp_path / "base", [results(1, 2.0, hook="ps"), results(2, 3.0, hook="allreduce")])
    new = write_runs(tmp_path / "new", [results(3, 2.0, hook="ps"), results(4, 3.0, hook="fp16")])
    (tmp_path / "new" / "notes.json").write_text('{"not": "results"}')  # a folder may hold other files
    code, out, err = run_compare(capsys, str(base), str(new))
    assert code == 0, err
    assert "1 point matched by configuration: hook=ps" in out
    assert "unmatched, only in base: hook=allreduce (1 run)" in out
    assert "unmatched, only in new: hook=fp16 (1 run)" in out
    assert "1 file that is not a results file skipped (notes.json)" in out


def test_a_server_the_strategy_sends_nothing_to_does_not_part_two_points(tmp_path, capsys):
    """All-reduce recorded with the idle --nserver 1 every hook had before --nserver followed the
    hook, against today's 0: one point, paired, and the difference shown."""
    base = write_runs(tmp_path / "base", [results(1, 2.0, hook="ps"), results(2, 3.0, hook="allreduce")])
    new = write_runs(tmp_path / "new", [results(3, 2.0, hook="ps"), results(4, 3.0, hook="allreduce", nserver=0)])
    code, out, err = run_compare(capsys, str(base), str(new), "--format", "markdown")
    assert code == 0, err
    assert "2 points matched by configuration" in out and "unmatched" not in out
    assert "hook=allreduce (nserver: 1 -> 0)" in out
    new = write_runs(tmp_path / "new2", [results(5, 2.0, hook="ps", nserver=2)])  # ps's servers count
    base = write_runs(tmp_path / "base2", [results(6, 2.0, hook="ps"), results(7, 2.0, hook="allreduce")])
    code, out, err = run_compare(capsys, str(base), str(new))
    assert code == 2 and "no point of" in err


def test_match_ignores_a_field_and_shows_it(tmp_path, capsys):
    base = write_runs(tmp_path / "base", [results(1, 2.0, hook="ps"), results(2, 2.0, hook="ps", batch_size=32)])
    new = write_runs(tmp_path / "new", [results(3, 2.0, hook="allreduce"),
                                        results(4, 2.0, hook="allreduce", batch_size=32)])
    code, out, _ = run_compare(capsys, str(base), str(new))
    assert code == 2  # two points a side, none with the other's configuration
    code, out, err = run_compare(capsys, str(base), str(new), "--match", "hook", "--format", "markdown")
    assert code == 0, err
    assert "2 points matched by configuration, ignoring hook (--match)" in out
    assert "| batch_size=16 (hook: ps -> allreduce) |" in out.replace("  ", " ")


def test_a_sweeps_repeats_are_runs_and_a_rerun_repeat_replaces_its_line(tmp_path, capsys):
    point = {"index": 1, "name": "plain", "hash": "h1", "sweep": "s"}
    lines = [results(seed, 2.0, point={**point, "repeat": repeat}) for seed, repeat in ((1, 1), (2, 2), (3, 3))]
    lines.append(results(9, 50.0, point={**point, "repeat": 3}))  # repeat 3 again: this line wins
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = run_compare(capsys, str(sweep), str(sweep), "--json", str(tmp_path / "c.json"))
    assert code == 0, err
    record = json.loads((tmp_path / "c.json").read_text())
    assert record["points"] == [{"label": "plain", "hash": record["points"][0]["hash"], "base_runs": 3,
                                 "new_runs": 3, "differs": {}, "interval_from": "runs"}]
    assert all(m["change_pct"] == 0 for m in record["metrics"])
    assert "3 vs 3 runs" in out and "(sweep folder, 3 runs" in out


def test_plot_draws_each_points_runs(tmp_path, capsys):
    base, new = tmp_path / "a.json", tmp_path / "b.json"
    base.write_text(json.dumps(results(1, 2.0)))
    new.write_text(json.dumps(results(2, 3.0)))
    code, _, err = run_compare(capsys, str(base), str(new), "--plot", str(tmp_path / "c.png"))
    assert code == 0, err
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- bad input


@pytest.fixture
def two_files(tmp_path) -> tuple[Path, Path]:
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(results(1, 2.0)))
    new.write_text(json.dumps(results(2, 2.0)))
    return base, new


@pytest.mark.parametrize("case, message", [
    ("missing", "'{tmp}/nothing.json' does not exist"),
    ("not json", "results file '{tmp}/text.json' is not JSON"),
    ("not results", "results file '{tmp}/other.json' is not a ps_bench results file"),
    ("empty folder", "new '{tmp}/empty' holds no results (give a results file, a sweep folder or a folder of "
                     "results files); passed over 1 file of {tmp}/empty that is not a results file (notes.json)"),
    ("other model", "base runs model DummyModelSmall and new runs resnet18"),
    ("newer schema", "has schema 'ps_bench.result/2', and this ps_bench reads ps_bench.result/1"),
    ("negative gate", "--fail-over is a percentage, 0 or more; got -5"),
    ("gate not a number", "argument --fail-over: expected a number, got 'five'"),
    ("unknown match", "--match 'hooks': not an option"),
    ("failed runs only", "holds no successful run"),
])
def test_bad_input_exits_2_with_one_line(case, message, two_files, tmp_path, capsys):
    base, new = two_files
    extra: list[str] = []
    if case == "missing":
        new = tmp_path / "nothing.json"
    elif case == "not json":
        new = tmp_path / "text.json"
        new.write_text("batch 1.2 ms\n")
    elif case == "not results":
        new = tmp_path / "other.json"
        new.write_text('{"name": "a sweep file"}')
    elif case == "empty folder":
        new = tmp_path / "empty"
        new.mkdir()
        (new / "notes.json").write_text("{}")
    elif case == "other model":
        new.write_text(json.dumps(results(2, 2.0, model="resnet18")))
    elif case == "newer schema":
        new.write_text(json.dumps(results(2, 2.0, schema="ps_bench.result/2")))
    elif case == "negative gate":
        extra = ["--fail-over", "-5"]
    elif case == "gate not a number":
        extra = ["--fail-over", "five"]
    elif case == "unknown match":
        extra = ["--match", "hooks"]
    elif case == "failed runs only":
        new.write_text(json.dumps({**results(2, 2.0), "status": "failed"}))
    code, out, err = run_compare(capsys, str(base), str(new), *extra)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and out == ""
    assert message.format(tmp=tmp_path) in err


def test_the_same_runs_on_both_sides_are_compared_and_said_to_be(two_files, tmp_path, capsys):
    """One folder twice, or a file and itself by another path: every change is 0 by construction
    ("no significant change" everywhere), a slip a note under the table names."""
    base, new = two_files
    code, out, _ = run_compare(capsys, str(base), f"{tmp_path}/./base.json")
    assert code == 0 and out.splitlines()[-1] == (
        f"note: base and new are the same runs ({base}, {tmp_path}/./base.json): every change is 0 by "
        f"construction; compare the runs before a change with those after it")
    code, out, _ = run_compare(capsys, str(base), str(new))
    assert code == 0 and "note: base and new" not in out


def test_match_model_compares_two_models(two_files, capsys):
    base, new = two_files
    new.write_text(json.dumps(results(2, 9.0, model="resnet18")))
    code, out, err = run_compare(capsys, str(base), str(new), "--match", "model")
    assert code == 0, err
    assert "slower" in row_of(out, "batch p50")


def test_sides_with_no_common_point_name_what_match_takes_and_it_pairs_them(tmp_path, capsys):
    """The options that differ, as --match takes them: a model's entry (model_config) differs
    with the model, and the hint had named it where --match refuses it."""
    base = write_runs(tmp_path / "base", [results(1, 2.0, ntrainer=n, model_config={"width": 8}) for n in (2, 3)])
    new = write_runs(tmp_path / "new", [results(2, 2.0, ntrainer=n, hook="allreduce", nserver=0,
                                                model_config={"width": 16}) for n in (2, 3)])
    code, out, err = run_compare(capsys, str(base), str(new))
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.rstrip().endswith("the options that differ: nserver, hook, model; --match nserver,hook,model ignores "
                                 "them"), err
    code, out, err = run_compare(capsys, str(base), str(new), "--match", "nserver,hook,model")
    assert code == 0, err
