"""The command line in-process: parsing, precedence and one-line errors (no processes start)."""

import pytest

from ps_bench.cli import build_parser, main


def parse(*argv):
    return vars(build_parser().parse_args(list(argv)))


def test_dash_and_underscore_spellings_and_aliases():
    assert parse("--batch-size", "4")["batch_size"] == 4
    assert parse("--batch_size=4")["batch_size"] == 4
    assert parse("--ddp_hook=rpc_hook")["hook"] == "rpc_hook"
    assert parse("--ddp-hook", "ps")["hook"] == "ps"
    assert parse("--per-rank")["per_rank"] is True


def test_only_given_options_are_set_so_json_can_fill_the_rest():
    assert parse() == {}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ntrainer", "two"], "argument --ntrainer: expected int, got 'two'"),
        (["--backend", "mpi"], "invalid choice: 'mpi'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--hook", "allredcue"], "did you mean 'allreduce'"),
        (["--backend", "nccl"], "CUDA is needed for --backend nccl"),
        (["--config", "/nonexistent.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        code = main(argv)
        raise SystemExit(code)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message in err
    assert "Traceback" not in err


def test_dry_run_prints_the_layout(capsys):
    assert main(["--dry-run", "--ntrainer", "3", "--nserver", "2", "--mapping", "group"]) == 0
    out = capsys.readouterr().out
    assert "6 processes: 3 trainers, 2 servers" in out
    assert "sends to server4" in out  # the third trainer is in the second group
    assert "group: trainer0, trainer1" in out


def test_profile_into_a_folder_that_cannot_be_made_is_one_line_and_exit_2(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["--profile", str(blocker / "traces"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile" in err and "cannot be created" in err, err


def test_profile_folder_is_not_made_by_a_dry_run(capsys, tmp_path):
    assert main(["--profile", str(tmp_path / "new" / "traces"), "--dry-run"]) == 0
    assert not (tmp_path / "new").exists()


def test_new_options_explain_themselves(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--limits" in out and "raw RPC round trips" in out
    assert "--profile DIR" in out and "ui.perfetto.dev" in out
    assert "--rpc-threads N" in out and "sized to the role" in out
