"""Failures end the whole job, name the rank, keep what finished and leave no process behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ps_bench.cli import main
from ps_bench.processes.waiting import PROGRESS_FIRST_S
from tests.benchrun import (ROOT, communicate, descendants, is_loopback, listening_sockets, rank_pids, read_until,
                            run_bench, small_file_system, start_bench)

# Failures must end the job because the launcher sees them, never by an RPC timeout; and set-up
# calls on a busy machine can take tens of seconds: so a long one.
RPC_TIMEOUT = 300


def finish(process: subprocess.Popen, within_s: float) -> tuple[str, float]:
    """Waits for the launcher; returns its stderr and how long it took."""
    _, stderr, elapsed = communicate(process, within_s, "the job")
    return stderr, elapsed


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize("rank, who", [(1, "trainer 1 (rank 1, trainer1)"), (2, "server 0 (rank 2, server2)"),
                                       (3, "master 0 (rank 3, master)")])
def test_killed_worker_ends_the_job(rank, who, results_path):
    # an RPC timeout far longer than the budget below: the job must end because the launcher saw
    # the death, not because a peer's call timed out
    process = start_bench("--rounds", "100000", "--rpc-timeout", "600", "--out", str(results_path))
    read_until(process, "[round 3/")
    pids = rank_pids(process.pid)
    assert len(pids) == 4, pids
    os.kill(pids[rank], signal.SIGKILL)
    stderr, _ = finish(process, 120)
    assert process.returncode == 1
    assert last_line(stderr).startswith(f"ps_bench: error: {who} was killed by SIGKILL"), stderr
    results = json.loads(results_path.read_text())
    assert results["status"] == "failed" and "killed by SIGKILL" in results["error"]
    assert results["rounds_completed"] >= 2 and results["summary"]  # the finished rounds are kept


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_local_job_listens_on_loopback_only_and_dies_with_its_launcher(results_path, tmp_path):
    """The store, RPC and gloo of a job on one machine: nothing another host can reach. The ranks
    are the forkserver's children: a launcher killed by SIGKILL takes them with it all the same,
    and the next run on the machine writes its finished rounds where it would have (they had
    stayed in its run folder, one more in the temporary folder after each such run)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    process = start_bench("--rounds", "100000", "--out", str(results_path), env={"TMPDIR": str(temporary)})
    # rounds 2 and 3 timed, each kept before it is announced (the first two snapshots are never paced)
    read_until(process, "[round 3/")
    job = descendants(process.pid)  # the forkserver, its resource tracker, the ranks
    sockets = listening_sockets([process.pid, *job])
    assert len(rank_pids(process.pid)) == 4, job
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in job) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in job if alive(pid)], "processes of the job outlived its launcher"
    addresses = [address for found in sockets.values() for address in found]
    assert len(addresses) >= 5, sockets  # the store, and every rank's RPC listener at least
    assert all(is_loopback(address) for address in addresses), sockets
    assert not results_path.exists() and len(list(temporary.glob("ps_bench-*/partial.json"))) == 1
    following = run_bench("--rounds", "1", "--warmup-rounds", "0", out=tmp_path / "next.json",
                          env={"TMPDIR": str(temporary)}, timeout_s=120)
    assert following.returncode == 0, following.stderr
    assert "; 0 warmup and 1 timed round follow\n" in following.stdout  # one round, not "1 timed rounds"
    assert f"results (an earlier run on this machine, its launcher killed): {results_path}" in following.stdout
    killed = json.loads(results_path.read_text())
    assert killed["status"] == "failed" and "launcher was killed outright" in killed["error"]
    assert killed["rounds_completed"] >= 2 and killed["config"]["rounds"] == 100000
    assert not list(temporary.glob("ps_bench-*"))


def test_a_reader_that_leaves_ends_the_output_not_the_run(results_path):
    """``bench.py 2>&1 | head -1``: the reader leaves before the rounds; every process of the job
    goes on printing nothing, and the run ends ok, every round measured and in its file."""
    process = subprocess.Popen([sys.executable, str(ROOT / "bench.py"), "--rounds", "2", "--out", str(results_path)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    assert process.stdout.readline().startswith("ps_bench: 4 processes")
    process.stdout.close()
    finish(process, 180)
    results = json.loads(results_path.read_text())
    assert (process.returncode, results["status"], results.get("error")) == (0, "ok", None)
    assert results["rounds_completed"] == 2 and results["summary"]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_under_torchrun_a_job_completes_and_only_torchruns_own_store_listens_beyond_loopback(results_path):
    """A job torchrun starts on this host runs to its results; its ranks bind RPC and gloo to
    loopback, and torchrun's agent hosts its store on every interface (torch's own choice;
    docs/clusters.md, Security). One job for both: torchrun's start-up is most of each."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "bench.py",
               "--rounds", "20", "--out", str(results_path)]  # rounds of 0.2-0.4 s: time to list the sockets
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        first = read_until(process, "[round 2/")
        sockets = listening_sockets([process.pid, *descendants(process.pid)])
        stdout, stderr, _ = communicate(process, 180, "torchrun's job")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stdout + stderr
    # the job's line, once, from its master rank (no rank printed it under torchrun)
    assert [line for line in first if line.startswith("ps_bench: 4 processes")] == [
        "ps_bench: 4 processes (2 trainers, 1 server, 1 master), hook ps, server average, mapping shard, "
        "backend gloo\n"], first
    assert "results:" in stdout and json.loads(results_path.read_text())["status"] == "ok"
    ranks = {pid: found for pid, found in sockets.items() if pid != process.pid}
    assert sum(len(found) for found in ranks.values()) >= 4, sockets
    assert all(is_loopback(address) for found in ranks.values() for address in found), sockets


@pytest.mark.parametrize(
    "fault, message",
    [
        ("trainer:1:3:raise", "trainer 1 (rank 1, trainer1) failed: InjectedFault: injected fault: trainer 1 at iteration 3"),
        ("server:0:40:raise", "server 0 (rank 2, server2) failed: InjectedFault: injected fault: server 0 at iteration 40"),
        ("master:0:4:raise", "master 0 (rank 3, master) failed: InjectedFault: injected fault: master 0 at iteration 4"),
        ("trainer:0:5:exit", "trainer 0 (rank 0, trainer0) exited with status 3"),
        ("server:0:5:exit", "server 0 (rank 2, server2) exited with status 3"),
    ],
)
def test_injected_fault_is_named_with_its_cause(fault, message, results_path, bench_runs):
    """Each role's failure, raised or exited, named in the results' error; bench.py's own last
    line says it for a trainer's raise and a server's exit (the other three run through the
    shared launcher, which the last line's wording does not depend on)."""
    args = ("--inject-fault", fault, "--rpc-timeout", str(RPC_TIMEOUT))
    if fault in ("trainer:1:3:raise", "server:0:5:exit"):
        run = run_bench(*args, out=results_path, timeout_s=240)
        assert last_line(run.stderr).startswith(f"ps_bench: error: {message}"), run.stderr
    else:
        run = bench_runs.shared(*args, timeout_s=240)
    assert run.returncode == 1
    if fault.endswith("raise"):  # the rank's traceback, where it was raised
        assert "Traceback (most recent call last)" in run.output and "faults.py" in run.output
    results = run.results
    assert results["status"] == "failed" and message in results["error"]
    if fault == "master:0:4:raise":  # rounds 2 and 3 were timed and finished
        assert results["rounds_completed"] == 2
        assert {row["metric"] for row in results["summary"]} >= {"batch", "round"}


@pytest.fixture(scope="module")
def startup_s(bench_runs) -> float:
    """How long a default job takes to get every rank ready on this machine, now (it varies
    with the load): budgets that must outlast start-up are derived from it."""
    run = bench_runs.get()  # the default run, shared
    assert run.returncode == 0, run.output
    return ready_after(run.stdout)


def ready_after(stdout: str) -> float:
    match = re.search(r"^ps_bench: ready after ([0-9.]+) s", stdout, re.MULTILINE)
    assert match, stdout
    return float(match.group(1))


RANKS = ("trainer 0 (rank 0, trainer0)", "trainer 1 (rank 1, trainer1)", "server 0 (rank 2, server2)",
         "master 0 (rank 3, master)")


def stack_reports(stderr: str) -> dict[str, str]:
    """Each rank's entry in a --timeout report: 'stacks', or the reason it gave none."""
    reports = {}
    for who in RANKS:
        has_stacks = f"---- Python stacks of {who} ----" in stderr
        reason = re.search(rf"^---- no Python stacks from {re.escape(who)}: (.+)$", stderr, re.MULTILINE)
        assert has_stacks != bool(reason), f"{who} needs exactly one entry:\n{stderr}"
        reports[who] = "stacks" if has_stacks else reason.group(1)
    return reports


def test_hang_with_timeout_dumps_stacks_and_ends(results_path, startup_s):
    """A hung trainer: the master's progress line says where the round stopped while the job
    waits, then the watchdog ends it with every rank's stacks."""
    # long enough that every rank is up, trainer 1 is hanging and the round has run for
    # PROGRESS_FIRST_S when the watchdog fires, however busy the machine is while this runs
    timeout = round(2 * startup_s + PROGRESS_FIRST_S) + 3
    # the peers of the hung trainer wait in RPC calls: those must not time out before the watchdog
    run = run_bench("--inject-fault", "trainer:1:3:hang", "--timeout", str(timeout), "--rpc-timeout",
                    str(3 * timeout), out=results_path, timeout_s=timeout + 120)
    assert run.returncode == 1
    assert run.elapsed_s > timeout
    assert ready_after(run.stdout) < timeout, "start-up outlasted the budget derived from it"
    # the round's first warmup iterations ran; trainer 1 stopped in its third, the others wait there
    assert re.search(r"^\[round 1/\d+\] warmup +\d+ s so far: trainers at iteration 3 of 32, about \d+ s left$",
                     run.stdout, re.MULTILINE), run.stdout
    assert last_line(run.stderr) == (f"ps_bench: error: the job did not finish within --timeout {timeout} s; "
                                     f"every rank's Python stacks are above")
    assert set(stack_reports(run.stderr).values()) == {"stacks"}
    hung = run.stderr.split("---- Python stacks of trainer 1")[1].split("---- Python stacks of")[0]
    assert "faults.py" in hung and "run_round" in hung  # the stack shows where it hangs
    assert run.results["status"] == "failed"


def test_timeout_shorter_than_startup_says_what_each_rank_could_give(results_path):
    """The watchdog fires while ranks are still starting: the report names, for each rank,
    its stacks or why it has none, and the last line counts exactly those."""
    run = run_bench("--inject-fault", "trainer:1:3:hang", "--timeout", "3", out=results_path, timeout_s=180)
    assert run.returncode == 1
    reports = stack_reports(run.stderr)
    given = sum(report == "stacks" for report in reports.values())
    expected = {4: "every rank's Python stacks are above",
                0: "no rank could give its Python stacks; a line above says why for each"}.get(
        given, f"the Python stacks of {given} of 4 ranks are above; a line says why each of the others has none")
    assert last_line(run.stderr) == f"ps_bench: error: the job did not finish within --timeout 3 s; {expected}"
    for report in reports.values():
        assert report == "stacks" or report.startswith(("it was still starting", "it had already ended",
                                                        "it was asked but wrote none", "it ended as it was asked"))
    assert run.results["status"] == "failed"


def test_a_finished_run_whose_disk_filled_keeps_its_results_in_the_temporary_folder(tmp_path):
    """--out's folder is checked before the run; should its disk fill (or a quota run out) by the
    time the results are written, the finished run's results, status ok, go to ps_bench/ in the
    temporary folder, and a warning says why (a file system of 8 KiB stands in for the disk)."""
    with small_file_system(tmp_path / "full", "8k") as full:
        run = run_bench("--rounds", "1", out=full / "r.json", timeout_s=180)
    assert run.returncode == 0, run.output
    assert (f"ps_bench: warning: the results could not be written to {full / 'r.json'}: "
            f"No space left on device") in run.stderr
    kept = Path(re.search(r"^results: (.+)$", run.stdout, re.MULTILINE).group(1))
    try:
        assert kept.parent == Path(tempfile.gettempdir()) / "ps_bench"
        assert run.results["status"] == "ok" and run.results["rounds_completed"] == 1
    finally:
        kept.unlink()


def test_a_file_a_command_was_asked_for_on_a_full_disk_is_one_line_naming_its_option(tmp_path, capsys):
    """A report's CSV and plot, a comparison, predictions, a SLURM script, a SkyPilot task: each
    checked before the command's work, written after it, when the disk may have filled (a file
    system of one page, filled, stands in): one line naming the option, exit 2, no traceback."""
    results = str(ROOT / "tests" / "fixtures" / "ps-2t1s-32d8e0b.json")  # a results file of 2 trainers
    with small_file_system(tmp_path / "full", "4k") as full:
        (full / "filler").write_bytes(bytes(4096))
        commands = [("--csv", ["report", results, "--csv"]), ("--plot", ["report", results, "--plot"]),
                    ("--json", ["compare", results, results, "--json"]),
                    ("--out", ["predict", results, "--nodes", "1,2", "--link", "1gbit", "--out"]),
                    ("--plot", ["predict", results, "--nodes", "1,2", "--link", "1gbit", "--plot"]),
                    ("-o", ["slurm", "--nodes", "2", "-o"]), ("-o", ["cloud", "--nodes", "2", "-o"])]
        for number, (flag, argv) in enumerate(commands):
            path = full / f"{number}.{'png' if flag == '--plot' else 'out'}"
            code = main([*argv, str(path), *(["--", "--ntrainer", "2"] if argv[0] in ("slurm", "cloud") else [])])
            lines = capsys.readouterr().err.strip().splitlines()
            assert (code, lines[-1]) == (2, f"ps_bench: error: {flag} {path}: No space left on device"), argv
            assert not any("Traceback" in line for line in lines), argv


@pytest.mark.parametrize("signum, code, word", [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")])
def test_signal_stops_everything_and_keeps_finished_rounds(signum, code, word, results_path):
    process = start_bench("--rounds", "100000", "--out", str(results_path))
    announced = read_until(process, "[round 4/")
    process.send_signal(signum)
    stderr, _ = finish(process, 60)
    assert process.returncode == code
    assert word in last_line(stderr)
    results = json.loads(results_path.read_text())
    assert results["status"] == "failed" and word in results["error"]
    # every round announced as finished is kept, the snapshots paced out between them too
    finished = [line for line in announced if re.match(r"\[round \d+/\d+\] timed +[\d.]+ s ", line)]
    assert len(finished) >= 3
    assert results["rounds_completed"] >= len(finished)


def test_master_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = run_bench("--master-port", str(port), timeout_s=120)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1
    assert f"port {port}: it is already in use" in run.stderr


def test_concurrent_runs_pick_different_free_ports(tmp_path):
    processes = [start_bench("--rounds", "1", "--out", str(tmp_path / f"{i}.json")) for i in range(2)]
    for process in processes:
        finish(process, 120)
        assert process.returncode == 0
    assert (tmp_path / "0.json").exists() and (tmp_path / "1.json").exists()


# The real binary on a few bad inputs, one of each kind (the whole table runs in-process in
# tests/unit/test_cli.py): a bad flag, a bad option value, a bad run file.
BAD_INPUTS = [
    (["--ntrainer", "two"], "--ntrainer: expected a whole number"),
    (["--hook", "allredcue"], "did you mean 'allreduce'"),
    (["--config", "{bad_json}"], "not valid JSON: Expecting ',' delimiter at line 2 column 2"),
]
CONFIG_FILES = {"{bad_json}": '{"ntrainer": 2\n "rounds": 3}'}


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line(argv, message, tmp_path):
    argv = list(argv)
    for i, value in enumerate(argv):
        if value in CONFIG_FILES:
            path = tmp_path / "run.json"
            path.write_text(CONFIG_FILES[value])
            argv[i] = str(path)
    run = run_bench(*argv, timeout_s=120)
    assert run.returncode == 2, run.output
    assert run.stderr.count("\n") == 1, run.stderr
    assert "Traceback" not in run.output
    assert message in run.stderr, run.stderr
    assert run.stdout == ""
