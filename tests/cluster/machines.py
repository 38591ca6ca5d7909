"""Real machines for the cluster tests, built on this one machine (fixtures in conftest.py).

- ``HostPair``: two hosts, each a network namespace (and its own hostname) joined by a veth
  pair whose ends are both called ``psb0``, with private test addresses; only loopback and
  that link exist inside, so no test traffic can leave.
- ``LocalSlurm``: munged, slurmctld and two slurmd node names from Debian's packages, all
  state in a temporary folder; the daemons see their own ``/etc/hosts`` (a private mount
  namespace) so the node names resolve without touching the machine's.

The fixtures skip, saying why, where an engine cannot be found or started.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.benchrun import ROOT

INSTALL_HINT = "apt-get install -y slurm-wlm munge openssh-server iproute2 (see README, Tests)"
LINK = "psb0"
SUBNET = "10.231.77"  # private, and only ever configured inside the test's own namespaces


# 1.3 MB of gradients: large enough that a link of 200 Mbit/s, not RPC's own overhead, sets the time
MID_MODEL = {"Mid": {"model_class": "DummyModel", "configurations": {
    "num_embeddings": 256, "embedding_dim": 256, "dense_input_size": 256, "dense_output_size": 256,
    "dense_layers_count": 4}}}


def crossed_at_its_rate(floor_ms: float, wire_ms: float, least: float = 0.9) -> bool:
    """A floor measured across a shaped link against the time its bytes take on the wire alone:
    never under ``least`` of it (0.9: nothing crosses faster than the link allows; less where
    crossings in the two directions may overlap), at most 1.45 of it (the shared cores'
    serialising and summing only add); both well clear of half or twice the bytes."""
    return least * wire_ms <= floor_ms <= 1.45 * wire_ms


def project_env(**extra: str) -> dict[str, str]:
    """The environment for processes of the job: this checkout's ps_bench comes first."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT), **extra}


# -- two hosts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Host:
    """One namespace host: its name (also its hostname), address and how to run inside it."""

    name: str
    address: str
    netns: str
    uts: Path

    def command(self, *argv: str) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", f"--uts={self.uts}", "--", *argv]


@dataclass(frozen=True)
class HostPair:
    hosts: tuple[Host, Host]
    iface: str = LINK


def make_host(name: str, index: int, folder: Path) -> Host:
    netns = f"psb{os.getpid()}{name[-1]}"
    uts = folder / f"uts-{name}"
    uts.touch()
    subprocess.run(["ip", "netns", "add", netns], check=True, capture_output=True)
    subprocess.run(["unshare", f"--uts={uts}", "hostname", name], check=True, capture_output=True)
    return Host(name, f"{SUBNET}.{index + 1}", netns, uts)


def remove_host(host: Host) -> None:
    subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
    subprocess.run(["umount", str(host.uts)], capture_output=True)


def link_hosts(first: Host, second: Host) -> None:
    """veth pair, one end in each namespace, both ends renamed to LINK, addresses on it."""
    peer_a, peer_b = f"{first.netns}v", f"{second.netns}v"
    steps = [["ip", "link", "add", peer_a, "type", "veth", "peer", "name", peer_b],
             ["ip", "link", "set", peer_a, "netns", first.netns],
             ["ip", "link", "set", peer_b, "netns", second.netns]]
    for host, end in ((first, peer_a), (second, peer_b)):
        inside = ["ip", "netns", "exec", host.netns]
        steps += [[*inside, "ip", "link", "set", end, "name", LINK],
                  [*inside, "ip", "addr", "add", f"{host.address}/24", "dev", LINK],
                  [*inside, "ip", "link", "set", LINK, "up"],
                  [*inside, "ip", "link", "set", "lo", "up"]]
    for step in steps:
        subprocess.run(step, check=True, capture_output=True, text=True)


# -- SLURM ---------------------------------------------------------------------------------------
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo")
NODES = ("psb-a", "psb-b")


@dataclass(frozen=True)
class LocalSlurm:
    folder: Path
    conf: Path
    nodes: tuple[str, ...]

    def env(self, **extra: str) -> dict[str, str]:
        return project_env(SLURM_CONF=str(self.conf), **extra)

    def run(self, *command: str, cwd: Path | None = None, timeout_s: float = 30) -> subprocess.CompletedProcess:
        """A SLURM client command; ``cwd`` is where a job it submits writes its log."""
        return subprocess.run(command, env=self.env(), cwd=cwd or self.folder, capture_output=True, text=True,
                              timeout=timeout_s)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def slurm_conf(folder: Path, ports: list[int]) -> str:
    controller, *node_ports = ports
    nodes = "\n".join(f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs=4 State=UNKNOWN"
                      for name, port in zip(NODES, node_ports))
    return f"""\
ClusterName=psbench
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={controller}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge.sock
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
SlurmdParameters=config_overrides
# sbatch --wait polls every 2 s only while 2 s >= MinJobAge/2; at the default (300) it sleeps
# 2, 8, then 32 s, a 10 s job returning after 42
MinJobAge=4
{nodes}
PartitionName=psb Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def daemons_script(folder: Path) -> str:
    """One shell, in its own mount namespace, that runs every daemon in the foreground."""
    munged = (f"munged -F -f --key-file={folder}/munge.key --socket={folder}/munge.sock "
              f"--pid-file={folder}/munged.pid --log-file={folder}/munged.log --seed-file={folder}/munged.seed")
    slurmds = " ".join(f"slurmd -D -N {name} &" for name in NODES)
    return (f"mount --bind {folder}/hosts /etc/hosts && {munged} & "
            f"while [ ! -S {folder}/munge.sock ]; do sleep 0.1; done; "
            f"slurmctld -D -i & {slurmds} wait")


def wait_idle(cluster: LocalSlurm, daemons: subprocess.Popen, within_s: float) -> str | None:
    """None once every node is idle; else why not."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if daemons.poll() is not None:
            return f"the SLURM daemons exited with status {daemons.returncode}"
        states = cluster.run("sinfo", "-h", "-o", "%t").stdout.split()
        if states and all(state == "idle" for state in states):
            return None
        time.sleep(0.3)
    return f"the nodes did not become idle in {within_s:g} s"


def stop_session(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class Unavailable(Exception):
    """This machine cannot provide the engine; the message says why (the fixture skips with it)."""


def remove_stale_hosts() -> list[str]:
    """Deletes the namespaces of host pairs whose test session died before its teardown (killed:
    ``psb<pid>a`` and ``psb<pid>b`` of a pid no longer running); the names deleted."""
    stale = []
    for path in Path("/run/netns").glob("psb*"):
        pid = path.name[3:-1]
        if pid.isdigit() and path.name[-1] in "ab" and not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", path.name], capture_output=True)
            stale.append(path.name)
    return stale


def make_host_pair(folder: Path) -> HostPair:
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            raise Unavailable(f"{tool} is not on PATH: {INSTALL_HINT}")
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root")
    remove_stale_hosts()
    made: list[Host] = []
    try:
        for index, name in enumerate(("psb-a", "psb-b")):
            made.append(make_host(name, index, folder))
        link_hosts(*made)
    except subprocess.CalledProcessError as error:
        for host in made:
            remove_host(host)
        raise Unavailable(f"cannot make network namespaces here: {error.stderr or error}") from None
    return HostPair((made[0], made[1]))


def remove_host_pair(pair: HostPair) -> None:
    for host in pair.hosts:
        remove_host(host)


def start_slurm(folder: Path) -> tuple[LocalSlurm, subprocess.Popen]:
    """Configures and starts munged, slurmctld and one slurmd per node name under ``folder``."""
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        raise Unavailable(f"SLURM is not installed ({', '.join(missing)} missing): {INSTALL_HINT}")
    if os.geteuid() != 0:
        raise Unavailable("the local SLURM runs its daemons as root")
    folder.chmod(0o700)  # munged refuses a key in a folder others can write
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    (folder / "munge.key").write_bytes(os.urandom(1024))
    (folder / "munge.key").chmod(0o400)
    (folder / "hosts").write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {' '.join(NODES)}\n")
    cluster = LocalSlurm(folder, folder / "slurm.conf", NODES)
    cluster.conf.write_text(slurm_conf(folder, free_ports(1 + len(NODES))))
    with open(folder / "daemons.log", "w") as log:
        daemons = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "bash", "-c",
                                    daemons_script(folder)], env=cluster.env(), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    problem = wait_idle(cluster, daemons, within_s=60)
    if problem is not None:
        stop_session(daemons)
        raise Unavailable(f"cannot start a local SLURM: {problem} (log: {folder / 'daemons.log'})")
    return cluster, daemons


def stop_slurm(cluster: LocalSlurm, daemons: subprocess.Popen) -> None:
    """Cancels what a failed test left queued (its processes go with it), then stops the daemons."""
    jobs = cluster.run("squeue", "-h", "-o", "%i").stdout.split()
    if jobs:
        cluster.run("scancel", *jobs)
        deadline = time.monotonic() + 30
        while cluster.run("squeue", "-h", "-o", "%i").stdout.split() and time.monotonic() < deadline:
            time.sleep(0.5)
    stop_session(daemons)


# -- SSH hosts -------------------------------------------------------------------------------------
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without it (Debian's service makes it too)


@dataclass(frozen=True)
class SshHosts:
    """sshd on each host of a HostPair, root's login by a key made for the session."""

    pair: HostPair
    key: Path

    def ssh_options(self) -> list[str]:
        """bench.py launch options that keep ssh away from the user's own ~/.ssh (which OpenSSH
        reads from the passwd entry, whatever $HOME says)."""
        options = ["StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "LogLevel=ERROR",
                   "ConnectTimeout=20"]
        return ["--ssh-key", str(self.key), *[f"--ssh-option={option}" for option in options]]


def sshd_config(folder: Path, host: Host, authorized_keys: Path) -> Path:
    """The host's sshd; its sessions get the tests' temporary folder (conftest's
    ``temporary_folder``), where torchrun leaves its ``torchelastic_*`` folders."""
    config = folder / f"sshd-{host.name}.conf"
    config.write_text(f"""\
ListenAddress {host.address}
Port 22
HostKey {folder}/hostkey-{host.name}
PidFile {folder}/sshd-{host.name}.pid
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PrintMotd no
SetEnv TMPDIR={tempfile.gettempdir()}
""")
    return config


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, capture_output=True)


def start_sshd(pair: HostPair, folder: Path) -> tuple[SshHosts, list[subprocess.Popen]]:
    for tool in ("sshd", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise Unavailable(f"{tool} is not installed: {INSTALL_HINT}")
    sshd = shutil.which("sshd") or "/usr/sbin/sshd"
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    key = folder / "client-key"
    keygen(key)
    authorized = folder / "authorized_keys"
    authorized.write_text((folder / "client-key.pub").read_text())
    daemons = []
    for host in pair.hosts:
        keygen(folder / f"hostkey-{host.name}")
        config = sshd_config(folder, host, authorized)
        log = open(folder / f"sshd-{host.name}.log", "w")
        daemons.append(subprocess.Popen(host.command(sshd, "-D", "-e", "-f", str(config)), stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True))
        log.close()
    hosts = SshHosts(pair, key)
    for host, daemon in zip(pair.hosts, daemons):
        problem = wait_listening(host, daemon, within_s=30)
        if problem is not None:
            stop_sshd(daemons)
            raise Unavailable(f"cannot start sshd on {host.name}: {problem} (log: {folder}/sshd-{host.name}.log)")
    return hosts, daemons


def wait_listening(host: Host, daemon: subprocess.Popen, within_s: float) -> str | None:
    """None once sshd accepts connections on the host's address (probed from inside the host)."""
    deadline = time.monotonic() + within_s
    probe = f"import socket; socket.create_connection(('{host.address}', 22), timeout=1).close()"
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            return f"it exited with status {daemon.returncode}"
        if subprocess.run(host.command(sys.executable, "-c", probe), capture_output=True).returncode == 0:
            return None
        time.sleep(0.2)
    return f"it did not listen within {within_s:g} s"


def stop_sshd(daemons: list[subprocess.Popen]) -> None:
    for daemon in daemons:
        stop_session(daemon)
