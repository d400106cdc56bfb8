"""mooncake between two hosts: a region owner and a peer in two network namespaces joined by a
veth pair, so every byte crosses a network interface, not loopback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from netns import OWNER_IP, PEER_IP

PEER = Path(__file__).with_name("ibgda_peer.py")


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
