"""What the cluster subcommands write: the torchrun line, the sbatch script, their checks (no processes)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from ps_bench.cli import main
from ps_bench.cluster.slurm import SlurmJob, sbatch_script
from ps_bench.cluster.torchrun import NodeLayout, layout_for, torchrun_command, trainers_per_node
from ps_bench.config import ConfigError, RunConfig
from ps_bench.runtime.faults import Fault


def test_a_fault_can_be_limited_to_the_first_attempt(monkeypatch):
    fault = Fault.parse("trainer:1:5:exit:first")
    assert fault.first_attempt_only and fault.kind == "exit"
    assert fault.matches("trainer", 1, 5)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not fault.matches("trainer", 1, 5)
    assert Fault.parse("trainer:1:5:exit").matches("trainer", 1, 5)  # without :first, every attempt
    with pytest.raises(ValueError, match="5th field must be 'first'"):
        Fault.parse("trainer:1:5:exit:always")


def test_the_world_is_split_evenly_or_refused_with_the_fix():
    assert layout_for(RunConfig(ntrainer=6, nserver=1), 2) == NodeLayout(2, 4)
    with pytest.raises(ConfigError, match=r"--nodes 3 does not divide .* 5 processes .*--ntrainer 4.* --nodes among 1, 5"):
        layout_for(RunConfig(ntrainer=3, nserver=1), 3)
    assert trainers_per_node(RunConfig(ntrainer=6, nserver=1), NodeLayout(2, 4)) == 4


def test_torchrun_line_quotes_bench_options_and_keeps_shell_words():
    line = torchrun_command(NodeLayout(2, 4), '"$SLURM_NODEID"', "head", ["--out", "a b.json"], port=29600,
                            python="/opt/py/bin/python")
    words = shlex.split(line)
    assert words[:3] == ["/opt/py/bin/python", "-m", "torch.distributed.run"]
    assert words[words.index("--rdzv-backend") + 1] == "static"
    assert words[words.index("--node-rank") + 1] == "$SLURM_NODEID"  # expanded where the line runs
    assert words[words.index("--master-port") + 1] == "29600"
    assert words[-4:] == ["-m", "ps_bench", "--out", "a b.json"]


def test_sbatch_script_expands_the_node_rank_in_each_task():
    job = SlurmJob(NodeLayout(2, 4), ["--ntrainer", "6", "--iface", "eth1"], gpus_per_node=4, partition="gpu",
                   time="00:10:00", iface="eth1", python="/usr/bin/python3")
    script = sbatch_script(job)
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--partition=gpu",
                      "--time=00:10:00", "--output=%x-%j.out", "--job-name=ps_bench"):
        assert f"#SBATCH {directive}\n" in script
    assert "export TP_SOCKET_IFNAME=eth1 GLOO_SOCKET_IFNAME=eth1" in script
    [srun] = [line for line in script.splitlines() if line.startswith("srun ")]
    words = shlex.split(srun)  # as the batch shell parses it: the task's command is one word, unexpanded
    assert words[-3:-1] == ["bash", "-c"]
    assert '--node-rank "$SLURM_NODEID"' in words[-1] and '--master-addr "$PS_BENCH_HEAD"' in words[-1]
    assert "--nproc-per-node 4" in words[-1] and words[-1].startswith("exec /usr/bin/python3 -m torch.distributed.run")


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "3", "--", "--ntrainer", "3"], "--nodes 3 does not divide"),
    (["--nodes", "2", "--", "--hook", "allredcue"], "did you mean 'allreduce'"),
    (["--nodes", "2", "--", "--backend", "nccl"], "set --gpus-per-node"),
    (["--nodes", "2", "--port", "70000", "--"], "--port must be in 1..65535"),
    (["--", "--ntrainer", "2"], "the following arguments are required: --nodes"),
    (["--nodes", "2", "--", "--ntrainer", "-1"], "--ntrainer must be 0 or more; got -1"),
    (["--nodes", "2", "--time", "forever", "--"], "--time 'forever': sbatch takes minutes, minutes:seconds, "),
    (["--nodes", "2", "--time", "1:2:3:4", "--"], "--time '1:2:3:4': sbatch takes"),
    (["--nodes", "2", "--job-name", "a\nb", "--"], "--job-name 'a\\nb': the script's #SBATCH line cannot carry it"),
    (["--nodes", "2", "--partition", "", "--"], "--partition '': the script's #SBATCH line cannot carry it"),
])
def test_slurm_refuses_bad_input_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(["slurm", *argv]))
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and captured.out == ""


def test_slurm_prints_the_script_for_valid_options(capsys):
    assert main(["slurm", "--nodes", "2", "--", "--ntrainer", "2", "--nserver", "1"]) == 0
    script = capsys.readouterr().out
    assert script.startswith("#!/bin/bash\n") and "2 nodes x 2 processes = 4 ranks" in script
    assert main(["slurm", "--nodes", "1", "--", "--ntrainer", "2", "--nserver", "1"]) == 0
    assert "# bench.py slurm: 1 node x 4 processes = 4 ranks" in capsys.readouterr().out  # not "1 nodes"


EXAMPLES = Path(__file__).resolve().parents[2] / "scripts" / "slurm"


def test_the_worked_slurm_examples_match_what_the_command_writes(tmp_path, capsys):
    """scripts/slurm/*.sbatch are regenerated by make_examples.sh; they must not drift."""
    commands = EXAMPLES.joinpath("make_examples.sh").read_text().replace("\\\n", " ").splitlines()
    for line in (line for line in commands if line.startswith("python bench.py slurm")):
        argv = shlex.split(line)[2:]
        at = argv.index("-o")
        example = EXAMPLES.parent.parent / argv[at + 1]
        argv[at + 1] = str(tmp_path / example.name)
        assert main(argv) == 0
        assert (tmp_path / example.name).read_text() == example.read_text(), example.name


def test_hostfile_takes_deepspeed_lines_and_comments(tmp_path):
    from ps_bench.cluster.hosts import check_targets, read_hostfile
    from ps_bench.cluster.ssh import Target

    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the head first\nalice@node1 slots=2\n\nnode2   # second\n")
    assert read_hostfile(str(hostfile)) == [Target("alice@node1", 2), Target("node2")]
    check_targets(read_hostfile(str(hostfile)), NodeLayout(2, 2))
    with pytest.raises(ConfigError, match="slots=2, but this job runs 4 processes"):
        check_targets(read_hostfile(str(hostfile)), NodeLayout(2, 4))
    hostfile.write_text("node1 gpus=4\n")
    with pytest.raises(ConfigError, match=r"hosts:1: expected '\[user@\]host \[slots=N\]'"):
        read_hostfile(str(hostfile))
    hostfile.write_bytes("nœud1\n".encode("cp1252"))
    with pytest.raises(ConfigError, match=r"^--hostfile '.*hosts' is not UTF-8 text \(byte 0x9c at offset 1\)$"):
        read_hostfile(str(hostfile))


@pytest.mark.parametrize("argv, message", [
    (["launch", "--hosts", "", "--", "--ntrainer", "2"], "--hosts: expected [user@]host"),
    # each refused before any host is reached (these hosts do not exist: ssh's own error otherwise)
    (["launch", "--hosts", "nowhere1,,nowhere2"], "--hosts 'nowhere1,,nowhere2': a host between two commas"),
    (["launch", "--hosts", "nowhere1", "--ssh-port", "0"], "--ssh-port must be in 1..65535; got 0"),
    (["launch", "--hosts", "nowhere1", "--ssh-option", "accept-new"], "--ssh-option: expected KEY=VALUE"),
    (["launch", "--hosts", "nowhere1", "--env", "A B=1"], "--env: expected KEY=VALUE, KEY a variable's name"),
    (["launch", "--hosts", "nowhere1", "--python", " "], "--python: expected the interpreter on the hosts"),
    # a run option before --: argparse's "unrecognized arguments" said nothing of where it goes
    (["slurm", "--nodes", "2", "--ntrainer=2"], "--ntrainer is a run option: give run options after --, e.g. "
                                                "bench.py slurm --nodes N -- --ntrainer"),
    (["launch", "--hosts", "nowhere1", "--hook", "ps"], "--hook is a run option: give run options after --"),
    (["cloud", "--nodes", "2", "--rounds", "3"], "--rounds is a run option: give run options after --"),
    (["slurm", "--nodes", "2", "--gpus-per-node", "-1"], "--gpus-per-node must be 0 or more; got -1"),
    (["slurm", "--nodes", "2", "--iface", "eth1", "--", "--iface", "eth0"],
     "--iface eth1 and, in the run options, --iface eth0: give the interface once"),
    (["sweep", str(EXAMPLES.parents[1] / "configs" / "sweeps" / "hooks.json"), "--out", "{file}"], "is not a folder"),
    (["slurm", "--nodes", "2", "-o", "{file}/job.sbatch", "--", "--ntrainer", "2"], "-o's folder"),
    (["cloud", "--nodes", "2", "-o", "{file}/task.yaml", "--", "--ntrainer", "2"], "-o's folder"),
])
def test_bad_hosts_ssh_flags_and_output_paths_are_refused_in_one_line(capsys, tmp_path, argv, message):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = [word.replace("{file}", str(blocker)) for word in argv]
    with pytest.raises(SystemExit) as exited:
        raise SystemExit(main(argv))
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1, captured.err
    assert blocker.read_text() == ""


@pytest.mark.parametrize("command", ["slurm", "cloud"])
def test_a_script_written_over_the_run_file_it_names_is_refused(command, tmp_path, capsys):
    """``slurm -o run.json -- --config run.json`` replaced the run file with the script."""
    run_file = tmp_path / "run.json"
    run_file.write_text('{"ntrainer": 2}')
    assert main([command, "--nodes", "2", "-o", str(run_file), "--", "--config", str(run_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file this command reads: writing it would lose" in err, err
    assert run_file.read_text() == '{"ntrainer": 2}'


def test_launch_dry_run_prints_each_hosts_commands_and_reaches_none(capsys):
    """The hosts do not exist: a launch that tried them would say 'cannot connect over ssh'."""
    assert main(["launch", "--hosts", "alice@nowhere1,nowhere2", "--python", "/venv/bin/python", "--dry-run",
                 "--", "--ntrainer", "2", "--out", "r.json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# nowhere1 (node 0): the check, then the agent"
    assert lines[3] == "# nowhere2 (node 1): the check, then the agent"
    for node, (check, agent) in enumerate((lines[1:3], lines[4:6])):
        check, agent = shlex.split(check), shlex.split(agent)
        assert check[0] == "ssh" and "import ps_bench, torch" in check[-1]
        assert agent[:2] == ["ssh", "-tt"] and agent[-2] == ("alice@nowhere1", "nowhere2")[node]
        assert f"--node-rank {node}" in agent[-1] and "-m ps_bench --ntrainer 2 --out r.json" in agent[-1]


def test_each_host_runs_torchrun_under_ssh_with_a_terminal():
    from ps_bench.cluster.ssh import HostJob, SshOptions, Target, agent_command, failed_rank

    job = HostJob([Target("alice@node1"), Target("node2")], NodeLayout(2, 2), ["--out", "r.json"],
                  SshOptions(key="/k", port=2222, options=["StrictHostKeyChecking=no"]), python="/venv/bin/python",
                  workdir="/srv/ps bench", env={"OMP_NUM_THREADS": "2"}, iface="eth1")
    command = agent_command(job, 1)
    assert command[:2] == ["ssh", "-tt"]  # a hang-up reaches the remote side when the connection drops
    assert command[command.index("-i") + 1] == "/k" and command[command.index("-p") + 1] == "2222"
    assert command[-2] == "node2"
    remote = shlex.split(command[-1])
    assert remote[:4] == ["cd", "/srv/ps bench", "&&", "exec"]
    assert "TP_SOCKET_IFNAME=eth1" in remote and "OMP_NUM_THREADS=2" in remote
    assert remote[remote.index("--node-rank") + 1] == "1" and remote[remote.index("--master-addr") + 1] == "node1"
    report = "Root Cause (first observed failure):\n[0]:\n  host      : b\n  rank      : 2 (local_rank: 0)\n" \
             "  exitcode  : -9 (pid: 7)\n"
    assert failed_rank(report) == (2, -9)


def test_cloud_task_names_nodes_resources_setup_and_run(tmp_path, capsys):
    yaml = pytest.importorskip("yaml", reason="PyYAML (in the test extra) reads the task; ps_bench writes it as text")
    path = tmp_path / "task.yaml"
    assert main(["cloud", "--nodes", "2", "--accelerators", "H100:4", "--use-spot", "-o", str(path), "--",
                 "--ntrainer", "6", "--nserver", "1", "--backend", "nccl"]) == 0
    assert f"sky launch -c ps-bench {path}" in capsys.readouterr().out
    task = yaml.safe_load(path.read_text())
    assert task["num_nodes"] == 2 and task["resources"] == {"accelerators": "H100:4", "use_spot": True}
    import torch
    import torchvision

    pins = f"torch=={torch.__version__.split('+')[0]} torchvision=={torchvision.__version__.split('+')[0]}"
    assert f"pip install {pins}" in task["setup"] and "pip install -e ." in task["setup"]
    assert '--node-rank "$SKYPILOT_NODE_RANK"' in task["run"] and "--nproc-per-node 4" in task["run"]
    assert 'PS_BENCH_HEAD=$(echo "$SKYPILOT_NODE_IPS" | head -n 1)' in task["run"]


def test_skypilot_itself_reads_the_task(tmp_path, capsys):
    """SkyPilot's own parser (the test extra installs SkyPilot; ps_bench itself never needs it)."""
    sky = pytest.importorskip("sky", reason="SkyPilot is not installed: pip install -e '.[test]'")
    path = tmp_path / "task.yaml"
    assert main(["cloud", "--nodes", "2", "--accelerators", "H100:4", "--use-spot", "--cloud", "aws", "-o", str(path),
                 "--", "--ntrainer", "6", "--nserver", "1", "--backend", "nccl"]) == 0
    task = sky.Task.from_yaml(str(path))
    assert task.num_nodes == 2 and task.name == "ps-bench"
    [resources] = task.resources
    assert resources.accelerators == {"H100": 4} and resources.use_spot is True and str(resources.cloud) == "AWS"
    assert task.workdir == str(Path(__file__).resolve().parents[2])
    assert "torch.distributed.run" in task.run and "pip install -e ." in task.setup


def test_cloud_refuses_bad_accelerators_in_one_line(capsys):
    assert main(["cloud", "--nodes", "2", "--accelerators", "H100:x", "--"]) == 2
    assert capsys.readouterr().err == ("ps_bench: error: --accelerators: expected NAME or NAME:COUNT, e.g. H100:8; "
                                       "got 'H100:x'\n")


def test_cloud_takes_exactly_the_cluster_names_skypilot_takes(tmp_path, capsys):
    """``sky launch -c NAME`` refused a name with a space (after the YAML was written and the
    command printed); --name is now held to SkyPilot's rule before, checked here against
    SkyPilot's own check."""
    pytest.importorskip("sky", reason="SkyPilot is not installed: pip install -e '.[test]'")
    from sky.utils.common_utils import check_cluster_name_is_valid

    for name in ["ps-bench", "a", "run_2.x", "my job", "-x", "2024", "x-", "a/b", "é"]:
        try:
            check_cluster_name_is_valid(name)
            valid = True
        except Exception:  # noqa: BLE001 - SkyPilot's InvalidClusterNameError
            valid = False
        code = main(["cloud", "--nodes", "2", f"--name={name}", "-o", str(tmp_path / "t.yaml"), "--", "--ntrainer", "2"])
        err = capsys.readouterr().err
        assert code == (0 if valid else 2), (name, err)
        assert valid or err == (f"ps_bench: error: --name {name!r}: SkyPilot names a cluster with a letter, then "
                                f"letters, digits, '-', '_' or '.', ending with a letter or digit\n")
    assert main(["cloud", "--nodes", "2", "--accelerators", "H100:0", "--"]) == 2
    assert "--accelerators H100:0: COUNT must be at least 1" in capsys.readouterr().err
