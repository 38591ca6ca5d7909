"""``bench.py cloud``: the ``run`` script of the SkyPilot YAML it writes, on two namespace hosts."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.benchrun import ROOT, communicate
from tests.cluster.machines import project_env

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


def test_the_run_script_completes_a_two_host_run(host_pair, tmp_path):
    out = tmp_path / "results.json"
    # one process per host: the smallest job that crosses the link (the RPC paths are tested elsewhere)
    path = write_task(tmp_path, "--nodes", "2", "--iface", host_pair.iface, "--", "--ntrainer", "1", "--nserver", "0",
                      "--hook", "allreduce", *QUICK, "--out", str(out))
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
