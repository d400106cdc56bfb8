"""The slot protocol: flag state machine, headers, and both slot ends over a real shm region."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_eaas.protocol import (
    Actor, HeaderError, ProtocolError, RegionLayout, RequestHeader, ResultHeader, ResultStatus,
    SlotLayout, SlotState, check_transition,
)
from sglang_eaas.protocol.flags import LEGAL_TRANSITIONS
from sglang_eaas.protocol.header import DType, RejectReason
from sglang_eaas.protocol.slot import ClientSlot, ServerSlot
from sglang_eaas.transport import TransportError, create_transport

LAYOUT = SlotLayout(max_tokens=8, hidden_size=4, top_k=2, dtype=DType.FLOAT32)


REGION = RegionLayout(2, LAYOUT.size)
BASE = REGION.base(0)


@pytest.fixture
def region():
    r = create_transport("shm").create_region(REGION.size)
    yield r
    r.close()


def _pair(region) -> tuple[ClientSlot, ServerSlot]:
    server = ServerSlot(region, BASE, LAYOUT)
    region.store_flag(BASE, SlotState.OFFLINE)
    server.open()
    return ClientSlot(region, BASE, LAYOUT, REGION.bell), server


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


def test_request_and_result_travel_through_a_slot(region):
    client, server = _pair(region)
    hidden, ids, weights = _request()
    bell = region.load_word(REGION.bell)
    client.send(5, hidden, ids, weights)
    assert server.ready() and not client.done()
    assert region.load_word(REGION.bell) == bell + 1  # the server's doorbell rang
    assert not client.wait(0.02)  # no answer yet: times out
    header, got_hidden, got_ids, got_weights = server.request()
    assert (header.layer_id, header.num_tokens, header.seq) == (5, 3, 1)
    assert torch.equal(got_hidden, hidden) and torch.equal(got_ids, ids.int())
    assert torch.equal(got_weights, weights)
    server.result_buffer(3).copy_(hidden * 2)
    server.publish(header.seq, 3)
    assert client.wait(0.0)
    assert torch.equal(client.result(), hidden * 2)
    client.send(6, *_request(seed=1))  # SERVER_DONE -> next request directly
    assert server.request()[0].seq == 2


def test_client_cannot_overwrite_an_unanswered_request(region):
    client, _ = _pair(region)
    client.send(0, *_request())
    with pytest.raises(ProtocolError, match="CLIENT_WRITE_DONE"):
        client.send(0, *_request())


def test_corrupt_header_is_rejected_and_the_slot_keeps_working(region):
    client, server = _pair(region)
    client.send(0, *_request())
    region.write(BASE + LAYOUT.request_header + 20, b"\xff\xff")  # damage the published header
    with pytest.raises(HeaderError) as exc:
        server.request()
    server.reject(exc.value.reason)
    with pytest.raises(ProtocolError, match="BAD_CHECKSUM"):
        client.result()
    hidden, ids, weights = _request(seed=2)
    client.send(0, hidden, ids, weights)
    header = server.request()[0]
    server.result_buffer(3).copy_(hidden)
    server.publish(header.seq, 3)
    assert torch.equal(client.result(), hidden)


def test_stale_sequence_is_rejected(region):
    client, server = _pair(region)
    client.send(0, *_request())
    server.request()
    server.publish(1, 3)
    client.seq = 0  # a replayed (old) request number
    client.send(0, *_request())
    with pytest.raises(HeaderError) as exc:
        server.request()
    assert exc.value.reason == RejectReason.STALE_SEQUENCE


def test_oversized_request_is_refused_before_writing(region):
    client, server = _pair(region)
    with pytest.raises(ProtocolError, match="does not fit"):
        client.send(0, *_request(tokens=9))
    assert server.state() == SlotState.EMPTY


def test_accesses_outside_the_region_fail(region):
    with pytest.raises(TransportError, match="outside region"):
        region.view(region.handle.size - 4, 8)
    peer = create_transport("shm").connect(region.handle)
    with pytest.raises(TransportError, match="outside region"):
        peer.store_flag(region.handle.size, 1)
    peer.close()


def test_doorbell_wakes_a_sleeper_in_another_process(region):
    """A futex sleeper on the shared mapping wakes when another process rings the bell."""
    import subprocess
    import sys
    import time

    code = ("import sys, time\n"
            "from sglang_eaas.transport import RegionHandle, create_transport\n"
            f"r = create_transport('shm').connect(RegionHandle('shm', {region.handle.name!r}, "
            f"{region.handle.size}))\n"
            "seen = r.load_word(0); print('ready', flush=True); t = time.monotonic()\n"
            "r.wait_word(0, seen, 30.0)\n"
            "print(round(time.monotonic() - t, 3), r.load_word(0) - seen, flush=True)\n")
    sleeper = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert sleeper.stdout.readline().strip() == "ready"
    time.sleep(1.0)  # let it fall asleep
    region.ring(0)
    slept, bumps = sleeper.stdout.readline().split()
    assert sleeper.wait(10) == 0
    assert 0.5 < float(slept) < 10 and int(bumps) == 1  # it slept, and woke on the ring


def test_reclaimed_slot_refuses_a_late_answer(region):
    client, server = _pair(region)
    client.send(0, *_request())
    server.request()
    server.reclaim()  # the client died meanwhile
    with pytest.raises(ProtocolError, match="OFFLINE"):
        server.publish(1, 3)
