"""The command line in-process: parsing, precedence and one-line errors (no processes start)."""

import json
from pathlib import Path

import pytest

from ps_bench.cli import build_parser, main
from ps_bench.runfiles import build_config
from ps_bench.job import default_servers
from ps_bench.models import DATA
from ps_bench.models.dummy import DummyData
from ps_bench.options import REGISTRIES, parse_run_options
from ps_bench.results.files import results_path


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


BAD_INPUTS = [
    (["--ntrainer", "two"], "--ntrainer: expected a whole number"),
    (["--ntrainer", "0"], "at least one trainer"),
    (["--nserver", "-1"], "--nserver must be 0 or more"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--lr", "-0.1"], "--lr must be positive"),
    (["--lr", "inf"], "--lr must be positive and finite; got inf"),
    (["--bucket-cap-mb", "inf"], "--bucket-cap-mb must be positive and finite; got inf"),
    (["--weight-decay", "inf"], "--weight-decay must be 0 or more, finite; got inf"),
    (["--momentum", "1"], "--momentum must be in [0, 1); got 1.0"),
    (["--momentum", "-0.5"], "--momentum must be in [0, 1); got -0.5"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--backend", "mpi"], "invalid choice: 'mpi'"),
    (["--mapping", "ring"], "invalid choice: 'ring'"),
    (["--hook", "allredcue"], "did you mean 'allreduce'"),
    (["--server", "averge"], "did you mean 'average'"),
    (["--model", "DummyModelBig"], "entries: DummyModel"),
    (["--data-config-path", "missing.json"], "'missing.json' does not exist"),
    (["--config", "missing.json"], "run config 'missing.json' does not exist"),
    (["--config", "{bad_json}"], "not valid JSON: Expecting ',' delimiter at line 2 column 2"),
    # a folder that takes no file, though os.access says yes to root
    (["--out", "/proc/ps_bench.json"], "--out's folder '/proc' is not writable"),
    (["--out", "-"], "--out -: the results are a file (standard output carries the run's table)"),
    (["--out", "/dev/null"], "--out '/dev/null' is not a regular file: the results are written as a new file"),
    (["--config", "{twice}"], "': key 'ntrainer' is given twice in one object (2, then 4)"),
    (["--config", "{latin1}"], "not valid JSON: not UTF-8 text (byte 0xe8 at offset 14)"),
    (["--config", "{unknown_key}"], "unknown option 'trainers'; did you mean 'trainer'? valid options:"),
    (["--config", "{wrong_type}"], "'rounds' must be a whole number, got \"3\""),
    (["--master-port", "70000"], "--master-port must be in 1..65535"),
    (["--profile", " "], "--profile: give the folder for the traces"),  # wrote the traces into the working folder
    (["--backend", "nccl"], "CUDA is needed for --backend nccl"),
    (["--ncudaserver", "1"], "CUDA is needed for --ncudaserver 1"),
    (["--mapping", "group", "--nserver", "3"], "3 servers need 3 trainers; got 2"),
    (["--hook", "ps", "--nserver", "0"], "--hook ps sends gradients to parameter servers"),
    (["--batch-size", "1000"], "fewer than --batch-size 1000"),
    (["--inject-fault", "trainer:9:1:exit"], "there is no trainer 9"),
    (["--inject-fault", "trainer:1:hang"], "expected ROLE:INDEX:ITER:KIND"),
    (["--inject-fault", "trainer:1:1:explode"], "kind must be one of exit, raise, hang"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["--ntrainers", "2"], "unrecognized arguments: --ntrainers 2; did you mean '--ntrainer'?"),
    (["--hooks=ps"], "unrecognized arguments: --hooks=ps; did you mean '--hook'?"),
    (["report", "out", "--bseline", "hook=ps"],
     "unrecognized arguments: --bseline hook=ps; did you mean '--baseline'?"),
    (["configs/runs/upstream_ps.json"], "a run file goes after --config: bench.py --config "
                                        "configs/runs/upstream_ps.json; a sweep file after sweep"),
    (["--create_criterion=mse"], "invalid choice: 'mse' (choose from 'cel')"),
    (["--trainer_config_path=trainer.json"], "--trainer_config_path: ps_bench has no trainer configuration file"),
    (["--model", "dlrm_small", "--data", "DummyDataSmall"], "--model dlrm_small takes dense features"),
    (["--target-loss", "-0.5"], "--target-loss must be a positive number; got -0.5"),
    (["--target-loss", "0"], "--target-loss must be a positive number; got 0.0"),
    (["--target-loss", "low"], "--target-loss/--target_loss: expected a number, got 'low'"),
    (["--target-loss", "inf"], "--target-loss must be a positive number; got inf"),
    (["--data", "PlainBags", "--data-config-path", "{plain_data}", "--target-loss", "1"],
     "--target-loss needs learnable data, but --data PlainBags (PlainBags) has no teacher to label it; data classes "
     "with one: DummyData, SyntheticClicks, SyntheticImages, SyntheticTokens"),
    (["--data", "PlainBags", "--data-config-path", "{plain_data}", "--labels", "teacher"],
     "--labels teacher, but --data PlainBags (PlainBags) has no teacher"),
    (["--labels", "random", "--target-loss", "0.2"], "random labels cannot be learned"),
    (["--labels", "learned"], "invalid choice: 'learned'"),
    (["--max-iterations", "50"], "--max-iterations bounds a --target-loss run"),
    (["--target-loss", "0.2", "--max-iterations", "0"], "--max-iterations must be at least 1; got 0"),
    (["--config", "{negative_target}"], "--target-loss must be a positive number; got -1.0"),
    (["--staleness", "-1"], "--staleness must be an integer of 0 or more, or inf; got -1"),
    (["--staleness", "2", "--hook", "allreduce"], "--staleness 2 trains with servers that own the parameters"),
    (["--staleness", "2", "--hook", "fp16"], "it needs --hook ps (got --hook fp16)"),
    (["--staleness", "1", "--limits"], "it cannot be combined with --limits"),
    (["--straggler", "trainer:2:30ms"], "--straggler trainer:2:30ms: there is no trainer 2; this run has 2"),
    (["--straggler", "trainer:1:-30ms"], "--straggler trainer:1:-30ms: DELAY must be 0 or more"),
    (["--server", "ssp"], "--server ssp is the mode of --staleness S: set --staleness"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1; got 0"),
    (["--grad-accum", "many"], "--grad-accum/--grad_accum: expected a whole number, got 'many'"),
    (["--grad-accum", "64"], "fewer than --batch-size 16 x --grad-accum 64"),
    (["--precision", "fp16"], "--precision fp16 needs the trainers on GPUs"),
    # a negative value with an exponent or a unit reaches the option's own check (argparse took
    # it for a flag: "argument --lr: expected one argument")
    (["--lr", "-1e-3"], "--lr must be positive; got -0.001"),
    (["--emulate-link", "1gbit", "--emulate-delay", "-5ms"], "--delay (--emulate-delay) must be 0 or more; got '-5ms'"),
    (["--emulate-link", "-1gbit"], "--link (--emulate-link) must be at least 1kbit; got '-1gbit'"),
    # counts and their verbs agree, one or many (they said "2 trainer(s) compute")
    (["--precision", "fp16", "--ntrainer", "1"], "1 trainer computes on the CPU here"),
    (["--ntrainer", "1", "--batch-size", "2000"], "has 1024 samples: 1 trainer gets 1024 each, fewer than"),
    (["--precision", "fp16", "--ntrainer", "3"], "3 trainers compute on the CPU here"),
    (["--inject-fault", "server:1:1:exit"], "there is no server 1; this run has 1 server, numbered from 0"),
    (["--emulate-keep"], "--emulate-keep shapes an emulated network: set --emulate-link too"),
    (["--emulate-keep", "--emulate-hosts", "2"], "--emulate-hosts, --emulate-keep shape an emulated network"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--hook", "allreduce", "--nserver", "0", "--reduce-dtype", "bf16"],
     "--reduce-dtype is for strategies whose engine communicates in a dtype of its own"),
    (["--hook", "ps", "--reduce-dtype", "fp16"], "--hook ps sends the gradients as they are"),
    # "" named the working folder: --ds-config "" ran without one, --out "" wrote under results/
    (["--config", "{empty_path}"], "'ds_config' is an empty path: name one, or leave the option out"),
    *[(argv, f"argument {named}: an empty path") for argv, named in [
        (["--out", ""], "--out"), (["--hook", "deepspeed_zero2", "--ds-config", ""], "--ds-config"),
        (["--config", ""], "--config"), (["--model-config-path", ""], "--model-config-path"),
        (["--profile", ""], "--profile"), (["predict", ""], "RESULTS.json"),
        (["predict", "a.json", "--compare", ""], "--compare"), (["report", "a", ""], "DIR|FILE"),
        (["compare", "a", ""], "NEW"), (["sweep", "s.json", "--out", ""], "--out"),
        (["launch", "--hosts", "a", "--python", "", "--", "--dry-run"], "--python")]],
]
CONFIG_FILES = {
    "{bad_json}": '{"ntrainer": 2\n "rounds": 3}',
    "{latin1}": '{"model": "Modèle"}'.encode("latin-1"),
    "{twice}": '{"ntrainer": 2, "rounds": 1, "ntrainer": 4}',
    "{unknown_key}": '{"trainers": 2}',
    "{empty_path}": '{"hook": "deepspeed_zero2", "ds_config": ""}',
    "{wrong_type}": '{"rounds": "3"}',
    "{negative_target}": '{"target_loss": -1, "labels": "teacher"}',
    "{plain_data}": json.dumps({"PlainBags": {"data_class": "PlainBags", "configurations": {
        "max_val": 64, "sample_count": 1024, "sample_length": 16, "num_classes": 8}}}),
}


class PlainBags(DummyData):
    """A data class of a user's own with random labels only: it has no teacher."""

    teacher = None


@pytest.fixture
def data_class_without_teacher(monkeypatch):
    """Every shipped data class has a teacher; a user's own may not (registered for one test)."""
    monkeypatch.setitem(DATA._entries, "PlainBags", PlainBags)
    monkeypatch.setitem(DATA._canonical, "PlainBags", "PlainBags")


def run_main(argv: list[str]) -> int:
    """``main`` as ``bench.py`` runs it: argparse's own errors exit through SystemExit."""
    try:
        return main(argv)
    except SystemExit as exited:
        return exited.code


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys, data_class_without_teacher):
    argv = list(argv)
    for i, value in enumerate(argv):
        if value in CONFIG_FILES:
            path = tmp_path / "run.json"
            content = CONFIG_FILES[value]
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
            argv[i] = str(path)
    assert run_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err and message in captured.err, captured.err
    assert captured.out == ""


def test_debug_shows_the_traceback_for_bad_input(capsys):
    assert run_main(["--rounds", "0", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err


def test_dry_run_prints_the_layout(capsys):
    assert main(["--dry-run", "--ntrainer", "3", "--nserver", "2", "--mapping", "group"]) == 0
    out = capsys.readouterr().out
    assert "6 processes: 3 trainers, 2 servers" in out
    assert "sends to server4" in out  # the third trainer is in the second group
    assert "group: trainer0, trainer1" in out


@pytest.mark.parametrize("flag, name, words", [("--profile", "traces", "cannot be created"),
                                              ("--trace", "traces", "cannot be created"),
                                              ("--out", "r.json", "is not a folder")])
def test_an_output_under_a_file_is_one_line_and_exit_2(flag, name, words, capsys, tmp_path):
    """--profile's and --trace's folder, --out's file: under a path that is a file, refused before
    anything runs."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main([flag, str(blocker / name), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err and words in err, err


def test_servers_a_strategy_sends_nothing_to_are_shown_idle_and_said_so(capsys):
    """--hook allreduce --nserver 1 starts a server that hears nothing: the layout had shown it
    owning the bytes and the trainers sending it buckets."""
    assert main(["--dry-run", "--hook", "allreduce", "--nserver", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[3].split()[-1] == "-" and lines[5].endswith("idle: --hook allreduce sends it nothing")
    assert lines[-1] == ("ps_bench: note: --hook allreduce sends no gradient to parameter servers: the 1 server "
                         "asked for (--nserver 1, --ncudaserver 0) idles; leave both out to start none")
    for argv in (["--hook", "allreduce", "--nserver", "0"], ["--hook", "ps"], ["--hook", "ps_node", "--ntrainer", "4", "--per-host", "2"]):
        assert main(["--dry-run", *argv]) == 0
        assert "note" not in capsys.readouterr().out, argv


def test_a_job_without_servers_names_no_server_aggregation_or_mapping(capsys):
    """--hook allreduce starts no server: its first line had still said "server average, mapping
    shard", as if a server averaged and the buckets were mapped to one."""
    assert main(["--dry-run", "--hook", "allreduce"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == ("3 processes: 2 trainers, 0 servers, 1 master; "
                                                       "hook allreduce, backend gloo")
    assert main(["--dry-run", "--mapping", "group"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(
        "hook ps, server average, mapping group, backend gloo")


@pytest.mark.parametrize("argv, servers", [
    ([], 1), (["--hook", "ps_node", "--ntrainer", "4", "--per-host", "2"], 1),
    (["--hook", "allreduce"], 0), (["--hook", "allreduce_hook"], 0),  # upstream's name
    (["--hook", "fsdp"], 0), (["--hook", "local_sgd"], 0), (["--hook", "ps", "--nserver", "3"], 3),
])
def test_servers_left_out_are_what_the_strategy_sends_to(capsys, argv, servers):
    """--nserver left out starts one server for a strategy that sends gradients to servers and
    none for one that does not: it had started one for every hook, so all-reduce ran beside an
    idle server (its RPC polling a core's share) and --hook fsdp was refused without --nserver 0."""
    assert main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split(", ")[1] == f"{servers} server{'' if servers == 1 else 's'}", out
    assert "note" not in out


def test_cuda_servers_alone_replace_the_default_cpu_server():
    cfg = build_config(*parse_run_options(["--ncudaserver", "2"]))
    default_servers(cfg)
    assert (cfg.nserver, cfg.num_servers) == (0, 2)


def test_profile_folder_is_not_made_by_a_dry_run(capsys, tmp_path):
    assert main(["--profile", str(tmp_path / "new" / "traces"), "--dry-run"]) == 0
    assert not (tmp_path / "new").exists()


def test_out_naming_a_folder_puts_the_new_name_inside_it(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    inside = results_path(str(folder), "ps", 2, 1)
    assert inside.parent == folder and inside.name.endswith("-ps-2t1s.json")
    made_later = results_path(str(tmp_path / "later") + "/", "allreduce", 4, 0)
    assert made_later.parent == tmp_path / "later" and made_later.name.endswith("-allreduce-4t0s.json")
    assert results_path(str(tmp_path / "r.json"), "ps", 2, 1) == tmp_path / "r.json"
    assert results_path(None, "ps", 2, 1).parent == Path("results") == results_path("", "ps", 2, 1).parent


def test_new_options_explain_themselves(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--limits" in out and "raw RPC round trips" in out
    assert "--profile DIR" in out and "ui.perfetto.dev" in out
    assert "--rpc-threads N" in out and "sized to the role" in out


def test_help_describes_every_hook_server_and_trainer_in_whole_sentences():
    """Each registered piece's description in ``--help`` is a whole paragraph of its docstring,
    on lines of its own: it ends a sentence, never mid-clause."""
    help_text = build_parser().format_help()
    for kind, registry in REGISTRIES.items():
        entries = registry.describe().splitlines()
        assert [entry.split(":")[0] for entry in entries] == registry.names(), kind
        unfinished = [entry for entry in entries if not entry.rstrip(")").endswith(".")]
        assert unfinished == [], kind
        for name in registry.names():  # every entry's start is on a line of its own in --help
            assert any(line.strip().startswith(f"{name}: ") for line in help_text.splitlines()), name
    words = [line.split()[-1] for line in help_text.splitlines() if line.strip()]
    assert not [word for word in words if word.rstrip(";") in ("the", "and", "of", "a") and word.endswith(";")]


def test_a_master_addr_not_of_this_machine_is_one_line_naming_it(capsys):
    """192.0.2.1 (a documentation address) is on no interface here: the store cannot bind it."""
    assert main(["--master-addr", "192.0.2.1", "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert err == "ps_bench: error: cannot listen on --master-addr 192.0.2.1: Cannot assign requested address\n"


def test_version_names_ps_bench_torch_and_python(capsys):
    import platform

    import torch

    import ps_bench

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == (f"ps_bench {ps_bench.__version__} (torch {torch.__version__}, "
                                       f"Python {platform.python_version()})\n")


@pytest.mark.parametrize("word, hint", [("reprot", "did you mean 'report'? "), ("help", "")])
def test_an_unknown_command_is_named_with_the_commands(word, hint, capsys):
    """It was 'unrecognized arguments: reprot', as if it were a run's option."""
    assert main([word, "results/hooks"]) == 2
    assert capsys.readouterr().err == (
        f"bench.py: error: unknown command {word!r}; {hint}commands: run, sweep, report, compare, slurm, launch, "
        f"cloud, emulate, predict (a run's options start with --) (see --help)\n")
