"""An emulated cluster network on one machine: hosts as network namespaces, each behind a shaped
link to a switch.

Every host and the switch is an anonymous network (and hostname) namespace held open by a small
process of its own (``HOLDER``). The switch holds a bridge; each host's link is a veth pair
created inside the switch with its other end inside the host (nothing is ever created in this
machine's own namespace), shaped with ``tc``'s token bucket (``tbf``) on both ends, so both
directions run at the link's rate, and with ``netem`` added delay where the kernel has it. A
rank enters its host's namespaces (``setns``) before it opens any socket, and TensorPipe is
told to use TCP (``--rpc-transport tcp``): between processes of one machine it would otherwise
move tensors through shared memory, past the link.

Nothing outlives the job: a namespace ends with the last process in it, and every holder ends
with the launcher (the parent-death signal, and the end of its stdin), however the launcher
ends; ``close`` ends them at once. ``keep`` leaves the holders running, detached, for a look
inside (``nsenter -t PID -n``); killing them removes the network.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ps_bench.config import ConfigError, RunConfig

CLONE_NEWUTS, CLONE_NEWNET = 0x04000000, 0x40000000
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
HOST_IFACE = "eth0"  # every emulated host's link, as a cluster node's NIC
SUBNET = "10.231.0"  # private, and only ever configured inside the job's own namespaces
MAX_HOSTS = 253
# rates in bits per second, as tc writes them
RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
# tc reads these as bytes a second, network specifications as bits: either reading of a rate
# typed with one is 8 times the other, so they are refused with both readings spelt out
BYTE_RATE_UNITS = ("bps", "kbps", "mbps", "gbps", "tbps")
DELAY_UNITS = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0}
TOOLS = ("ip", "tc", "nsenter", "unshare")
INSTALL_HINT = "apt-get install -y iproute2 util-linux"
QUEUE_LATENCY = "50ms"  # how long a packet may wait in a link's queue before tbf drops it
SETUP_TIMEOUT_S = 30.0

# The process that holds a namespace open: it dies with its parent (the launcher) unless kept,
# and whenever its stdin ends.
HOLDER = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
keep, hostname = sys.argv[1] == "keep", sys.argv[2].encode()
if not keep:
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if libc.unshare(%d) != 0 or libc.sethostname(hostname, len(hostname)) != 0:
    sys.stderr.write(os.strerror(ctypes.get_errno()) + "\n")
    sys.exit(1)
sys.stdout.write("ready\n")
sys.stdout.flush()
sys.stdin.read() if not keep else signal.pause()
""" % (CLONE_NEWNET | CLONE_NEWUTS)


def parse_rate(text: str, name: str = "--link (--emulate-link)") -> float:
    """A link rate in bits (``1gbit``, ``500mbit``) as bits per second; ``name``: the option's,
    for the error."""
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)([a-z]+)", text.strip().lower())
    if match is not None and match.group(1).startswith("-"):
        raise ConfigError(f"{name} must be at least 1kbit; got {text!r}")
    if match is not None and match.group(2) in BYTE_RATE_UNITS:
        number, unit = match.groups()
        bits = unit[:-3] + "bit"
        raise ConfigError(
            f"{name} {text}: '{unit}' means bytes a second to tc ({float(number) * 8:g}{bits}) "
            f"and bits a second in network specifications ({number}{bits}); write the rate in "
            f"bits, e.g. {number}{bits}")
    if match is None or match.group(2) not in RATE_UNITS:
        raise ConfigError(f"{name}: expected a rate with its unit, in bits, e.g. 1gbit, 25gbit, "
                          f"500mbit; got {text!r}")
    rate = float(match.group(1)) * RATE_UNITS[match.group(2)]
    if rate < 1e3:
        raise ConfigError(f"{name} must be at least 1kbit; got {text!r}")
    return rate


def parse_delay(text: str, name: str = "--delay (--emulate-delay)") -> float:
    """A one-way delay (``100us``, ``2ms``) in seconds; ``name``: the option's, for the error."""
    match = re.fullmatch(r"(-?\d+(?:\.\d+)?)([a-z]+)", text.strip().lower())
    if match is None or match.group(2) not in DELAY_UNITS:
        raise ConfigError(f"{name}: expected a time with its unit, e.g. 5us, 100us or 2ms; "
                          f"got {text!r}")
    if match.group(1).startswith("-"):
        raise ConfigError(f"{name} must be 0 or more; got {text!r}")
    return float(match.group(1)) * DELAY_UNITS[match.group(2)]


def placement(cfg: RunConfig) -> list[list[int]]:
    """The ranks on each emulated host. By default every trainer and every server has a host of
    its own and the master sits beside the last server (the last trainer without servers), so
    every gradient crosses a link. With ``per_host`` G, trainers [kG, (k+1)G) share host k (they
    reach each other over its loopback, as GPUs in a node do); ``servers_on`` colocated puts
    server k on trainer host k, dedicated gives each server a host of its own; the master sits on
    the last host. With ``emulate_hosts`` N (and no ``per_host``), the ranks in rank order,
    packed onto N hosts as evenly as they go."""
    world = cfg.world_size
    if cfg.per_host is not None or cfg.servers_on == "colocated":
        per_host = cfg.per_host or 1
        trainers, servers = cfg.num_trainers, cfg.num_servers
        hosts = [list(range(start, start + per_host)) for start in range(0, trainers, per_host)]
        for server in range(servers):
            rank = trainers + server
            if cfg.servers_on == "colocated":
                hosts[server % len(hosts)].append(rank)
            else:
                hosts.append([rank])
        hosts[-1].append(world - 1)
        return hosts
    if cfg.emulate_hosts is None:
        hosts = [[rank] for rank in range(world - 1)]
        hosts[-1].append(world - 1)
        return hosts
    base, extra = divmod(world, cfg.emulate_hosts)
    hosts, start = [], 0
    for index in range(cfg.emulate_hosts):
        size = base + (index < extra)
        hosts.append(list(range(start, start + size)))
        start += size
    return hosts


def privileged() -> bool:
    """Whether this process may make network namespaces and shape links: the capabilities root
    has (a container's root may lack them; sudo gives them)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return os.geteuid() == 0
    effective = int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return all(effective >> bit & 1 for bit in (CAP_NET_ADMIN, CAP_SYS_ADMIN))


def netem_available() -> bool:
    """Whether the kernel has netem: tried on the loopback of a throwaway namespace."""
    probe = subprocess.run(["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                            "delay", "1ms"],
                           capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    return probe.returncode == 0


def check(cfg: RunConfig, machine: bool = True) -> None:
    """The emulation options and (``machine``) this machine: a ConfigError says what is wrong,
    before anything is created."""
    parse_rate(cfg.emulate_link)
    if cfg.emulate_hosts is not None and (cfg.per_host is not None or
                                          cfg.servers_on == "colocated"):
        placed = len(placement(cfg))
        if cfg.emulate_hosts != placed:
            raise ConfigError(f"--hosts (--emulate-hosts) {cfg.emulate_hosts} disagrees with "
                              f"--per-host and --servers-on, which place this job on {placed} "
                              f"hosts: leave --hosts out")
    hosts = len(placement(cfg)) if cfg.emulate_hosts is None else cfg.emulate_hosts
    if cfg.emulate_hosts is not None and not 1 <= cfg.emulate_hosts <= cfg.world_size:
        raise ConfigError(f"--hosts (--emulate-hosts) must be from 1 to this job's "
                          f"{cfg.world_size} processes; got {cfg.emulate_hosts}")
    if hosts > MAX_HOSTS:
        raise ConfigError(f"an emulated network has at most {MAX_HOSTS} hosts; "
                          f"this one would have {hosts}: set --hosts (--emulate-hosts)")
    if cfg.emulate_delay is not None:
        parse_delay(cfg.emulate_delay)
    if cfg.iface is not None:  # each rank binds its host's link, in its own namespace
        raise ConfigError(f"--iface {cfg.iface}: on an emulated network every rank uses its "
                          f"host's own link ({HOST_IFACE}); leave --iface out")
    if not machine:
        return
    if not privileged():
        raise ConfigError("an emulated network needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN, for "
                          "network namespaces and tc): run it with sudo, e.g. sudo $(which python) "
                          "bench.py emulate --link 1gbit -- ...")
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        raise ConfigError(f"an emulated network needs {', '.join(missing)}, not found here: "
                          f"{INSTALL_HINT}")
    if cfg.emulate_delay is not None and not netem_available():
        raise ConfigError("--delay (--emulate-delay) needs the kernel's netem qdisc, which this "
                          "kernel does not have (tc: 'Specified qdisc kind is unknown'); leave "
                          "--delay out, or run on a kernel with sch_netem")


def tbf(device: str, rate_bps: float) -> list[str]:
    """The token bucket that shapes ``device``'s egress to the rate: a burst of 2 ms at the rate
    (at least 64 KiB, so a full-size segment always fits)."""
    burst = max(64 * 1024, int(rate_bps / 8 * 0.002))
    return ["qdisc replace dev", device, "root handle 1: tbf rate", f"{int(rate_bps)}bit",
            f"burst {burst}", f"latency {QUEUE_LATENCY}"]


def shaping(device: str, rate_bps: float, delay_s: float | None) -> str:
    """tc batch lines: the token bucket, and netem's delay beneath it where asked."""
    lines = [" ".join(tbf(device, rate_bps))]
    if delay_s:
        lines.append(f"qdisc add dev {device} parent 1:1 handle 10: "
                     f"netem delay {delay_s * 1e6:.0f}us")
    return "\n".join(lines) + "\n"


@dataclass
class Holder:
    """A process that holds a network and hostname namespace open."""

    process: subprocess.Popen
    hostname: str

    @property
    def pid(self) -> int:
        return self.process.pid

    def namespaces(self) -> dict[str, str]:
        return {kind: f"/proc/{self.pid}/ns/{kind}" for kind in ("net", "uts")}

    def run(self, *command: str, batch: str | None = None) -> None:
        """Runs ``command`` inside this namespace (``batch``: its standard input)."""
        done = subprocess.run(["nsenter", "-t", str(self.pid), "-n", *command], input=batch,
                              capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"emulated network, {self.hostname}: {' '.join(command)}: "
                               f"{(done.stderr or done.stdout).strip()}")


def start_holder(hostname: str, keep: bool) -> Holder:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, "keep" if keep else "die", hostname],
                               stdin=subprocess.DEVNULL if keep else subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=keep)
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise RuntimeError(f"emulated network: cannot make namespaces for {hostname}: "
                           f"{process.stderr.read().strip()}")
    return Holder(process, hostname)


@dataclass
class EmulatedNetwork:
    """The hosts and their links, built by ``build`` and ended by ``close``."""

    rate_bps: float
    delay_s: float | None
    placement: list[list[int]]
    keep: bool = False
    switch: Holder | None = None
    hosts: list[Holder] = field(default_factory=list)

    def host_of(self, rank: int) -> int:
        return next(index for index, ranks in enumerate(self.placement) if rank in ranks)

    def namespaces_of(self, rank: int) -> dict[str, str]:
        return self.hosts[self.host_of(rank)].namespaces()

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def record(self) -> dict:
        """``env.emulated`` of the results."""
        return {"link_rate_bps": self.rate_bps, "delay_s": self.delay_s or 0.0,
                "hosts": len(self.placement), "placement": self.placement,
                "shaping": "tc tbf on both ends of every host's link"
                + (", netem delay" if self.delay_s else ""), "rpc_transport": "tcp"}

    def describe(self, name_of=None) -> str:
        """The network in a line; with ``name_of`` (a rank's name), each host's ranks."""
        rate = format_rate(self.rate_bps)
        delay = (f", {self.delay_s * 1e6:.0f} us added delay each way" if self.delay_s
                 else ", no added delay")
        hosts = " | ".join(f"{host_name(index)} ({self.address(index)}): "
                           f"{', '.join(map(name_of, ranks))}"
                           for index, ranks in enumerate(self.placement)) if name_of else ""
        hosts_count = len(self.placement)
        return (f"ps_bench: emulated network: {hosts_count} host{'s' * (hosts_count != 1)} "
                f"(network namespaces) on "
                f"one switch, each link {rate} both ways (tc tbf){delay}; RPC over TCP"
                + (f"; {hosts}" if hosts else ""))

    def build(self) -> None:
        """Makes the switch and every host, their links and shaping (about 0.1 s for three)."""
        self.switch = start_holder("emulated-switch", self.keep)
        self.switch.run("ip", "-batch", "-",
                        batch="link set lo up\nlink add br0 type bridge\nlink set br0 up\n")
        for index in range(len(self.placement)):
            host = start_holder(host_name(index), self.keep)
            self.hosts.append(host)
            port = f"s{index}"
            self.switch.run("ip", "link", "add", port, "type", "veth", "peer", "name", HOST_IFACE,
                            "netns", str(host.pid))
            self.switch.run("ip", "-batch", "-",
                            batch=f"link set {port} master br0\nlink set {port} up\n")
            self.switch.run("tc", "-batch", "-", batch=shaping(port, self.rate_bps, self.delay_s))
            host.run("ip", "-batch", "-",
                     batch=f"link set lo up\naddr add {self.address(index)}/24 dev {HOST_IFACE}"
                           f"\nlink set {HOST_IFACE} up\n")
            host.run("tc", "-batch", "-", batch=shaping(HOST_IFACE, self.rate_bps, self.delay_s))

    def close(self) -> None:
        """Ends every holder (unless kept): the namespaces, links and bridge go with them."""
        if self.keep:
            return
        for holder in [*self.hosts, *([self.switch] if self.switch else [])]:
            holder.process.kill()
            holder.process.wait()
            for stream in (holder.process.stdin, holder.process.stdout, holder.process.stderr):
                if stream is not None:
                    stream.close()

    def kept(self) -> str:
        pids = " ".join(str(holder.pid) for holder in [*self.hosts, self.switch])
        return (f"ps_bench: the emulated network is kept: enter a host with `nsenter -t PID -n -u` "
                f"(PID of {', '.join(f'{h.hostname} {h.pid}' for h in self.hosts)}); "
                f"remove it with `kill {pids}`")


def format_rate(bps: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def host_name(index: int) -> str:
    return f"emulated-h{index}"


def planned(cfg: RunConfig) -> EmulatedNetwork:
    """The network ``cfg`` asks for (already checked), not yet built."""
    return EmulatedNetwork(parse_rate(cfg.emulate_link),
                           parse_delay(cfg.emulate_delay) if cfg.emulate_delay else None,
                           placement(cfg), keep=cfg.emulate_keep)


def build(cfg: RunConfig) -> EmulatedNetwork:
    """The network ``cfg`` asks for (already checked), built; ``close`` it when the job ends."""
    network = planned(cfg)
    try:
        network.build()
    except BaseException:
        network.keep = False
        network.close()
        raise
    return network


def enter(namespaces: dict[str, str]) -> None:
    """Moves this process (one thread, before any socket) into a host's namespaces."""
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, flag in (("net", CLONE_NEWNET), ("uts", CLONE_NEWUTS)):
        fd = os.open(namespaces[kind], os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                raise OSError(ctypes.get_errno(),
                              f"setns {namespaces[kind]}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
