"""Results files: written atomically and never over another, a sweep's lines appended whole, and
read back through the one checked loader, whose refusal is the same one line from every command."""

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

from ps_bench.cli import main
from ps_bench.config import ConfigError
from ps_bench.runfiles import build_config
from ps_bench.job import validate
from ps_bench.options import parse_run_options
from ps_bench.processes.launch import LaunchSpec, keep_finished_rounds
from ps_bench.results.files import append_line, write_results
from ps_bench.results.load import load_file, load_lines, load_source

# A results file ps_bench wrote before the results package existed (commit 32d8e0b, `python bench.py`
# on the development machine), its samples cut to five per metric.
EARLIER = Path(__file__).resolve().parents[1] / "fixtures" / "ps-2t1s-32d8e0b.json"


def test_results_are_never_overwritten(tmp_path):
    target = tmp_path / "out" / "run.json"
    first = write_results({"n": 1}, target)
    second = write_results({"n": 2}, target)
    third = write_results({"n": 3}, target)
    assert (first, second, third) == (target, target.with_name("run-1.json"), target.with_name("run-2.json"))
    assert [json.loads(p.read_text())["n"] for p in (first, second, third)] == [1, 2, 3]
    assert sorted(p.name for p in target.parent.iterdir()) == ["run-1.json", "run-2.json", "run.json"]


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask 022", "umask 027"])
def test_a_results_file_has_the_mode_any_file_the_user_writes_has(tmp_path, mask, mode):
    """Written through a private temporary file, but readable as the user's umask allows (a
    results file is shared with a team, copied off a cluster), not left at 0600."""
    previous = os.umask(mask)
    try:
        written = write_results({"n": 1}, tmp_path / "run.json")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(written.stat().st_mode) == mode


def test_a_failed_runs_results_go_to_the_temporary_folder_where_their_path_cannot_be_written(
        tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"  # a file where the results' folder should be
    blocker.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    cfg = build_config(*parse_run_options(["--rounds", "3"]))
    spec = LaunchSpec(validate(cfg), ["bench.py", "--rounds", "3"], str(tmp_path / "run"),
                      str(blocker / "r.json"), cfg.world_size, 0)
    kept = keep_finished_rounds(spec, "master 0 (rank 3, master) failed: OSError")
    assert kept == tmp_path / "tmp" / "ps_bench" / "r.json"
    results = json.loads(kept.read_text())
    assert results["status"] == "failed" and "OSError" in results["error"]
    assert results["config"]["rounds"] == 3
    assert capsys.readouterr().err == (f"ps_bench: warning: the results could not be written to "
                                       f"{blocker / 'r.json'}: {blocker} is a file, not a folder\n")


def test_numbers_that_are_not_finite_are_written_as_null_so_that_any_json_reader_reads_the_file(tmp_path):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    diverged = {"replicas": {"param_norm": float("nan"), "max_abs_diff": float("inf")},
                "loss": {"first": 2.5, "last": float("-inf")}, "curve": [(1, float("nan")), (2, 0.5)]}
    written = json.loads(write_results(diverged, tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert written == {"replicas": {"param_norm": None, "max_abs_diff": None},
                       "loss": {"first": 2.5, "last": None}, "curve": [[1, None], [2, 0.5]]}
    append_line(tmp_path / "results.jsonl", diverged)
    assert json.loads((tmp_path / "results.jsonl").read_text(), parse_constant=refuse) == written


def test_a_file_written_before_the_results_package_is_read_by_every_command(tmp_path, capsys):
    assert load_file(EARLIER)["schema"] == "ps_bench.result/1"
    assert main(["report", str(EARLIER)]) == 0
    assert main(["compare", str(EARLIER), str(EARLIER)]) == 0
    capsys.readouterr()


def bad_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Files every reader refuses, and the words each refusal has."""
    text = EARLIER.read_text()
    files = {
        "other schema": (json.dumps({**json.loads(text), "schema": "ps_bench.result/2"}),
                         "has schema 'ps_bench.result/2', and this ps_bench reads ps_bench.result/1"),
        "truncated": (text[: len(text) // 2], "is truncated: its JSON is cut off at line"),
        "truncated in a string": (text[: text.index('"hostname"') + 4], "is truncated: its JSON is cut off at line"),
        "not results": (json.dumps({"loss": [1.0, 0.5]}), "is not a ps_bench results file"),
    }
    made = {}
    for case, (content, words) in files.items():
        path = tmp_path / f"{case.replace(' ', '-')}.json"
        path.write_text(content)
        made[case] = (path, words)
    return made


@pytest.mark.parametrize("case", ["other schema", "truncated", "truncated in a string", "not results"])
def test_report_compare_and_predict_refuse_a_bad_file_with_the_same_line(case, tmp_path, capsys):
    path, words = bad_files(tmp_path)[case]
    lines = []
    for argv in (["report", str(path)], ["compare", str(EARLIER), str(path)], ["predict", str(path), "--trainers", "4"]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        lines.append(captured.err)
    assert lines[0] == lines[1] == lines[2]
    assert lines[0] == f"ps_bench: error: results file {str(path)!r} {words}" + lines[0].split(words, 1)[1]


@pytest.mark.parametrize("flag", ["--csv", "--plot", "--json", "--out"])
def test_report_compare_and_predict_refuse_an_output_they_cannot_write_before_reading_anything(
        flag, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    commands = {"--csv": ("report", "compare"), "--plot": ("report", "compare", "predict"),
                "--json": ("compare",), "--out": ("predict",)}[flag]
    argvs = {"report": ["report", str(EARLIER)], "compare": ["compare", str(EARLIER), str(EARLIER)],
             "predict": ["predict", str(EARLIER), "--trainers", "4"]}
    for command in commands:
        for target, words in ((blocker / "x.out", "is not a folder"), (tmp_path, "is a folder; give a file name"),
                              ("-", "-: give a file name (a file named '-' is what this would write")):
            assert main([*argvs[command], flag, str(target)]) == 2, command
            captured = capsys.readouterr()
            assert captured.out == "" and captured.err.count("\n") == 1 and words in captured.err, captured.err
            assert flag in captured.err
    assert not Path("-").exists()


def test_two_outputs_of_one_command_naming_one_file_are_refused_before_the_work(tmp_path, capsys):
    """The one written last replaced the other, and both were reported written."""
    same = tmp_path / "out.png"
    for argv, flags in ((["report", str(EARLIER), "--csv", str(same), "--plot", str(same)], "--csv and --plot"),
                        (["compare", str(EARLIER), str(EARLIER), "--csv", str(same), "--json",
                          str(tmp_path / "." / "out.png")], "--csv and --json"),
                        (["predict", str(EARLIER), "--trainers", "4", "--out", str(same), "--plot", str(same)],
                         "--out and --plot")):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert f"{flags} both name" in captured.err and "give each its own file" in captured.err, captured.err
    assert not same.exists()


def test_an_output_that_names_a_file_the_command_reads_is_refused_before_the_work(tmp_path, capsys):
    """``report r.json --csv r.json`` replaced the results file with the table, and ``report DIR --csv
    DIR/results.jsonl`` a whole sweep's lines."""
    run = tmp_path / "r.json"
    run.write_bytes(EARLIER.read_bytes())
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "results.jsonl").write_text(json.dumps(json.loads(EARLIER.read_text())) + "\n")
    kept = {path: path.read_bytes() for path in (run, sweep / "results.jsonl")}
    for argv in (["report", str(run), "--csv", str(run)],
                 ["report", str(sweep), "--csv", str(sweep / "results.jsonl")],
                 ["compare", str(EARLIER), str(sweep), "--json", str(sweep / "results.jsonl")],
                 ["predict", str(run), "--trainers", "4", "--out", str(tmp_path / "." / "r.json")],
                 ["predict", str(EARLIER), "--trainers", "4", "--compare", str(run), "--plot", str(run)]):
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured.err
        assert "is a file this command reads: writing it would lose what it holds" in captured.err, captured.err
    assert {path: path.read_bytes() for path in kept} == kept


def test_a_plot_whose_extension_names_no_kind_of_figure_is_refused_before_the_work(tmp_path, capsys):
    """matplotlib infers the kind from the extension: ``.txt`` failed after the work with its
    traceback, and a name without one was written with ``.png`` added, under another name."""
    argvs = [["report", str(EARLIER)], ["compare", str(EARLIER), str(EARLIER)],
             ["predict", str(EARLIER), "--trainers", "4"]]
    for argv in argvs:
        for name in ("speed.txt", "speed"):
            assert main([*argv, "--plot", str(tmp_path / name)]) == 2, argv
            captured = capsys.readouterr()
            assert captured.out == "" and captured.err == (
                f"ps_bench: error: --plot {str(tmp_path / name)!r}: name a kind of figure by its "
                f"extension, one of {captured.err.split('one of ', 1)[1]}")
            assert ".png, " in captured.err and ".svg, " in captured.err
    assert not list(tmp_path.iterdir())
    assert main([*argvs[0], "--plot", str(tmp_path / "speed.SVG")]) == 0
    assert (tmp_path / "speed.SVG").read_text().lstrip().startswith("<?xml")


def test_report_and_compare_make_the_folder_of_a_csv(tmp_path, capsys):
    assert main(["report", str(EARLIER), "--csv", str(tmp_path / "new" / "r.csv")]) == 0
    assert main(["compare", str(EARLIER), str(EARLIER), "--csv", str(tmp_path / "other" / "c.csv")]) == 0
    assert (tmp_path / "new" / "r.csv").read_text().count("\n") >= 2
    assert (tmp_path / "other" / "c.csv").read_text().count("\n") >= 2


def test_report_scaling_takes_the_link_in_bits_as_predict_does(capsys):
    """``--link 10gbit`` is 1.25 GB/s; a byte unit is refused as predict refuses it (the option
    had been ``--link-gbps`` in gigabytes a second, eight times the link a user meant)."""
    assert main(["report", str(EARLIER), "--scaling", "--link", "10gbit"]) == 0
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert header.split()[10:12] == ["B", "GB/s"] and row.split()[6] == "1.25", (header, row)
    assert main(["report", str(EARLIER), "--scaling", "--link", "10gbps"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--link 10gbps: 'gbps' means bytes a second" in err, err


def test_report_says_which_files_of_a_folder_it_passed_over(tmp_path, capsys):
    """A folder's files that are not results files are left out of the table, and said so on
    stderr (they were dropped without a word); a folder of nothing else says what it held."""
    (tmp_path / "run.json").write_text(EARLIER.read_text())
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "half.json").write_text(EARLIER.read_text()[:50])
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"ps_bench: report: passed over 2 files of {tmp_path} that are not results "
                            f"files (half.json, notes.json)\n")
    assert captured.out.count(" ok") == 1
    (tmp_path / "run.json").unlink()
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"ps_bench: error: report: no results in {tmp_path} (passed over 2 "
                                       f"files of {tmp_path} that are not results files (half.json, notes.json))\n")


def test_a_sweeps_torn_line_is_passed_over_and_the_next_line_stays_whole(tmp_path):
    lines = tmp_path / "results.jsonl"
    earlier = load_file(EARLIER)
    append_line(lines, earlier)
    with open(lines, "a") as stream:  # a writer killed half-way through its line
        stream.write(json.dumps(earlier)[:100])
    append_line(lines, {**earlier, "status": "failed", "error": "the next run"})
    assert [run["status"] for run in load_lines(lines)] == ["ok", "failed"]
    source = load_source(str(tmp_path))
    assert (source.kind, len(source.runs), source.torn) == ("sweep folder", 2, 1)
    assert source.runs[1][0].endswith("results.jsonl:3")


def test_a_sweeps_line_of_another_schema_is_refused_naming_its_line(tmp_path):
    lines = tmp_path / "results.jsonl"
    append_line(lines, load_file(EARLIER))
    append_line(lines, {**load_file(EARLIER), "schema": "ps_bench.result/9"})
    with pytest.raises(ConfigError, match=r"results\.jsonl' line 2 has schema 'ps_bench.result/9'"):
        load_lines(lines)


def test_a_folder_skips_its_files_that_are_not_results(tmp_path):
    (tmp_path / "run.json").write_text(EARLIER.read_text())
    (tmp_path / "notes.json").write_text("{}")
    source = load_source(str(tmp_path))
    assert (source.kind, len(source.runs), source.skipped) == ("folder of results files", 1, ["notes.json"])
