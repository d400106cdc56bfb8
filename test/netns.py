"""Two hosts on one machine: network namespaces joined by a veth pair, so every byte between
them crosses a network interface, not loopback (test_ibgda_netns, test_fabric_netns)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator

import pytest

OWNER_IP, PEER_IP = "10.77.0.1", "10.77.0.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[str, str]]:
    """Namespaces (owner, peer) with 10.77.0.1 and 10.77.0.2 on a veth pair; removed after
    (the test skipped where namespaces cannot be made)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    pid = os.getpid()
    hosts = (f"eaas-owner-{pid}", f"eaas-peer-{pid}")
    links = (f"eo{pid}", f"ep{pid}")  # interface names have at most 15 characters
    made = subprocess.run(["ip", "netns", "add", hosts[0]], capture_output=True, text=True)
    if made.returncode != 0:  # e.g. root in a container without CAP_SYS_ADMIN: EPERM
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        ip("netns", "add", hosts[1])
        ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for host, link, address in zip(hosts, links, (OWNER_IP, PEER_IP)):
            ip("link", "set", link, "netns", host)
            ip("-n", host, "addr", "add", f"{address}/24", "dev", link)
            ip("-n", host, "link", "set", link, "up")
            ip("-n", host, "link", "set", "lo", "up")
        yield hosts
    finally:  # deleting a namespace deletes its end of the pair, and with it the other end
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host], capture_output=True)
        subprocess.run(["ip", "link", "del", links[0]], capture_output=True)  # if never moved
