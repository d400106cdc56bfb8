"""ibgda between processes, over every backend: a one-sided request/answer, and a writer killed
mid-write that never makes the owner read a half-written payload."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ibgda_backends import BACKENDS, backend_transport
from ibgda_peer import ANSWER_FLAG, DATA, REQUEST_FLAG, payload_bytes

PEER = Path(__file__).with_name("ibgda_peer.py")


def start_peer(backend: str, region, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PEER), backend, json.dumps(region.handle.to_dict()), mode],
        stdout=subprocess.PIPE, text=True)


def wait_flag(region, offset: int, timeout: float = 60.0) -> int:
    """The owner's side: poll its local flag until it is non-zero."""
    deadline = time.monotonic() + timeout
    while (value := region.load_flag(offset)) == 0:
        assert time.monotonic() < deadline, "the peer never published"
        time.sleep(1e-4)
    return value


@pytest.mark.parametrize("backend", BACKENDS)
def test_request_and_answer_between_processes(backend, monkeypatch):
    n = payload_bytes(backend)
    region = backend_transport(backend, monkeypatch).create_region(DATA + 2 * n)
    peer = start_peer(backend, region, "echo")
    try:
        assert wait_flag(region, REQUEST_FLAG) == 1
        request = region.view(DATA, n).view(torch.int32)  # device memory on a GPU node
        assert torch.equal(request.cpu(), torch.arange(n // 4, dtype=torch.int32))  # every byte
        region.view(DATA + n, n).view(torch.int32).copy_(request * 3)
        region.store_flag(ANSWER_FLAG, 2)
        region.notify(ANSWER_FLAG + 4)
        assert peer.stdout.readline().strip() == "ok"
        assert peer.wait(30) == 0
    finally:
        peer.kill()
        region.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_writer_killed_mid_write_never_publishes_a_torn_payload(backend, monkeypatch):
    """The peer publishes uniform payloads (every byte = the round number) in several writes,
    then the flag. The owner checks a few rounds, then SIGKILLs the peer as soon as the next
    round's first bytes land: the payload is torn, and the flag must not vouch for it."""
    n = payload_bytes(backend)
    region = backend_transport(backend, monkeypatch).create_region(DATA + n)
    payload = region.view(DATA, n)
    torn_deaths = 0
    try:
        for rounds in (1, 2, 3, 1, 2, 3):
            peer = start_peer(backend, region, "flood")
            assert peer.stdout.readline().strip() == "flooding"
            for expected in range(1, rounds + 1):
                assert wait_flag(region, REQUEST_FLAG) == expected
                assert torch.all(payload == expected), "the flag published a torn payload"
                region.store_flag(REQUEST_FLAG, 0)
            deadline = time.monotonic() + 60
            while payload[0] != rounds + 1:  # the next round has begun landing
                assert time.monotonic() < deadline, "the peer stopped writing"
            peer.kill()
            peer.wait(30)
            value = region.load_flag(REQUEST_FLAG)
            if value:  # it published once more before the kill landed: the payload is whole
                assert torch.all(payload == value), "the flag published a torn payload"
                region.store_flag(REQUEST_FLAG, 0)
            elif not torch.all(payload == rounds + 1):  # died mid-write, flag not stored
                torn_deaths += 1
            if torn_deaths == 2:
                break
        assert torn_deaths, "no kill landed mid-write: the scenario was never exercised"
    finally:
        region.close()


@pytest.mark.parametrize("backend", ["shm", "mooncake"])
def test_a_closed_region_stays_mapped_while_a_view_of_it_lives(backend, monkeypatch):
    """Closing a region (and, on shm, unlinking its file) never unmaps memory a tensor view
    still reads: the weight fabric drops layer versions whose rows a batch may still use."""
    transport = backend_transport(backend, monkeypatch)
    region = transport.create_region(1 << 16)
    region.view(0, 1 << 16).fill_(7)
    view = region.view(4096, 8192)
    region.close()
    assert int(view.sum()) == 7 * 8192  # would segfault if unmapped
    view.fill_(1)
    assert int(view.sum()) == 8192
