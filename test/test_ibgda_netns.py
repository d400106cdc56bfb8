"""mooncake between two hosts: a region owner and a peer in two network namespaces joined by a
veth pair, so every byte crosses a network interface, not loopback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).with_name("ibgda_peer.py")
OWNER_IP, PEER_IP = "10.77.0.1", "10.77.0.2"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Namespaces (owner, peer) with 10.77.0.1 and 10.77.0.2 on a veth pair; removed after."""
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


def in_host(host: str, address: str, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", host, sys.executable, str(PEER), *args],
                            env={**os.environ, "IBGDA_TEST_HOST": address}, text=True,
                            stdout=subprocess.PIPE, **popen)


def test_mooncake_request_and_answer_across_a_network(two_hosts):
    owner_host, peer_host = two_hosts
    owner = in_host(owner_host, OWNER_IP, "mooncake", "-", "owner", stdin=subprocess.PIPE)
    peer = None
    try:
        handle = owner.stdout.readline().strip()
        assert OWNER_IP in handle  # peers reach the region at the owner's network address
        peer = in_host(peer_host, PEER_IP, "mooncake", handle, "echo")
        # The peer first: it ends by itself (connect error, 60 s wait), the owner waits forever.
        assert peer.stdout.readline().strip() == "ok"  # the answer came back byte-exact
        assert peer.wait(30) == 0
        assert owner.stdout.readline().strip() == "request whole"
        owner.stdin.close()
        assert owner.wait(30) == 0
    finally:
        for process in (owner, peer):
            if process is not None:
                process.kill()
                process.wait()
