"""Sweep files expand and validate without starting anything; reports read results files."""

import json
import re
import os
import socket

import pytest

from ps_bench.config import ConfigError
from ps_bench.runfiles import build_config
from ps_bench.job import validate
from ps_bench.report import load_rows, run_report, scaling_table, table, varying_options
from ps_bench.report.command import Baseline
from ps_bench.results.load import diverged
from ps_bench.sweep import load_sweep
from tests.benchrun import ROOT


def sweep(tmp_path, content):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(content))
    return str(path)


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "sweeps").glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_sweep_expands_and_validates(path):
    name, points = load_sweep(str(path))
    assert name == path.stem and points


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "runs").glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_run_file_validates(path):
    validate(build_config({}, str(path)))


def test_grid_is_a_cartesian_product_over_base(tmp_path):
    name, points = load_sweep(sweep(tmp_path, {
        "name": "s", "base": {"rounds": 1}, "grid": {"hook": ["ps", "allreduce"], "ntrainer": [2, 3, 4]}}))
    assert name == "s" and len(points) == 6
    assert [p.name for p in points[:3]] == ["hook=ps ntrainer=2", "hook=ps ntrainer=3", "hook=ps ntrainer=4"]
    assert all(p.options["rounds"] == 1 for p in points)
    assert len({p.config_hash for p in points}) == 6


def test_variants_times_grid_and_either_alone(tmp_path):
    _, points = load_sweep(sweep(tmp_path, {
        "grid": {"hook": ["ps", "allreduce"]},
        "variants": [{"name": "small", "batch_size": 8}, {"name": "big", "batch_size": 32}]}))
    assert [p.name for p in points] == ["small hook=ps", "small hook=allreduce", "big hook=ps", "big hook=allreduce"]
    assert points[2].overrides == {"variant": "big", "hook": "ps", "batch_size": 32}
    _, alone = load_sweep(sweep(tmp_path, {"variants": [{"name": "a", "rounds": 2}]}))
    assert len(alone) == 1 and alone[0].options == {"rounds": 2}


def test_max_restarts_runs_a_point_under_torchrun_and_is_no_run_option(tmp_path):
    _, points = load_sweep(sweep(tmp_path, {
        "base": {"hook": "allreduce", "nserver": 0, "max_restarts": 3},
        "variants": [{"name": "torchrun's"}, {"name": "own", "max_restarts": 0, "rounds": 2}]}))
    assert [p.max_restarts for p in points] == [3, 0]
    assert "max_restarts" not in points[0].options and points[1].options["rounds"] == 2
    _, (plain,) = load_sweep(sweep(tmp_path, {"variants": [{"name": "v"}]}))
    assert plain.max_restarts is None


def test_report_gives_each_runs_failures_and_goodput(tmp_path):
    failed = dict(result("allreduce", 2.0), recovery={
        "failures": [{}, {}], "goodput": {"samples_per_s": 300.0, "failure_free_samples_per_s": 400.0,
                                          "step_efficiency": 0.9}})
    dropped = dict(result("ps", 4.0), recovery={
        "failures": [], "trainers_dropped": [{}], "goodput": {
            "samples_per_s": 100.0, "failure_free_samples_per_s": 200.0, "step_efficiency": 1.0}})
    lines = [dict(failed, point={"index": 1, "name": "a", "hash": "a"}),
             dict(dropped, point={"index": 2, "name": "b", "hash": "b"}),
             dict(result("fsdp", 3.0), point={"index": 3, "name": "c", "hash": "c"})]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    headers, body = table(load_rows([str(tmp_path)]), "batch", Baseline(()))
    at = headers.index("failures")
    assert headers[at:at + 4] == ["failures", "goodput samples/s", "of failure-free", "step efficiency"]
    assert [row[at:at + 4] for row in body] == [[2, "300", "0.75", "0.900"], [1, "100", "0.50", "1.000"],
                                               [None, None, None, None]]


def test_hash_follows_the_resolved_configuration(tmp_path):
    (ps, allreduce), (alias,) = (load_sweep(sweep(tmp_path, {"grid": {"hook": hooks}}))[1]
                                 for hooks in (["ps", "allreduce"], ["rpc_hook"]))
    assert ps.config_hash == alias.config_hash  # an alias resolves to the same run
    assert ps.config_hash != allreduce.config_hash


@pytest.mark.parametrize(
    "content, message",
    [
        ({"grid": {"hook": ["ps", "allredcue"]}}, "point 2 (hook=allredcue): --hook: unknown hook 'allredcue'"),
        ({"grid": {"nserver": [1, 3]}, "base": {"mapping": "group"}}, "point 2 (nserver=3): --mapping group"),
        ({"grid": {"hooks": ["ps"]}}, "unknown option 'hooks'; did you mean 'hook'[?] valid options: activation_checkpointing, backend"),
        ({"grid": {"hook": []}}, "needs a non-empty list"),
        ({"grid": {"ntrainer": ["two"]}}, "'ntrainer' must be a whole number"),
        ({"base": {"out": "x.json"}, "grid": {"hook": ["ps"]}}, "'out' is set by the sweep"),
        ({"base": {"dry_run": True}, "grid": {"hook": ["ps"]}}, "'dry_run' would run no point"),
        ({"grid": {"hook": ["ps", "allreduce", "rpc_hook"]}},
         "points 1 (hook=ps) and 3 (hook=rpc_hook) are the same run: list each once"),
        ({"variants": [{"name": "v"}, {"name": "v", "rounds": 2}]}, "two variants are named 'v'"),
        ({"grid": {"hook": ["ps"], "verbose": [True, False]}}, "are the same run"),  # it reports, not measures
        ({"grid": {"hook": ["ps"]}, "variants": [{"name": "v", "hook": "fp16"}]}, "variant 'v' sets hook"),
        ({"base": {"rounds": 2}}, "has no points"),
        ({"grid": {"hook": ["ps"]}, "extra": 1}, "unknown key 'extra'; valid keys: name, base, grid, variants"),
        ({"grid": {"hook": ["ps"]}, "bse": {}}, "unknown key 'bse'; did you mean 'base'[?] valid keys: name"),
        ({"variants": [{"name": "v", "max_restarts": -1}]},
         "variant 'v': max_restarts runs the point under torchrun with that many restarts: a whole "
         "number, 0 or more; got -1"),
    ],
)
def test_bad_sweeps_name_the_point_and_the_problem(tmp_path, content, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_sweep(sweep(tmp_path, content))


def result(hook, p50, status="ok", sent=100.0):
    return {"schema": "ps_bench.result/1", "status": status, "config": {"hook": hook, "ntrainer": 2, "out": f"{hook}.json"},
            "summary": [{"role": "trainer", "metric": "batch", "unit": "ms", "p50": p50, "p90": p50 * 2}],
            "throughput": {"samples_per_s": 10.0}, "bytes": {"trainer_sent_per_iter": sent}}


def test_report_columns_and_speedups(tmp_path):
    lines = [dict(result("ps", 4.0), point={"index": 1, "name": "hook=ps", "hash": "a"}),
             dict(result("allreduce", 2.0), point={"index": 2, "name": "hook=allreduce", "hash": "b"}),
             dict(result("ps", 8.0, status="failed"), point={"index": 1, "name": "hook=ps", "hash": "a"})]
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n{torn")
    rows = load_rows([str(tmp_path)])
    assert [r.label for r in rows] == ["hook=ps", "hook=allreduce"]  # the re-run of point 1 wins
    assert rows[0].results["status"] == "failed"
    assert varying_options(rows) == ["hook"]  # 'out' is never a column
    headers, body = table(rows, "batch", Baseline((rows[1],)))
    assert headers[0] == "hook" and headers[-2:] == ["speedup", "status"]
    assert body[0][headers.index("speedup")] == "0.25x" and body[1][headers.index("speedup")] == "1.00x"


def test_a_periodic_strategys_speedup_is_by_the_means(tmp_path, capsys):
    """local SGD synchronises once a period: its p50 iteration synchronises nothing, and its
    speedup over all-reduce was the ratio of p50s (15x on DummyModel at 1 Gbit/s, where it
    trains 5x the samples a second); it is the ratio of the means, which amortise the period,
    and the line under the table says so."""
    local, ar = result("local_sgd", 2.0), result("allreduce", 40.0)
    local["summary"][0]["mean"], ar["summary"][0]["mean"] = 10.0, 50.0
    for name, results in (("local.json", local), ("ar.json", ar)):
        (tmp_path / name).write_text(json.dumps(results))
    rows = load_rows([str(tmp_path / "local.json"), str(tmp_path / "ar.json")])
    headers, body = table(rows, "batch", Baseline((rows[1],)))
    assert [line[headers.index("speedup")] for line in body] == ["5.00x", "1.00x"]
    assert run_report([str(tmp_path / "local.json"), str(tmp_path / "ar.json")], "hook=allreduce",
                      "batch", None, None) == 0
    assert "for a strategy that synchronises once a period" in capsys.readouterr().out


def test_report_says_which_runs_diverged(tmp_path):
    """A run whose parameters ended not finite (its file's param_norm is null) is ``ok, diverged``:
    its times hold, its training did not; a run with a finite norm, or under --staleness (no
    replicas, the servers' norm), is ``ok``."""
    nan, fine, stale = result("allreduce", 2.0), result("ps", 4.0), result("ps", 3.0)
    nan["replicas"] = {"identical": True, "param_norm": None, "max_abs_diff": 0.0}
    fine["replicas"] = {"identical": True, "param_norm": 23.3, "max_abs_diff": 0.0}
    stale["replicas"] = {"identical": None, "param_norm": 20.0, "max_abs_diff": None}
    for name, results in (("a", nan), ("b", fine), ("c", stale)):
        (tmp_path / f"{name}.json").write_text(json.dumps(results))
    rows = load_rows([str(tmp_path / f"{name}.json") for name in "abc"])
    headers, body = table(rows, "batch", Baseline((rows[0],)))
    assert [line[headers.index("status")] for line in body] == ["ok, diverged", "ok", "ok"]
    # before it is written (the sweep's line for the point): NaN, not null
    assert diverged({"status": "ok", "replicas": {"param_norm": float("nan")}})
    assert not diverged({"status": "failed", "replicas": {"param_norm": None}})


def test_report_gives_no_speedup_across_workloads(tmp_path, capsys):
    """Points of another model, data, batch or accumulation than the baseline's do other work in an
    iteration: no speedup against it, and a line says so."""
    other_model = result("allreduce", 1.0)
    other_model["config"]["model"] = "resnet18"
    other_batch = result("allreduce", 1.0)
    other_batch["config"]["batch_size"] = 32
    for name, results in (("ps", result("ps", 4.0)), ("ar", result("allreduce", 2.0)), ("model", other_model),
                          ("batch", other_batch)):
        (tmp_path / f"{name}.json").write_text(json.dumps(results))
    rows = load_rows([str(tmp_path / f"{name}.json") for name in ("ps", "ar", "model", "batch")])
    headers, body = table(rows, "batch", Baseline((rows[0],)))
    assert [line[headers.index("speedup")] for line in body] == ["1.00x", "2.00x", None, None]
    assert run_report([str(tmp_path / f"{name}.json") for name in ("ps", "ar", "model", "batch")], None,
                      "batch", None, None) == 0
    assert ("no speedup for 2 points of another workload than that of the point with hook=ps (its model, "
            "model_options, data, batch_size, grad_accum): their iterations do other work") in capsys.readouterr().out


def test_reports_baseline_is_named_as_the_table_shows_it(tmp_path, capsys):
    """Results files' points are rows of the options they differ in: the speedup's line names the
    baseline by them, where it named the file ("speedup: run-7's batch p50")."""
    for name, hook, p50 in (("run-7", "ps", 4.0), ("run-8", "allreduce", 2.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps(result(hook, p50)))
    assert run_report([str(tmp_path / "run-7.json"), str(tmp_path / "run-8.json")], None, "batch",
                      None, None) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[0] == "hook"
    assert "\nspeedup: the batch p50 of the point with hook=ps divided by each point's (above 1 is faster)\n" in out


def test_a_baseline_no_point_has_says_what_the_points_have(tmp_path):
    """It said only "no point has hok=ps": now the values the option takes, or, for a name that
    is no option, the closest one and the options the points differ in."""
    for hook, p50 in (("ps", 4.0), ("allreduce", 2.0)):
        (tmp_path / f"{hook}.json").write_text(json.dumps(result(hook, p50)))
    files = [str(tmp_path / "ps.json"), str(tmp_path / "allreduce.json")]
    for baseline, said in (("hook=fp16", "no point has hook=fp16; hook is allreduce, ps in these points"),
                           ("hok=ps", "no point has hok=ps; 'hok' is not an option; did you mean 'hook'? the "
                                      "points differ in hook")):
        with pytest.raises(ConfigError, match=f"^--baseline {baseline}: {re.escape(said)}$"):
            run_report(files, baseline, "batch", None, None)


def test_a_baseline_in_a_grid_is_the_one_alike_each_point(tmp_path, capsys):
    """A grid of hooks over links with --baseline hook=allreduce: each point against all-reduce on
    its own link; it had been against the first all-reduce of the grid (all-reduce at 10 Gbit/s
    shown 1.89x "faster" than itself at 1 Gbit/s). A link without all-reduce gets none."""
    files = []
    for hook, link, p50 in (("allreduce", "1gbit", 400.0), ("ps", "1gbit", 800.0), ("allreduce", "10gbit", 200.0),
                            ("ps", "10gbit", 100.0), ("ps", "100gbit", 50.0)):
        results = result(hook, p50)
        results["config"]["emulate_link"] = link
        files.append(tmp_path / f"{hook}-{link}.json")
        files[-1].write_text(json.dumps(results))
    assert run_report([str(f) for f in files], "hook=allreduce", "batch", None, None) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    speedups = [line.split()[-2] for line in lines[2:7]]
    assert speedups == ["1.00x", "0.50x", "1.00x", "2.00x", "-"], out
    assert ("speedup: the batch p50 of the point with hook=allreduce at the same emulate_link divided by "
            "each point's") in out
    assert "no speedup for 1 point with no point of hook=allreduce at its emulate_link" in out


def test_repeat_runs_each_point_several_times_and_report_shows_every_run(tmp_path, capsys):
    """Each run of a repeated point is a row, measured against the baseline's run of the same
    turn, and a line gives the median over the runs (until 2026-11-28 the report showed a
    repeated point's last run alone); a re-run repeat's latest line replaces its own only."""
    _, points = load_sweep(sweep(tmp_path, {"grid": {"hook": ["ps", "allreduce"]}, "repeat": 3}))
    assert [p.repeats for p in points] == [3, 3]
    assert load_sweep(sweep(tmp_path, {"grid": {"hook": ["ps"]}}))[1][0].repeats == 1
    for bad in (0, "3", 2.5, True):
        with pytest.raises(ConfigError, match="repeat must be a whole number of runs per point, at least 1"):
            load_sweep(sweep(tmp_path, {"grid": {"hook": ["ps"]}, "repeat": bad}))
    ps, allreduce = ({"index": 1, "name": "hook=ps", "hash": "a"}, {"index": 2, "name": "hook=allreduce", "hash": "b"})
    lines = [dict(result(hook, p50), point={**point, "repeat": repeat})
             for repeat, ps_p50, allreduce_p50 in ((1, 4.0, 2.0), (2, 6.0, 4.0), (3, 9.0, 3.0))
             for hook, point, p50 in (("ps", ps, ps_p50), ("allreduce", allreduce, allreduce_p50))]
    lines.append(dict(result("ps", 5.0), point={**ps, "repeat": 3}))  # repeat 3 of ps again: it wins
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    rows = load_rows([str(tmp_path)])
    assert [(row.label, row.run, row.stat("batch", "p50")) for row in rows] == [
        ("hook=ps", 1, 4.0), ("hook=ps", 2, 6.0), ("hook=ps", 3, 5.0),
        ("hook=allreduce", 1, 2.0), ("hook=allreduce", 2, 4.0), ("hook=allreduce", 3, 3.0)]
    assert run_report([str(tmp_path)], "hook=allreduce", "batch", str(tmp_path / "t.csv"), None) == 0
    out = capsys.readouterr().out
    table_lines = (tmp_path / "t.csv").read_text().splitlines()
    assert table_lines[0].startswith("hook,run,batch p50 ms")
    # each run against all-reduce's of its turn: 2/4, 4/6, 3/5
    assert [line.split(",")[-2] for line in table_lines[1:4]] == ["0.50x", "0.67x", "0.60x"]
    assert ("hook=ps: over 3 runs, median batch p50 5.000 ms (runs 4.000 ms to 6.000 ms), speedup 0.60x "
            "(runs 0.50x to 0.67x)") in out
    assert "hook=allreduce: over 3 runs, median batch p50 3.000 ms" in out
    headers, body = scaling_table(rows, None)  # --scaling: a row a run too
    assert [line[headers.index("run")] for line in body] == [1, 2, 3, 1, 2, 3]
    lines.append(dict(result("allreduce", 90.0, status="failed"), point={**allreduce, "repeat": 2}))
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert run_report([str(tmp_path)], "hook=allreduce", "batch", None, None) == 0
    assert ("hook=allreduce: over 2 runs (1 failed, left out), median batch p50 2.500 ms (runs 2.000 ms to "
            "3.000 ms)") in capsys.readouterr().out
    rows = load_rows([str(tmp_path)])
    headers, body = table(rows, "batch", Baseline(tuple(rows[3:])))
    assert body[1][headers.index("speedup")] == "0.33x"  # ps's run 2 against all-reduce's first: its 2nd failed


def test_a_file_given_to_the_wrong_command_is_named_for_what_it_is(tmp_path, capsys):
    """A sweep file as --config, a run or results file as a sweep, a run file as results: each
    was an 'unknown option' or 'not a results file' line that did not say which command reads it."""
    from ps_bench.cli import main

    run_file = ROOT / "configs" / "runs" / "upstream_ps.json"
    results = tmp_path / "r.json"
    results.write_text(json.dumps(result("ps", 4.0)))
    sweep_file = sweep(tmp_path, {"grid": {"hook": ["ps", "allreduce"]}})
    for argv, message in (
            (["--config", sweep_file, "--dry-run"], f"'{sweep_file}' is a sweep file: run it with bench.py sweep"),
            (["sweep", str(results), "--out", str(tmp_path / "o"), "--dry-run"],
             f"'{results}' is a results file: make its run again with bench.py --config {results}"),
            (["sweep", str(run_file), "--out", str(tmp_path / "o"), "--dry-run"],
             f"'{run_file}' is a run config: run it with bench.py --config {run_file}"),
            (["report", str(run_file)], "holds a run config, not results: run it with bench.py --config FILE"),
            (["predict", str(run_file), "--trainers", "4"], "holds a run config, not results")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "inf"])
def test_a_point_timeout_that_is_no_time_is_refused(seconds, tmp_path, capsys):
    """-1 was taken: every point failed, its watchdog fired at once."""
    from ps_bench.cli import main

    assert main(["sweep", sweep(tmp_path, {"grid": {"hook": ["ps"]}}), "--out", str(tmp_path / "o"),
                 "--point-timeout", seconds]) == 2
    assert capsys.readouterr().err == (f"ps_bench: error: --point-timeout must be a positive number of "
                                       f"seconds; got {float(seconds):g}\n")
    assert not (tmp_path / "o").exists()


REPORT_REFUSALS = [
    (["{dir}", "{dir}"], "'{dir}' is given twice: give it once"),
    (["{dir}", "{dir}/results.jsonl"], "'{dir}' and '{dir}/results.jsonl' both hold the runs of"),
    (["{dir}/ps.json", "{dir}/./ps.json"], "both hold the runs of"),
    (["{dir}", "--link", "10gbit"], "--link is the bandwidth of --scaling's bounds: give --scaling too"),
    (["{dir}", "--scaling", "--plot", "{dir}/p.png"], "--scaling prints its own table, against the analytic bounds: "
                                                      "--plot does not apply to it"),
    (["{dir}", "--scaling", "--baseline", "hook=ps", "--plot", "{dir}/p.png"], "--baseline and --plot do not apply"),
]


@pytest.mark.parametrize("argv, message", REPORT_REFUSALS, ids=[message[:40] for _, message in REPORT_REFUSALS])
def test_report_refuses_runs_read_twice_and_flags_that_would_do_nothing(tmp_path, capsys, argv, message):
    """The same runs given twice counted twice in every median; --link without --scaling, and
    --plot or --baseline with it, were taken and did nothing."""
    from ps_bench.cli import main

    lines = [dict(result("ps", 4.0), point={"index": 1, "name": "hook=ps", "hash": "a"})]
    (tmp_path / "results.jsonl").write_text(json.dumps(lines[0]) + "\n")
    (tmp_path / "ps.json").write_text(json.dumps(result("ps", 4.0)))
    fill = [word.replace("{dir}", str(tmp_path)) for word in argv]
    assert main(["report", *fill]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.replace("{dir}", str(tmp_path)) in err, err
    assert not (tmp_path / "p.png").exists()


def test_a_dry_run_lists_the_points_and_what_resume_would_skip(tmp_path, capsys):
    """``sweep --dry-run``: every run the sweep would make, with its processes and whether
    ``--resume`` would skip it; nothing created, no process started."""
    from ps_bench.cli import main

    path = sweep(tmp_path, {"name": "dry", "base": {"rounds": 1}, "grid": {"hook": ["allreduce", "ps"]},
                            "repeat": 2})
    out = tmp_path / "out"
    assert main(["sweep", path, "--out", str(out), "--dry-run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert not out.exists()
    assert printed[0] == f"sweep dry: 2 points x 2 runs each, 0 runs already done, 4 to run; results in {out / 'results.jsonl'}"
    rows = [line.split() for line in printed[3:]]
    assert [row[:3] for row in rows] == [["1", "hook=allreduce", "1"], ["2", "hook=ps", "1"],
                                         ["1", "hook=allreduce", "2"], ["2", "hook=ps", "2"]]
    assert " ".join(rows[1][3:]) == "4: 2 trainers, 1 server, 1 master to run"
    assert " ".join(rows[0][3:]) == "3: 2 trainers, 0 servers, 1 master to run"

    _, points = load_sweep(path)
    out.mkdir()
    (out / "results.jsonl").write_text(json.dumps(dict(result("ps", 4.0), point={
        "index": 2, "name": "hook=ps", "hash": points[1].config_hash, "repeat": 1})) + "\n")
    assert main(["sweep", path, "--out", str(out), "--dry-run", "--resume"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "1 run already done, 3 to run" in printed[0]
    assert [line.split()[-1] for line in printed[3:]] == ["run", "done", "run", "run"]
    assert sorted(path.name for path in out.iterdir()) == ["results.jsonl"]
    assert main(["sweep", path, "--out", str(out), "--dry-run"]) == 2  # as the sweep itself would
    assert "already holds results: add --resume" in capsys.readouterr().err


def test_a_key_given_twice_in_a_sweep_is_refused_where_a_foreign_file_keeps_the_last(tmp_path):
    """JSON's readers keep the last of a key given twice; ps_bench's own files say it (one of
    the two was meant), DeepSpeed's and Hugging Face's configs are read as their tools read them."""
    from ps_bench.config import read_json

    path = tmp_path / "sweep.json"
    path.write_text('{"grid": {"hook": ["ps"]}, "base": {"rounds": 1, "warmup_rounds": 1, "rounds": 2}}')
    with pytest.raises(ConfigError, match=r"^sweep file '.*sweep.json': key 'rounds' is given twice in one "
                                          r"object \(1, then 2\)$"):
        load_sweep(str(path))
    assert read_json(path, "--ds-config", own_format=False)["base"] == {"rounds": 2, "warmup_rounds": 1}


def test_a_file_where_the_sweep_keeps_its_points_is_one_line(tmp_path, capsys):
    """The sweep's own folders are made after every point is checked; a file standing in the way
    was mkdir's FileExistsError traceback."""
    from ps_bench.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "points").write_text("")
    assert main(["sweep", sweep(tmp_path, {"grid": {"hook": ["ps"]}}), "--out", str(out)]) == 2
    assert capsys.readouterr().err == f"ps_bench: error: --out {out}: {out / 'points'} is a file, not a folder\n"


def test_a_folder_another_sweep_is_running_into_is_refused(tmp_path, capsys):
    """Two sweeps into one folder each ran every point not yet recorded, side by side on the same
    cores, and both recorded them. While one holds the folder (here this test holds it, as a
    sweep does: ``hold_folder``) another is refused at once, naming the holder; a --dry-run still
    answers; once the hold is let go, the folder is free."""
    from ps_bench.cli import main
    from ps_bench.sweep import hold_folder

    out, path = tmp_path / "out", sweep(tmp_path, {"grid": {"hook": ["ps"]}})
    hold = hold_folder(str(out))
    try:
        assert main(["sweep", path, "--out", str(out), "--resume"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ps_bench: error: --out {out}: another sweep is running into it (pid {os.getpid()} "
                              f"on {socket.gethostname()}, since ") and err.count("\n") == 1, err
        assert err.endswith("); wait for it to end, or choose another --out\n"), err
        assert main(["sweep", path, "--out", str(out), "--resume", "--dry-run"]) == 0
        assert "1 point, 0 already done, 1 to run" in capsys.readouterr().out
    finally:
        hold.close()
    assert not (out / "results.jsonl").exists()
    hold_folder(str(out)).close()


def test_a_report_of_runs_that_all_failed_before_a_timed_round_says_so(tmp_path, capsys):
    """It said "--metric 'batch' is in no results; known: none", as if the metric were wrong."""
    from ps_bench.cli import main

    failed = {**result("ps", 4.0, status="failed"), "summary": [], "error": "trainer 0 (rank 0, trainer0) failed: X"}
    (tmp_path / "f.json").write_text(json.dumps(failed))
    assert main(["report", str(tmp_path / "f.json")]) == 2
    assert capsys.readouterr().err == (
        f"ps_bench: error: report: no run in {tmp_path / 'f.json'} finished a timed round (1 failed; the first: "
        f"trainer 0 (rank 0, trainer0) failed: X): nothing to compare\n")
