"""The slot protocol: flag state machine, headers, and both slot ends over every ibgda backend.

The server's end works on the local region; the client's end reaches it through the backend's
one-sided remote region (Mooncake over loopback TCP, device kernels under the interpreter).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang_eaas.protocol import (
    Actor,
    HeaderError,
    ProtocolError,
    RegionLayout,
    RequestHeader,
    ResultHeader,
    ResultStatus,
    SlotLayout,
    SlotState,
    check_transition,
)
from sglang_eaas.protocol.flags import LEGAL_TRANSITIONS
from sglang_eaas.protocol.header import DType, RejectReason
from sglang_eaas.protocol.slot import ClientSlot, ServerSlot

from ibgda import TransportError, create_transport
from ibgda_backends import BACKENDS, backend_transport

LAYOUT = SlotLayout(max_tokens=8, hidden_size=4, top_k=2, dtype=DType.FLOAT32)


REGION = RegionLayout(2, LAYOUT.size)
BASE = REGION.base(0)


@pytest.fixture(params=BACKENDS)
def transport(request, monkeypatch):
    return backend_transport(request.param, monkeypatch)


@pytest.fixture
def region(transport):
    r = transport.create_region(REGION.size)
    yield r
    r.close()


@pytest.fixture
def remote(transport, region):
    peer = transport.connect(region.handle)
    yield peer
    peer.close()


@pytest.fixture
def pair(region, remote) -> tuple[ClientSlot, ServerSlot]:
    server = ServerSlot(region, BASE, LAYOUT)
    region.store_flag(BASE, SlotState.OFFLINE)
    server.open()
    return ClientSlot(remote, BASE, LAYOUT, REGION.bell), server


def _request(tokens: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, 4, generator=g), torch.randint(0, 8, (tokens, 2), generator=g),
            torch.rand(tokens, 2, generator=g))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Actor)), st.sampled_from(list(SlotState))),
                max_size=40))
def test_random_actions_never_reach_an_illegal_state(actions):
    """Every move either is in the legal table and happens, or raises and changes nothing."""
    state = SlotState.OFFLINE
    for actor, target in actions:
        try:
            check_transition(actor, state, target)
        except ProtocolError:
            assert (actor, state, target) not in LEGAL_TRANSITIONS
            continue
        assert (actor, state, target) in LEGAL_TRANSITIONS
        state = target
    assert state in SlotState


def test_only_the_client_publishes_requests_and_only_the_server_results():
    with pytest.raises(ProtocolError):
        check_transition(Actor.SERVER, SlotState.EMPTY, SlotState.CLIENT_WRITE_DONE)
    with pytest.raises(ProtocolError):
        check_transition(Actor.CLIENT, SlotState.CLIENT_WRITE_DONE, SlotState.SERVER_DONE)
    with pytest.raises(ProtocolError, match="not a SlotState"):
        check_transition(Actor.SERVER, 9, SlotState.OFFLINE)


@given(st.integers(0, 2**31), st.integers(1, 2**20), st.integers(1, 16), st.integers(1, 2**14),
       st.sampled_from(list(DType)), st.integers(1, 2**62), st.integers(0, 2**40))
def test_request_header_round_trip(layer, tokens, top_k, hidden, dtype, seq, payload):
    header = RequestHeader(layer, tokens, top_k, hidden, dtype, seq, payload)
    packed = header.pack()
    assert len(packed) <= 64 and RequestHeader.unpack(packed) == header


@settings(max_examples=200)
@given(st.integers(0, 43), st.integers(1, 255))
def test_any_corrupted_byte_is_rejected(position, flip):
    packed = bytearray(RequestHeader(3, 5, 2, 64, DType.FLOAT32, 7, 5 * 64 * 4 + 80).pack())
    packed[position] ^= flip
    with pytest.raises(HeaderError) as exc:
        RequestHeader.unpack(bytes(packed))
    assert exc.value.reason in (RejectReason.BAD_MAGIC, RejectReason.BAD_VERSION,
                                RejectReason.BAD_CHECKSUM)


def test_result_header_round_trip():
    header = ResultHeader(ResultStatus.REJECTED, 12, 0, RejectReason.STALE_SEQUENCE)
    assert ResultHeader.unpack(header.pack()) == header


def test_request_and_result_travel_through_a_slot(pair, region, transport):
    client, server = pair
    hidden, ids, weights = _request()
    bell = region.load_word(REGION.bell)
    client.send(5, hidden, ids, weights)
    assert server.ready()
    rang = region.load_word(REGION.bell) - bell
    assert rang == (1 if transport.owner_sleeps_on_futex else 0)  # doorbell where it wakes
    assert not client.wait(0.02)  # no answer yet: times out
    header, got_hidden, got_ids, got_weights = server.request()
    assert (header.layer_id, header.num_tokens, header.seq) == (5, 3, 1)
    assert torch.equal(got_hidden, hidden) and torch.equal(got_ids, ids.int())
    assert torch.equal(got_weights, weights)
    server.result_buffer(3).copy_(hidden * 2)
    server.publish(header.seq, 3)
    assert client.wait(0.0)
    result = client.result()
    assert torch.equal(result, hidden * 2)
    # Over shm the result is the slot itself (no copy); elsewhere it was read out.
    server.result_buffer(3).zero_()
    assert torch.equal(result, torch.zeros_like(hidden) if transport.name == "shm" else hidden * 2)
    client.send(6, *_request(seed=1))  # SERVER_DONE -> next request directly
    assert server.request()[0].seq == 2


def test_client_cannot_overwrite_an_unanswered_request(pair):
    client, _ = pair
    client.send(0, *_request())
    with pytest.raises(ProtocolError, match="CLIENT_WRITE_DONE"):
        client.send(0, *_request())


def test_corrupt_header_is_rejected_and_the_slot_keeps_working(pair, region):
    client, server = pair
    client.send(0, *_request())
    region.view(BASE + LAYOUT.request_header + 20, 2).fill_(0xFF)  # damage the published header
    with pytest.raises(HeaderError) as exc:
        server.request()
    server.reject(exc.value.reason)
    assert client.wait(5.0)
    with pytest.raises(ProtocolError, match="BAD_CHECKSUM"):
        client.result()
    hidden, ids, weights = _request(seed=2)
    client.send(0, hidden, ids, weights)
    header = server.request()[0]
    server.result_buffer(3).copy_(hidden)
    server.publish(header.seq, 3)
    assert client.wait(5.0) and torch.equal(client.result(), hidden)


def test_stale_sequence_is_rejected(pair):
    client, server = pair
    client.send(0, *_request())
    server.request()
    server.publish(1, 3)
    assert client.wait(5.0)
    client.seq = 0  # a replayed (old) request number
    client.send(0, *_request())
    with pytest.raises(HeaderError) as exc:
        server.request()
    assert exc.value.reason == RejectReason.STALE_SEQUENCE


def test_oversized_request_is_refused_before_writing(pair):
    client, server = pair
    with pytest.raises(ProtocolError, match="does not fit"):
        client.send(0, *_request(tokens=9))
    assert server.state() == SlotState.EMPTY


def test_accesses_outside_the_region_fail(region, remote):
    before = region.view(0, region.handle.size).clone()
    with pytest.raises(TransportError, match="outside region"):
        region.view(region.handle.size - 4, 8)
    for bad in (lambda: remote.store_flag(region.handle.size, 1),
                lambda: remote.write(region.handle.size - 4, torch.ones(8, dtype=torch.uint8)),
                lambda: remote.write(-1, torch.ones(1, dtype=torch.uint8)),
                lambda: remote.read(region.handle.size, torch.empty(1, dtype=torch.uint8)),
                lambda: remote.put_signal([(64, torch.ones(region.handle.size))], 0, 1)):
        with pytest.raises(TransportError, match="outside region"):
            bad()
    assert torch.equal(region.view(0, region.handle.size), before)  # nothing landed


def test_doorbell_wakes_a_sleeper_in_another_process():
    """shm: a peer sleeping on the bell (futex) wakes when the owner stores the flag and rings."""
    import subprocess
    import sys
    import time

    region = create_transport("shm").create_region(REGION.size)
    code = ("import json, sys, time\n"
            "from ibgda import RegionHandle, create_transport\n"
            "r = create_transport('shm').connect(RegionHandle.from_dict(json.loads(sys.argv[1])))\n"
            "print('ready', flush=True); t = time.monotonic()\n"
            "ok = r.wait_flag(64, 2, 30.0, bell=0)\n"
            "print(round(time.monotonic() - t, 3), ok, flush=True)\n")
    sleeper = subprocess.Popen([sys.executable, "-c", code, json.dumps(region.handle.to_dict())],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # let it fall asleep
        region.store_flag(64, 2)
        region.notify(0)
        slept, ok = sleeper.stdout.readline().split()
        assert sleeper.wait(10) == 0
        assert 0.5 < float(slept) < 10 and ok == "True"  # it slept, and woke on the ring
    finally:
        region.close()


def test_reclaimed_slot_refuses_a_late_answer(pair):
    client, server = pair
    client.send(0, *_request())
    server.request()
    server.reclaim()  # the client died meanwhile
    with pytest.raises(ProtocolError, match="OFFLINE"):
        server.publish(1, 3)
