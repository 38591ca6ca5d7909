"""Two hosts (network namespaces joined by a veth pair), a torchrun agent on each, --iface on the link."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import contextmanager

from ps_bench.cluster.torchrun import NodeLayout, torchrun_command
from tests.benchrun import ROOT, communicate
from tests.cluster.machines import MID_MODEL, crossed_at_its_rate, project_env, remove_stale_hosts

QUICK = ("--warmup-rounds", "1", "--rounds", "2")


def run_on_both_hosts(host_pair, bench_args: list[str]) -> list[str]:
    """2 processes per host, a torchrun agent on each: trainers 0 and 1 on psb-a, the server and
    the master on psb-b. Returns each agent's output."""
    head = host_pair.hosts[0]
    agents = []
    for node_rank, host in enumerate(host_pair.hosts):
        line = torchrun_command(NodeLayout(2, 2), str(node_rank), head.address,
                                ["--ntrainer", "2", "--nserver", "1", "--iface", host_pair.iface, *bench_args])
        agents.append(subprocess.Popen(host.command("bash", "-c", line), cwd=ROOT, env=project_env(),
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True))
    outputs = [communicate(agent, 300, f"torchrun agent on {host.name}")[0]
               for agent, host in zip(agents, host_pair.hosts)]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    return outputs


@contextmanager
def shaped(host_pair, rate: str):
    """The link shaped to ``rate`` both ways (tc's token bucket on each end) for the block."""
    try:
        for host in host_pair.hosts:
            subprocess.run(host.command("tc", "qdisc", "replace", "dev", host_pair.iface, "root", "tbf", "rate", rate,
                                        "burst", "64kb", "latency", "50ms"), check=True, capture_output=True)
        yield
    finally:
        for host in host_pair.hosts:
            subprocess.run(host.command("tc", "qdisc", "del", "dev", host_pair.iface, "root"), capture_output=True)


def test_a_job_across_two_hosts_lists_both(host_pair, tmp_path):
    """With --rpc-transport auto the two namespace hosts, one machine, exchange RPC payloads
    through shared memory: the results say so, and a warning line tells how to avoid it."""
    out = tmp_path / "results.json"
    outputs = run_on_both_hosts(host_pair, [*QUICK, "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["status"] == "ok" and results["replicas"]["identical"] is True
    assert results["env"]["rpc"]["transport"] == "shm" and results["env"]["rpc"]["channel"] == "cma"
    assert "ps_bench: warning: hosts psb-a, psb-b are one machine" in outputs[1]
    assert "--rpc-transport tcp makes it cross the network" in outputs[1]
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


def test_with_tcp_rpc_crosses_the_link_at_its_rate(host_pair, tmp_path):
    """A link of 200 Mbit/s each way: the RPC floor's round trip moves both trainers' buckets out
    through psb-a's end and their sums back, 2 x 2 x bytes / rate (``crossed_at_its_rate``). The
    floor's server answers each push as it arrives, so one answer may come back while the other
    push still goes out: 3 of the 4 crossings in turn at least (0.75; it measured 0.89 once)."""
    out, models = tmp_path / "results.json", tmp_path / "models.json"
    models.write_text(json.dumps(MID_MODEL))
    with shaped(host_pair, "200mbit"):
        outputs = run_on_both_hosts(host_pair, ["--rpc-transport", "tcp", "--model", "Mid", "--model-config-path",
                                                str(models), "--batch-size", "64", "--warmup-rounds", "1",
                                                "--rounds", "1", "--limits", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["env"]["rpc"] == {"option": "tcp", "transport": "uv", "channel": "basic", "over": "TCP sockets"}
    assert "ps_bench: warning" not in "".join(outputs)
    limits = results["limits"]
    expected_ms = 2 * 2 * limits["bytes_per_iter"] * 8 / 200e6 * 1000
    assert crossed_at_its_rate(limits["rpc"]["p50_ms"], expected_ms, least=0.75), (limits["rpc"], expected_ms)


def test_stale_hosts_of_a_dead_session_are_removed(host_pair):
    """A session killed before its teardown leaves its namespaces; the next one deletes them, and
    leaves a running session's alone."""
    dead = "psb4194305a"  # above any pid_max: no such process can run
    subprocess.run(["ip", "netns", "add", dead], check=True, capture_output=True)
    try:
        assert remove_stale_hosts() == [dead]
        listed = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
        assert dead not in listed
        assert all(host.netns in listed for host in host_pair.hosts)
    finally:
        subprocess.run(["ip", "netns", "del", dead], capture_output=True)
