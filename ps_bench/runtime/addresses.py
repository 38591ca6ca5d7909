"""Which interface and address a rank uses: loopback for a job on one machine, ``--iface`` or an
emulated host's link otherwise, as the environment variables TensorPipe and gloo read say."""

from __future__ import annotations

import fcntl
import os
import socket
import struct

LOOPBACK = "lo"  # Linux's loopback interface
SIOCGIFADDR = 0x8915


def interface_env(iface: str) -> dict[str, str]:
    """The variables that make TensorPipe and gloo open their sockets on ``iface``."""
    return {"TP_SOCKET_IFNAME": iface, "GLOO_SOCKET_IFNAME": iface}


def loopback() -> str | None:
    """The loopback interface's name, where this machine has one."""
    return LOOPBACK if LOOPBACK in [name for _, name in socket.if_nameindex()] else None


def address_towards(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (in this network namespace), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def own_address() -> str:
    """This rank's address on the interface the ranks bind to (``interface_env``), else the one
    that reaches the job's store."""
    bound = os.environ.get("TP_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME")
    return ((interface_address(bound) if bound else None) or
            address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1")))
