"""report --plot: which option the lines or bars run over, and a figure of many unlike points
that keeps every label on the canvas."""

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from ps_bench.cli import main
from ps_bench.report import Row
from ps_bench.report.figures import bar_groups, label, line_axis, per_point, plot
from ps_bench.report.rows import varying_options

pytest.importorskip("matplotlib")

# A results file of `python bench.py` (commit 32d8e0b), its samples cut to five per metric.
EARLIER = Path(__file__).resolve().parents[1] / "fixtures" / "ps-2t1s-32d8e0b.json"


def point(name: str, batch_ms: float, **config) -> Row:
    return Row(name, {"status": "ok", "config": config,
                      "summary": [{"role": "trainer", "metric": "batch", "p50": batch_ms}],
                      "samples": [{"metrics": {"batch": [batch_ms * f for f in (0.9, 1.0, 1.1)]}}]})


def hooks_at(ntrainers, hooks=("ps", "allreduce", "fp16")) -> list[Row]:
    """Each hook at each trainer count; nserver goes with the hook (1 for ps, 0 otherwise)."""
    return [point(f"{hook}-{n}", 10.0 * n, ntrainer=n, nserver=int(hook == "ps"), hook=hook)
            for n in ntrainers for hook in hooks]


def test_lines_run_over_the_option_that_varies_within_a_line():
    rows = hooks_at([1, 2, 4])
    assert line_axis(rows, varying_options(rows)) == "ntrainer"


def test_an_option_that_varies_only_with_another_makes_bars_not_lines():
    """Hooks at one trainer count: nserver varies, but only with the hook; a line over it would
    be a dot per hook (and nserver is no column: --nserver left out follows the hook)."""
    rows = hooks_at([4])
    columns = varying_options(rows)
    assert columns == ["hook"] and line_axis(rows, columns) is None
    rows[0].results["config"]["ntrainer"] = 5  # a column of its own, not the hook's
    assert line_axis(rows, varying_options(rows)) is None
    assert bar_groups(rows, columns) is None  # a group a hook would hold one bar: one bar a point
    two = [point(f"{h}-{p}", 5.0, hook=h, precision=p) for h in ("ps", "allreduce")
           for p in ("fp32", "bf16")]
    assert bar_groups(two, varying_options(two)) == "hook"  # two bars a hook, each in both groups


def test_server_counts_are_columns_unless_they_only_go_with_the_hook():
    """--nserver left out follows the hook (1 for ps, 0 for allreduce): a column of it would say
    the hook again; swept on its own, or against the hook, it is a column."""
    assert varying_options(hooks_at([1, 2])) == ["ntrainer", "hook"]
    grid = [point(f"{h}-{s}", 1.0, nserver=s, hook=h) for h in ("ps", "ps_fp16") for s in (1, 2)]
    assert varying_options(grid) == ["nserver", "hook"]
    alone = [point(f"ps-{s}", 1.0, nserver=s, hook="ps") for s in (1, 2)]
    assert varying_options(alone) == ["nserver"]
    cuda = [point(h, 1.0, ncudaserver=int(h == "ps"), hook=h) for h in ("ps", "allreduce")]
    assert varying_options(cuda) == ["hook"]


def test_a_point_run_several_times_is_one_bar_over_the_samples_of_every_run():
    runs = [point("hook=ps", ms, hook="ps") for ms in (10.0, 20.0)]
    for run, row in enumerate(runs, 1):
        row.run, row.results["point"] = run, {"hash": "a"}
    rows, stats = per_point([*runs, point("hook=allreduce", 5.0, hook="allreduce")], "batch")
    assert rows == [runs[0], rows[1]] and rows[1].label == "hook=allreduce"
    assert list(stats[id(runs[0])]) == pytest.approx(list(np.percentile([9, 10, 11, 18, 20, 22], [10, 50, 90])))


def test_an_unset_option_says_nothing_in_a_label():
    row = point("p", 1.0, hook="ps", per_host=None, hook_options={}, straggler=[])
    assert label(row, ["hook", "per_host", "hook_options", "straggler"]) == "hook=ps"
    assert label(row, ["hook"]) == "ps"


@pytest.mark.parametrize("trainers", [[4], [1, 2, 4]], ids=["bars", "lines"])
def test_a_figure_of_many_unlike_points_is_drawn_whole_without_a_warning(trainers, tmp_path):
    """Forty points with long labels (a folder of unrelated runs): the legend and the labels
    once made tight_layout give up with a warning, the legend drawn over the data."""
    rows = [point(f"run-{i}", 5.0 + i, ntrainer=n, nserver=i % 3, hook=f"hook_{i}",
                  model=f"AModelWithALongName{i}", lr=0.01 * (1 + i))
            for i in range(40 // len(trainers)) for n in trainers]
    target = tmp_path / "many.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot(str(target), rows, "batch", "many points")
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_of_runs_with_and_without_loss_curves_plots_what_all_have(tmp_path, capsys):
    """One run to a target loss among others: the figure had been its loss curve alone, every
    other point left out without a word."""
    earlier = json.loads(EARLIER.read_text())
    curve = [[i, 0.1 * i, 2.0 - 0.1 * i] for i in range(8)]
    converged = {**earlier, "convergence": {
        "target_loss": 1.5, "reached": True, "iterations": 6, "seconds": 0.6, "stopped_by": "target",
        "diverged": False, "final_loss": 1.3, "smoothing": 2, "max_iterations": 20, "labels": "teacher",
        "loss_curve": curve, "held_out": []}}
    (tmp_path / "plain.json").write_text(json.dumps(earlier))
    (tmp_path / "target.json").write_text(json.dumps(converged))
    assert main(["report", str(tmp_path), "--plot", str(tmp_path / "both.png")]) == 0
    out = capsys.readouterr().out
    assert "plot: batch times, as 1 point has no loss curve; report the 1 with one on their own" in out
    (tmp_path / "plain.json").unlink()
    assert main(["report", str(tmp_path), "--plot", str(tmp_path / "loss.png")]) == 0
    assert "no loss curve" not in capsys.readouterr().out
