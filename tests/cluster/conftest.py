"""Session fixtures: the real machines of ``machines.py``, made once and torn down at the end;
each skips, saying why, where this machine cannot provide it."""

from __future__ import annotations

import pytest

from tests.cluster.machines import (HostPair, LocalSlurm, SshHosts, Unavailable, make_host_pair, remove_host_pair,
                                    start_slurm, start_sshd, stop_slurm, stop_sshd)


@pytest.fixture(scope="session")
def host_pair(tmp_path_factory) -> HostPair:
    """Two hosts (network namespaces with their own hostnames) joined by one veth link."""
    try:
        pair = make_host_pair(tmp_path_factory.mktemp("hosts"))
    except Unavailable as reason:
        pytest.skip(str(reason))
    yield pair
    remove_host_pair(pair)


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory) -> LocalSlurm:
    """A SLURM cluster of two node names on this machine."""
    try:
        cluster, daemons = start_slurm(tmp_path_factory.mktemp("slurm"))
    except Unavailable as reason:
        pytest.skip(str(reason))
    yield cluster
    stop_slurm(cluster, daemons)


@pytest.fixture(scope="session")
def ssh_hosts(host_pair, tmp_path_factory) -> SshHosts:
    """sshd on both hosts of ``host_pair``, reached with a key made for the session."""
    try:
        hosts, daemons = start_sshd(host_pair, tmp_path_factory.mktemp("ssh"))
    except Unavailable as reason:
        pytest.skip(str(reason))
    yield hosts
    stop_sshd(daemons)
