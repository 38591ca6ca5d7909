"""``bench.py compare`` on real runs: one sweep, made once, of the default job with and without a
persistent straggler, each run 6 times (``"repeat": 6``). Same against same is no change (A/A);
the straggler is slower, significantly, and fails the gate; a sweep folder against itself
matches every point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ps_bench.cli import main
from tests.benchrun import run_bench

# 20 ms in each of trainer 1's iterations: several times the default job's iteration (3 to 5 ms
# here), which every synchronous strategy makes the other trainer wait for
STRAGGLER = "trainer:1:20ms"
SWEEP = {"name": "compare", "base": {"rounds": 1},
         "variants": [{"name": "plain"}, {"name": "straggler", "straggler": [STRAGGLER]}], "repeat": 6}


def run_sweep(folder: Path, content: dict) -> Path:
    (folder / "sweep.json").write_text(json.dumps(content))
    run = run_bench("sweep", str(folder / "sweep.json"), "--out", str(folder / "runs"), timeout_s=240)
    assert run.returncode == 0, run.output
    return folder


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    return run_sweep(tmp_path_factory.mktemp("compare"), SWEEP)


def side(sweep: Path, name: str, repeats: tuple[int, ...]) -> Path:
    """A folder of results files: the runs of one point of the sweep, those of the given repeats."""
    folder = sweep / f"{name}-{'-'.join(map(str, repeats))}"
    if not folder.exists():
        folder.mkdir()
        for text in (sweep / "runs" / "results.jsonl").read_text().splitlines():
            line = json.loads(text)
            if line["point"]["name"] == name and line["point"]["repeat"] in repeats:
                (folder / f"run{line['point']['repeat']}.json").write_text(text)
    return folder


def compare(capsys, tmp_path: Path, *argv: str) -> tuple[int, str, dict]:
    code = main(["compare", *argv, "--json", str(tmp_path / "comparison.json")])
    return code, capsys.readouterr().out, json.loads((tmp_path / "comparison.json").read_text())


def test_three_runs_against_three_more_of_the_same_are_no_significant_change(sweep, tmp_path, tmp_path_factory,
                                                                             capsys):
    """A/A. The sides take turns in time (odd and even repeats), so a machine whose load changes
    during the test touches both alike: what is left is the noise between runs. A 95 % interval
    calls an A/A pair different now and then by design (on the development machine 5 to 10 % of
    pairs for each metric, one in five for any of them: benchmarks/noise.py), so a pair called
    different gets one more, fresh pair; two in a row would say the interval is too narrow (the
    within-run interval, which is, calls nearly every pair different)."""
    trials = []
    for folder in (sweep, None):
        if folder is None:  # the second trial: new runs of the same configuration
            folder = run_sweep(tmp_path_factory.mktemp("compare-again"), {**SWEEP, "variants": SWEEP["variants"][:1]})
        code, out, record = compare(capsys, tmp_path, str(side(folder, "plain", (1, 3, 5))),
                                    str(side(folder, "plain", (2, 4, 6))), "--fail-over", "5")
        assert record["points"][0]["interval_from"] == "runs" and record["points"][0]["base_runs"] == 3
        verdicts = {m["metric"]: m["verdict"] for m in record["metrics"]}
        assert set(verdicts) == {"batch p50", "batch p90", "comm p50", "samples/s", "bytes/iter", "trainer MiB"}
        trials.append(out)
        if set(verdicts.values()) == {"no significant change"}:
            assert code == 0 and "--fail-over 5: passed" in out
            return
    pytest.fail("two A/A pairs in a row were called different:\n" + "\n\n".join(trials))


def test_a_persistent_straggler_is_slower_and_fails_the_gate(sweep, tmp_path, capsys):
    code, out, record = compare(capsys, tmp_path, str(side(sweep, "plain", (1, 3, 5))),
                                str(side(sweep, "straggler", (1, 3, 5))), "--fail-over", "5")
    assert code == 1, out
    assert f'straggler: [] -> ["{STRAGGLER}"]' in out  # the option that differs, shown
    metrics = {m["metric"]: m for m in record["metrics"]}
    batch = metrics["batch p50"]
    assert batch["verdict"] == "slower" and batch["significant"] and batch["interval_from"] == "runs"
    assert batch["ci_low_pct"] > 5 and batch["change_pct"] > 100
    assert metrics["samples/s"]["verdict"] == "slower"
    assert metrics["bytes/iter"]["verdict"] == "no significant change"  # the straggler sends what it did
    assert "--fail-over 5: FAILED" in out and record["exit_status"] == 1


def test_a_sweep_folder_against_itself_matches_every_point(sweep, tmp_path, capsys):
    code, out, record = compare(capsys, tmp_path, str(sweep / "runs"), str(sweep / "runs"), "--fail-over", "0")
    assert code == 0, out
    assert "\nnote: base and new are the same runs (" in out  # a user's slip, said
    assert sorted(p["label"] for p in record["points"]) == ["plain", "straggler"]
    assert all(p["base_runs"] == p["new_runs"] == 6 for p in record["points"])
    assert record["unmatched"] == {"base": [], "new": []}
    assert all(m["change_pct"] == 0 and not m["significant"] for m in record["metrics"])
