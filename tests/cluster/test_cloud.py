"""``bench.py cloud``: the SkyPilot YAML it writes, and its ``run`` script on two namespace hosts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchrun import ROOT, communicate
from machines import project_env

pytestmark = pytest.mark.integration

QUICK = ("--warmup-rounds", "1", "--rounds", "2")


def write_task(folder, *args: str):
    """Runs ``bench.py cloud``; returns the YAML file's path."""
    path = folder / "task.yaml"
    process = subprocess.run([sys.executable, str(ROOT / "bench.py"), "cloud", "-o", str(path), *args], cwd=ROOT,
                             env=project_env(), capture_output=True, text=True, timeout=120)
    assert process.returncode == 0, process.stderr
    assert f"sky launch -c ps-bench {path}" in process.stdout
    return path


def literal_block(text: str, key: str) -> str:
    """A top-level ``key: |`` block of the YAML, read without a YAML library."""
    lines = text.splitlines()
    start = lines.index(f"{key}: |") + 1
    body = []
    for line in lines[start:]:
        if line and not line.startswith("  "):
            break
        body.append(line[2:])
    return "\n".join(body).rstrip("\n") + "\n"


def test_the_task_names_nodes_resources_setup_and_run(tmp_path):
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the task here (ps_bench writes it as text)")
    path = write_task(tmp_path, "--nodes", "2", "--accelerators", "H100:4", "--use-spot", "--",
                      "--ntrainer", "6", "--nserver", "1", "--backend", "nccl")
    task = yaml.safe_load(path.read_text())
    assert task["num_nodes"] == 2 and task["resources"] == {"accelerators": "H100:4", "use_spot": True}
    assert "pip install torch==2.13.0" in task["setup"]
    assert "pip install -e ." in task["setup"]
    assert '--node-rank "$SKYPILOT_NODE_RANK"' in task["run"] and "--nproc-per-node 4" in task["run"]
    try:
        import sky
    except ImportError:
        return  # SkyPilot is not installed here: its own parser is checked where it is
    sky.Task.from_yaml(str(path))


def test_the_run_script_completes_a_two_host_run(host_pair, tmp_path):
    out = tmp_path / "results.json"
    path = write_task(tmp_path, "--nodes", "2", "--iface", host_pair.iface, "--", "--ntrainer", "2", "--nserver", "1",
                      *QUICK, "--out", str(out))
    run = literal_block(path.read_text(), "run")
    addresses = "\n".join(host.address for host in host_pair.hosts)
    nodes = []
    for rank, host in enumerate(host_pair.hosts):  # what SkyPilot sets on each node before `run`
        env = project_env(SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS=addresses, SKYPILOT_NUM_NODES="2")
        nodes.append(subprocess.Popen(host.command("bash", "-c", run), cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = [communicate(node, 300, f"run on {host.name}")[0] for node, host in zip(nodes, host_pair.hosts)]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    results = json.loads(out.read_text())
    assert results["status"] == "ok"
    assert sorted(host["hostname"] for host in results["env"]["hosts"]) == ["psb-a", "psb-b"]
