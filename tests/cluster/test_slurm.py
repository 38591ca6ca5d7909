"""``bench.py slurm`` on a real SLURM: the script it writes runs, and scancel ends all of it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.benchrun import ROOT, communicate

QUICK = ("--warmup-rounds", "1", "--rounds", "2")


def bench_slurm(cluster, folder: Path, *args: str, timeout_s: float = 300) -> tuple[int, str]:
    """``python bench.py slurm ARGS`` run from ``folder`` (where sbatch writes the job's log)."""
    process = subprocess.Popen([sys.executable, str(ROOT / "bench.py"), "slurm", *args], cwd=folder,
                               env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    stdout, _, _ = communicate(process, timeout_s, f"bench.py slurm {' '.join(args)}")
    return process.returncode, stdout


def test_the_generated_script_runs_on_two_nodes(local_slurm, tmp_path):
    out = tmp_path / "results.json"
    code, output = bench_slurm(local_slurm, tmp_path, "--nodes", "2", "--submit", "-o", "job.sbatch", "--",
                               "--ntrainer", "2", "--nserver", "1", *QUICK, "--out", str(out))
    logs = list(tmp_path.glob("ps_bench-*.out"))
    job_log = logs[0].read_text() if logs else "(no job log)"
    assert code == 0, output + job_log
    assert '--node-rank "$SLURM_NODEID"' in (tmp_path / "job.sbatch").read_text()
    results = json.loads(out.read_text())
    assert results["status"] == "ok" and results["replicas"]["identical"] is True
    assert sorted(rank for host in results["env"]["hosts"] for rank in host["ranks"]) == [0, 1, 2, 3]
    assert "results: " in job_log  # the master's output reaches the job log %x-%j.out
    # what became of the job, and where its log is
    job_id = re.search(r"^Submitted batch job (\d+)$", output, re.MULTILINE).group(1)
    assert f"ps_bench: SLURM job {job_id} finished; its log: ps_bench-{job_id}.out" in output, output
    assert (tmp_path / f"ps_bench-{job_id}.out").exists()


def test_a_job_sbatch_refuses_is_said_not_submitted(local_slurm, tmp_path):
    """sbatch's status alone (1) read as a job that ran and failed."""
    code, output = bench_slurm(local_slurm, tmp_path, "--nodes", "2", "--partition", "nosuch", "--submit", "-o",
                               "job.sbatch", "--", "--ntrainer", "2", "--nserver", "1", *QUICK)
    assert code != 0, output
    assert output.splitlines()[-1] == ("ps_bench: error: sbatch did not submit the job (its error is above); "
                                       "the script is job.sbatch"), output


def job_processes(job_id: str) -> list[int]:
    """Live processes of a SLURM job: its steps' slurmstepd and everything carrying its id."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, waiting to be reaped
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ or cmdline.startswith(f"slurmstepd: [{job_id}.".encode()):
            found.append(int(proc.name))
    return found


def ranks_started(job_id: str) -> int:
    count = 0
    for pid in job_processes(job_id):
        try:
            if b"-u\0-m\0ps_bench" in Path(f"/proc/{pid}/cmdline").read_bytes():
                count += 1
        except FileNotFoundError:
            continue
    return count


def test_scancel_ends_every_process_of_the_job(local_slurm, tmp_path):
    code, output = bench_slurm(local_slurm, tmp_path, "--nodes", "2", "-o", "hang.sbatch", "--",
                               "--inject-fault", "trainer:0:3:hang", *QUICK)
    assert code == 0, output
    submitted = local_slurm.run("sbatch", "--parsable", "hang.sbatch", cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240  # both agents and all four ranks up: an event, not a guess
    while ranks_started(job_id) < 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ranks_started(job_id) == 4, local_slurm.run("squeue").stdout
    assert local_slurm.run("scancel", job_id).returncode == 0
    deadline = time.monotonic() + 120
    while job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert job_processes(job_id) == [], "processes of the cancelled job survived"



def test_sbatch_itself_reads_the_directives_and_refuses_the_times_bench_py_refuses(local_slurm, tmp_path, capsys):
    """``--time`` is checked against sbatch's forms before anything is written: sbatch, asked to
    only test the script (``--test-only``), takes exactly the times ``bench.py slurm`` takes, and
    a job name with a space reaches it quoted."""
    from ps_bench.cli import main
    from ps_bench.cluster.slurm import SLURM_TIME

    assert main(["slurm", "--nodes", "2", "--time", "5", "--job-name", "a job", "--", "--ntrainer", "2"]) == 0
    script = capsys.readouterr().out
    assert '#SBATCH --job-name="a job"\n' in script and "#SBATCH --time=5\n" in script
    for limit in ["30", "30:00", "1:30:00", "2-3", "2-3:30", "2-3:30:15", "UNLIMITED", "forever", "1:2:3:4",
                  "1-2-3", "1.5", " 30"]:
        (tmp_path / "job.sbatch").write_text(script.replace("#SBATCH --time=5\n", f"#SBATCH --time={limit}\n"))
        tested = local_slurm.run("sbatch", "--test-only", str(tmp_path / "job.sbatch"))
        assert (tested.returncode == 0) == bool(SLURM_TIME.fullmatch(limit)), (limit, tested.stderr)
        assert "Invalid directive" not in tested.stderr, tested.stderr
