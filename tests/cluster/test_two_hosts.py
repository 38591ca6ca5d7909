"""Two hosts (network namespaces joined by a veth pair), a torchrun agent on each, --iface on the link."""

from __future__ import annotations

import json
import subprocess
import sys

from ps_bench.cluster.torchrun import NodeLayout, torchrun_command
from tests.benchrun import ROOT, communicate
from tests.cluster.machines import project_env

QUICK = ("--warmup-rounds", "1", "--rounds", "2")


def test_a_job_across_two_hosts_lists_both(host_pair, tmp_path):
    out = tmp_path / "results.json"
    head = host_pair.hosts[0]
    bench_args = ["--ntrainer", "2", "--nserver", "1", "--iface", host_pair.iface, *QUICK, "--out", str(out)]
    agents = []
    for node_rank, host in enumerate(host_pair.hosts):
        line = torchrun_command(NodeLayout(2, 2), str(node_rank), head.address, bench_args)
        agents.append(subprocess.Popen(host.command("bash", "-c", line), cwd=ROOT, env=project_env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True))
    outputs = [communicate(agent, 300, f"torchrun agent on {host.name}")[0]
               for agent, host in zip(agents, host_pair.hosts)]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    results = json.loads(out.read_text())
    assert results["status"] == "ok" and results["replicas"]["identical"] is True
    hosts = {host["hostname"]: host for host in results["env"]["hosts"]}
    assert sorted(hosts) == ["psb-a", "psb-b"]
    assert hosts["psb-a"]["address"] == host_pair.hosts[0].address and hosts["psb-a"]["ranks"] == [0, 1]
    assert hosts["psb-b"]["address"] == host_pair.hosts[1].address and hosts["psb-b"]["ranks"] == [2, 3]
    assert "results: " in outputs[1]  # the master is the last rank: on the last host


def test_an_interface_missing_on_a_host_is_one_line(host_pair):
    host = host_pair.hosts[0]
    process = subprocess.run(host.command(sys.executable, str(ROOT / "bench.py"), "--iface", "eth7"), cwd=ROOT,
                             env=project_env(), capture_output=True, text=True, timeout=120)
    assert process.returncode == 2
    assert process.stderr.strip() == "ps_bench: error: --iface 'eth7': no such network interface on psb-a; it has lo, psb0"
