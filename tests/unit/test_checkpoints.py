"""Checkpoints and failures without processes: the checkpoint folder's rules (the newest complete
checkpoint, another run's refused, a finished run's started over), the options' refusals, the
faults' schedule, and the ``recovery`` block a run's books make (``processes.attempts``,
``results.recovery``) over a real store."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ps_bench.cli import main
from ps_bench.config import ConfigError, RunConfig
from ps_bench.job import validate
from ps_bench.processes.attempts import Attempts, RecoveryBooks
from ps_bench.results.recovery import failure_entry, failures_in, goodput
from ps_bench.runtime import checkpoints
from ps_bench.runtime.faults import parse_faults


def config(tmp_path: Path, **options) -> RunConfig:
    """A run's options, resolved as validation resolves them (what its checkpoints record)."""
    cfg = RunConfig(hook="allreduce", nserver=0, ntrainer=3, checkpoint_every=10,
                    checkpoint_dir=str(tmp_path / "ck"), **options)
    validate(cfg)
    return cfg


def complete(cfg: RunConfig, iteration: int) -> Path:
    step = checkpoints.step_folder(cfg.checkpoint_dir, iteration)
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"x")
    checkpoints.commit(step, cfg, iteration, {"trainers": cfg.num_trainers})
    return step


def test_a_run_resumes_from_its_newest_complete_checkpoint_never_a_half_written_one(tmp_path):
    cfg = config(tmp_path)
    assert validate(config(tmp_path)).checkpoints.resume is None  # nothing there yet
    complete(cfg, 10)
    complete(cfg, 20)
    checkpoints.step_folder(cfg.checkpoint_dir, 30).mkdir()  # being written when the run stopped
    plan = validate(config(tmp_path)).checkpoints
    assert plan.resume["iteration"] == 20 and plan.resume["path"].endswith("step-00000020")
    assert (plan.every, plan.asynchronous, plan.start_over) == (10, False, False)
    # committing 40 keeps the newest two complete ones and drops the half-written 30
    complete(cfg, 40)
    assert [p.name for p in checkpoints.steps(cfg.checkpoint_dir)] == ["step-00000020", "step-00000040"]


def test_a_finished_runs_folder_is_started_over_and_another_runs_is_refused(tmp_path):
    cfg = config(tmp_path)
    complete(cfg, 120)
    checkpoints.mark_finished(cfg.checkpoint_dir, 126)
    plan = validate(config(tmp_path)).checkpoints
    assert plan.start_over and plan.resume is None
    checkpoints.start_over(plan.folder)
    assert checkpoints.steps(plan.folder) == [] and not checkpoints.finished(plan.folder)
    complete(cfg, 10)
    another = RunConfig(**{**config(tmp_path).to_dict(), "model": "DummyModelMedium", "ntrainer": 2})
    with pytest.raises(ConfigError, match=r"holds a checkpoint of another run \(--model "
                                          r"\"DummyModelSmall\" there, \"DummyModelMedium\" here; "
                                          r"--ntrainer 3 there, 2 here\)"):
        validate(another)


def test_the_default_folder_follows_the_training_options_alone(tmp_path):
    base = RunConfig(hook="allreduce", nserver=0, checkpoint_every=5)
    same = RunConfig(hook="allreduce", nserver=0, checkpoint_every=5, out="elsewhere.json",
                     inject_fault="trainer:1:25:exit:first", limits=True)
    other = RunConfig(hook="allreduce", nserver=0, checkpoint_every=5, lr=0.1)
    assert checkpoints.default_folder(base) == checkpoints.default_folder(same)
    assert checkpoints.default_folder(base) != checkpoints.default_folder(other)
    assert checkpoints.default_folder(base).startswith("checkpoints/allreduce-2t-")


@pytest.mark.parametrize("argv, words", [
    (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1 (iterations); got 0"),
    (["--checkpoint-dir", "ck"], "--checkpoint-dir and --checkpoint-async go with --checkpoint-every N"),
    (["--checkpoint-every", "5", "--checkpoint-dir", "/proc/ck"], "--checkpoint-dir '/proc/ck' is not writable"),
    (["--checkpoint-every", "5", "--hook", "diloco"],
     "--checkpoint-every with --hook diloco: its replicas differ between synchronisations"),
    (["--checkpoint-every", "5", "--staleness", "2"], "the parameter servers own the parameters"),
    (["--checkpoint-every", "5", "--hook", "torchft_diloco"], "heal from a live peer"),
    (["--hook", "torchft_diloco", "--inject-fault", "trainer:1:5:hang"],
     "a hung trainer is noticed by nothing"),
    (["--hook", "torchft_local_sgd", "--mtbf", "30s", "--target-loss", "1"],
     "--hook torchft_local_sgd under failures with --target-loss: it waits on every trainer"),
    (["--inject-fault", "trainer:0:3:exit,server:4:2:exit"], "--inject-fault: there is no server 4"),
    (["--inject-fault", "trainer:1:3:cut=1s"], "--inject-fault: a link cut is of an emulated host's link"),
    (["--inject-fault", "server:0:3:cut=1s"], "a link cut is a trainer's (its host's link); got 'server'"),
    (["--inject-fault", "trainer:1:3:cut=soon"], "a cut's DURATION must be a positive number with a unit"),
    (["--trainer-timeout", "60"], "--trainer-timeout must be positive and shorter than "
                                  "--rpc-timeout (60 s)"),
    (["--trainer-timeout", "0"], "--trainer-timeout must be positive"),
    (["--trainer-timeout", "2", "--hook", "allreduce"], "--hook allreduce does not send every "
                                                        "gradient to servers that average"),
    (["--trainer-timeout", "2", "--limits"], "--trainer-timeout with --limits: it waits on every "
                                             "trainer together"),
    (["--trainer-timeout", "2", "--mapping", "group", "--nserver", "2", "--ntrainer", "4"],
     "--trainer-timeout with --mapping group"),
    (["--server-replicas", "1", "--nserver", "1"], "--server-replicas 1 keeps each server's "
                                                   "buckets on another server: give --nserver 2 "
                                                   "or more (this run has 1)"),
    (["--server-replicas", "2", "--nserver", "3"], "--server-replicas must be 0 or 1"),
    (["--server-replicas", "1", "--nserver", "2", "--hook", "ps_node", "--ntrainer", "4",
      "--per-host", "2"],
     "--hook ps_node does not (use ps, ps_fp16 or ps_bf16)"),
])
def test_bad_checkpoint_and_fault_options_are_one_line_exit_2(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and words in captured.err, captured.err


def test_several_faults_are_separated_by_commas():
    faults = parse_faults("trainer:1:25:exit:first, server:0:30:hang")
    assert [(f.role, f.index, f.iteration, f.kind, f.first_attempt_only) for f in faults] == [
        ("trainer", 1, 25, "exit", True), ("server", 0, 30, "hang", False)]
    assert parse_faults(None) == parse_faults("") == ()


def test_a_failure_costs_the_iterations_since_the_checkpoint_and_the_time_to_the_next_step():
    failure = {"attempt": 0, "role": "trainer", "rank": 1, "host": "h", "time": 100.0,
               "iteration": 24, "failure": "trainer 1 failed"}
    entry = failure_entry(failure, 20, restarted_at=104.0, ready_at=108.5)
    assert (entry["iterations_done"], entry["resumed_from"], entry["iterations_redone"]) == (24, 20, 4)
    assert (entry["restart_s"], entry["recovery_s"]) == (4.0, 8.5)
    attempts = [{"iterations_run": 24}, {"iterations_run": 106}]
    assert goodput(attempts, 126, 48, 20.0, 3000.0) == {
        "committed_iterations": 126, "committed_samples": 6048, "iterations_run": 130,
        "step_efficiency": 126 / 130, "wall_s": 20.0, "samples_per_s": 6048 / 20.0,
        "failure_free_samples_per_s": 3000.0}


def round_of(iterations: int, saves: list[dict], restore_s=None) -> dict:
    return {"iterations": iterations, "samples": {"batch": [500.0]},
            "samples_processed": iterations * 16,
            "checkpoints": {"saves": saves, "restore_s": restore_s}}


def test_the_books_of_a_restarted_attempt_hold_every_attempt_and_its_failure(tmp_path):
    """Attempt 0 kept a round and failed at iteration 24; attempt 1 resumed from 20, restored in
    0.3 s, saved at 30 (the slowest trainer's hold counted) and ended at 63."""
    store = dist.HashStore()
    first = Attempts(store, 0)
    assert first.job_started(10.0) == 10.0
    first.begin(0, 11.0)
    first.keep({"rounds_completed": 1})
    cfg = config(tmp_path)
    complete(cfg, 20)
    plan = validate(config(tmp_path)).checkpoints
    second = Attempts(store, 1)
    failure = {"attempt": 0, "role": "trainer", "rank": 1, "host": "h", "time": 40.0,
               "iteration": 24, "failure": "trainer 1 failed"}
    books = RecoveryBooks(second, plan, [failure], 48, 3)
    assert books.resume_point(21) == (0, 20)
    books.begin(45.0)
    books.add([round_of(1, [], 0.25), round_of(1, [], 0.3)])
    books.add([round_of(42, [{"iteration": 30, "held_s": 0.1, "bytes": 3000}]),
               round_of(42, [{"iteration": 30, "held_s": 0.2, "bytes": None}])])
    block = books.block(launched_at=42.0, restarted_at=42.0, ended_at=60.0, failure_free=900.0)
    assert json.loads(json.dumps(block)) == block  # a results file holds it
    [lost] = block["failures"]
    assert (lost["iterations_redone"], lost["restart_s"], lost["recovery_s"]) == (4, 2.0, 5.0)
    assert [(a["attempt"], a["began_at_iteration"], a["ended_at_iteration"]) for a in block["attempts"]] == [
        (0, 0, 24), (1, 20, 63)]
    assert block["attempts"][0]["results"] == {"rounds_completed": 1}
    assert block["checkpoints"]["saves"] == 1 and block["checkpoints"]["save_s"] == 0.2
    assert block["checkpoints"]["restore_s"] == 0.3 and block["checkpoints"]["bytes"] == 3000
    # each of the 3 trainers wrote its 1000 bytes in the save's 0.2 s
    assert block["checkpoints"]["bytes_per_s_per_trainer"] == pytest.approx(5000.0)
    assert block["goodput"]["committed_iterations"] == 63 and block["goodput"]["wall_s"] == 50.0
    assert block["goodput"]["step_efficiency"] == 63 / (24 + 43)


def test_mtbf_draws_the_same_schedule_everywhere_at_exponential_gaps():
    from ps_bench.runtime.faults import Drawn, TimedFault, parse_duration

    assert [parse_duration(text) for text in ("250ms", "90s", "5min", "2h")] == [0.25, 90.0, 300.0, 7200.0]
    drawn = Drawn(60.0, ("trainer", "server"), seed=0)
    counts = {"trainer": 3, "server": 1, "master": 1}
    schedule = drawn.schedule(counts)
    assert schedule == Drawn(60.0, ("trainer", "server"), seed=0).schedule(counts)  # every rank alike
    assert schedule != Drawn(60.0, ("trainer", "server"), seed=1).schedule(counts)
    gaps = [later[0] - earlier[0] for earlier, later in zip([(0.0,), *schedule], schedule)]
    assert 55 < sum(gaps) / len(gaps) < 65 and min(gaps) > 0  # mean 60 s over 10,000 draws
    victims = {(role, index) for _, role, index in schedule}
    assert victims == {("trainer", 0), ("trainer", 1), ("trainer", 2), ("server", 0)}
    # a rank's next failure is the first drawn for it after its attempt began
    role, index = schedule[3][1:]
    began = time.time() + 1e6  # a job that begins in the future: nothing is due yet
    after = began + schedule[2][0] + 0.5
    fault = TimedFault(drawn, counts, role, index, job_started=began, attempt_started=after)
    mine = [at for at, who, which in schedule if (who, which) == (role, index) and began + at >= after]
    assert fault.at == began + mine[0] and not fault.matches(role, index, 1)
    assert TimedFault(drawn, counts, role, index, job_started=time.time() - 1e9,
                      attempt_started=0.0).matches(role, index, 1)  # long due


def test_a_failure_drawn_while_the_job_restarts_begins_the_restart_again(tmp_path):
    """Daly's model: each failure drawn during a restart starts it over from that failure. The
    job failed at the schedule's failure i and was ready again after 0.4 s of restart; failure
    i + 1 came during the restart, i + 2 after the restart begun again: training waits until
    i + 1's time + 0.4 s, i + 1 is in the books, and a rank's armed failure passes over it."""
    from ps_bench.runtime.faults import Drawn, TimedFault, restart_struck

    assert restart_struck([5.0, 11.0, 12.0, 14.5, 30.0], 10.0, 13.0) == (17.5, [1, 2, 3])
    assert restart_struck([5.0, 30.0], 10.0, 13.0) == (13.0, [])
    drawn = Drawn(1.0, ("trainer",), seed=3)
    schedule = drawn.schedule({"trainer": 2})
    at = [each[0] for each in schedule]
    i = next(i for i in range(len(at) - 2)
             if 0.05 < at[i + 1] - at[i] < 0.3 and at[i + 2] - at[i + 1] > 0.6)
    store, failed_at = dist.HashStore(), time.time() - 0.45
    started = failed_at - at[i]
    Attempts(store, 0).job_started(started)
    failure = {"attempt": 0, "role": "trainer", "rank": 1, "host": "h", "time": failed_at,
               "iteration": 24, "failure": "trainer failed"}
    attempt = Attempts(store, 1)
    _, role, index = schedule[i + 1]
    rank = TimedFault(drawn, {"trainer": 2}, role, index, started, failed_at + 0.01,
                      attempt.released)
    assert rank.at == started + at[i + 1] and not rank.matches(role, index, 1)  # due, not said
    books = RecoveryBooks(attempt, validate(config(tmp_path)).checkpoints, [failure], 48, 3,
                          schedule)
    books.begin(failed_at + 0.4)
    began = started + at[i + 1] + 0.4
    assert time.time() >= began and attempt.released() == pytest.approx(began)
    assert not rank.matches(role, index, 1) and rank.at > began  # its next, after training began
    books.add([round_of(1, [], 0.25)])
    block = books.block(launched_at=failed_at + 0.1, restarted_at=failed_at + 0.1,
                        ended_at=time.time(), failure_free=900.0)
    assert [(each["index"], each["into_s"]) for each in block["restarts_struck"]] == [
        (index, round(at[i + 1], 3))]
    [lost] = block["failures"]
    assert lost["recovery_s"] == pytest.approx(0.4)
    assert lost["waited_s"] == pytest.approx(at[i + 1] - at[i], abs=1e-3)
    assert failures_in(block) == 2
    # the attempt after it reads the struck failure back from the store
    assert Attempts(store, 2).earlier()[1]["began"]["struck"] == block["restarts_struck"]


@pytest.mark.parametrize("argv, words", [
    (["--mtbf", "-1"], "--mtbf must be a positive number with a unit of ms, s, min or h"),
    (["--mtbf", "10"], "--mtbf must be a positive number with a unit"),
    (["--mtbf", "5s", "--fail-roles", "server", "--hook", "allreduce"], "--fail-roles server: this run has no server"),
    (["--fail-roles", "server"], "--fail-roles names the ranks --mtbf fails: give --mtbf"),
])
def test_bad_mtbf_options_are_one_line_exit_2(argv, words, capsys):
    assert main([*argv, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and words in captured.err, captured.err


def test_each_earlier_failure_keeps_what_the_attempt_after_it_measured(tmp_path):
    """Three failures: attempt 1 died starting up (it began no training), attempt 2 resumed from
    20 and measured its own recovery; the last attempt's books give each failure's, and count
    no iteration run for the attempt that began none."""
    store = dist.HashStore()
    Attempts(store, 0).begin(0, 1.0)
    two = Attempts(store, 2)
    two.begin(20, 30.0)
    two.keep({"recovery": {"failures": [{"restart_s": 3.0, "recovery_s": 6.5}]}})
    cfg = config(tmp_path)
    complete(cfg, 40)
    plan = validate(config(tmp_path)).checkpoints
    recovered = [{"attempt": 0, "time": 10.0, "iteration": 24, "failure": "trainer 1 failed"},
                 {"attempt": 1, "time": 20.0, "failure": "trainer 0 failed"},
                 {"attempt": 2, "time": 50.0, "iteration": 45, "failure": "trainer 2 failed"}]
    books = RecoveryBooks(Attempts(store, 3), plan, recovered, 48, 3)
    books.begin(58.0)
    books.add([round_of(23, []), round_of(23, []), round_of(23, [])])
    block = books.block(launched_at=55.0, restarted_at=54.0, ended_at=70.0, failure_free=900.0)
    assert [(a["began_at_iteration"], a["ended_at_iteration"], a["iterations_run"])
            for a in block["attempts"]] == [(0, 24, 24), (None, None, 0), (20, 45, 25), (40, 63, 23)]
    assert [(f["resumed_from"], f["restart_s"], f["recovery_s"]) for f in block["failures"]] == [
        (0, None, None), (20, 3.0, 6.5), (40, 4.0, 8.0)]
    assert block["goodput"]["step_efficiency"] == 63 / (24 + 0 + 25 + 23)


def test_an_attempt_keeps_its_own_rounds_not_the_earlier_attempts_it_holds():
    """Each attempt's kept snapshot holds the earlier attempts' rounds in its recovery block:
    kept whole, they would nest, every attempt doubling the store's."""
    store = dist.HashStore()
    results = {"rounds_completed": 2, "recovery": {"attempts": [
        {"attempt": 0, "results": {"rounds_completed": 1, "samples": [1] * 1000}},
        {"attempt": 1, "began_at_iteration": 20}]}}
    Attempts(store, 1).keep(results)
    [first, second] = Attempts(store, 2).earlier()
    assert first["kept"] is None
    assert second["kept"] == {"rounds_completed": 2, "recovery": {"attempts": [
        {"attempt": 0}, {"attempt": 1, "began_at_iteration": 20}]}}
    assert "results" in results["recovery"]["attempts"][0]  # the record's own is left whole
