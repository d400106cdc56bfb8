"""The slot protocol: flag state machine, headers, and both slot ends over every ibgda backend.

The server's end works on the local region; the client's end reaches it through the backend's
one-sided remote region (Mooncake over loopback TCP, device kernels under the interpreter).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
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


# Who may move the flag from where to where, written out by hand from docs/protocol.md ("State
# flag": the diagram and the OFFLINE note under it) for all 32 (actor, from, to) triples. Staying
# in a state is not a move, so no triple from a state to itself is allowed.
FLAG_SPEC = """
    actor   from               to                 allowed  (why)
    client  EMPTY              EMPTY              no
    client  EMPTY              CLIENT_WRITE_DONE  yes      client publishes a request
    client  EMPTY              SERVER_DONE        no       only the server publishes results
    client  EMPTY              OFFLINE            yes      orderly leave
    client  CLIENT_WRITE_DONE  EMPTY              no       the request is unanswered
    client  CLIENT_WRITE_DONE  CLIENT_WRITE_DONE  no
    client  CLIENT_WRITE_DONE  SERVER_DONE        no       only the server publishes results
    client  CLIENT_WRITE_DONE  OFFLINE            no       leave only from EMPTY or SERVER_DONE
    client  SERVER_DONE        EMPTY              yes      result consumed, idle
    client  SERVER_DONE        CLIENT_WRITE_DONE  yes      result consumed, next request
    client  SERVER_DONE        SERVER_DONE        no
    client  SERVER_DONE        OFFLINE            yes      orderly leave
    client  OFFLINE            EMPTY              no       the server hands out slots
    client  OFFLINE            CLIENT_WRITE_DONE  no       no live client
    client  OFFLINE            SERVER_DONE        no
    client  OFFLINE            OFFLINE            no
    server  EMPTY              EMPTY              no
    server  EMPTY              CLIENT_WRITE_DONE  no       only the client publishes requests
    server  EMPTY              SERVER_DONE        no       there is no request to answer
    server  EMPTY              OFFLINE            yes      the client is gone
    server  CLIENT_WRITE_DONE  EMPTY              no       the client consumes, not the server
    server  CLIENT_WRITE_DONE  CLIENT_WRITE_DONE  no
    server  CLIENT_WRITE_DONE  SERVER_DONE        yes      server publishes a result
    server  CLIENT_WRITE_DONE  OFFLINE            yes      the client is gone
    server  SERVER_DONE        EMPTY              no       the client consumes, not the server
    server  SERVER_DONE        CLIENT_WRITE_DONE  no       only the client publishes requests
    server  SERVER_DONE        SERVER_DONE        no
    server  SERVER_DONE        OFFLINE            yes      the client is gone
    server  OFFLINE            EMPTY              yes      a client joins
    server  OFFLINE            CLIENT_WRITE_DONE  no       only the client publishes requests
    server  OFFLINE            SERVER_DONE        no       a late answer into a reclaimed slot
    server  OFFLINE            OFFLINE            no
"""


def _flag_spec() -> dict[tuple[Actor, SlotState, SlotState], bool]:
    rows = [line.split()[:4] for line in FLAG_SPEC.strip().splitlines()[1:]]
    spec = {(Actor(a), SlotState[f], SlotState[t]): allowed == "yes" for a, f, t, allowed in rows}
    assert len(spec) == len(rows) == 2 * 4 * 4  # every triple once
    return spec


FLAG_MOVES = _flag_spec()


@pytest.mark.parametrize(("move", "allowed"), list(FLAG_MOVES.items()),
                         ids=[f"{a.value}-{f.name}-{t.name}" for a, f, t in FLAG_MOVES])
def test_transition_check_follows_the_written_spec(move, allowed):
    if allowed:
        check_transition(*move)
    else:
        with pytest.raises(ProtocolError, match=f"{move[0].value} may not move a slot from "
                                                f"{move[1].name} to {move[2].name}"):
            check_transition(*move)


def test_a_flag_outside_the_states_is_refused():
    with pytest.raises(ProtocolError, match="slot flag holds 9, which is not a SlotState"):
        check_transition(Actor.SERVER, 9, SlotState.OFFLINE)


@dataclass(frozen=True)
class SlotModel:
    """One slot as docs/protocol.md draws it: the flag in memory, the joined client's view of
    it (None: no client; a reclaimed client is gone), and whether the answer is a rejection."""

    flag: SlotState = SlotState.OFFLINE
    client: SlotState | None = None
    rejected: bool = False


S = SlotState
CLIENT_ACTIONS = ("send", "wait", "result", "leave")
SERVER_ACTIONS = ("serve", "reject", "open", "reclaim")


def model_step(m: SlotModel, action: str) -> SlotModel | None:
    """The slot after ``action``, or None where the protocol refuses it (``ProtocolError``)."""
    if action == "send":  # the client writes only into a slot it knows is free or answered
        return (replace(m, flag=S.CLIENT_WRITE_DONE, client=S.CLIENT_WRITE_DONE, rejected=False)
                if m.client in (S.EMPTY, S.SERVER_DONE) else None)
    if action in ("serve", "reject"):  # the server answers published requests only
        return (replace(m, flag=S.SERVER_DONE, rejected=action == "reject")
                if m.flag == S.CLIENT_WRITE_DONE else None)
    if action == "wait":  # the client learns of an answer by waiting for it; never refused
        done = m.client == S.CLIENT_WRITE_DONE and m.flag == S.SERVER_DONE
        return replace(m, client=S.SERVER_DONE) if done else m
    if action == "result":  # only an answered, accepted request has a result
        return m if m.client == S.SERVER_DONE and not m.rejected else None
    if action == "leave":  # orderly leave from EMPTY or SERVER_DONE; otherwise a no-op
        return (replace(m, flag=S.OFFLINE, client=S.OFFLINE)
                if m.client in (S.EMPTY, S.SERVER_DONE) else m)
    if action == "open":  # a new client joins an OFFLINE slot
        return SlotModel(S.EMPTY, S.EMPTY) if m.flag == S.OFFLINE else None
    if action == "reclaim":  # the client is gone: OFFLINE from anywhere
        return SlotModel(S.OFFLINE, None)
    raise AssertionError(f"unknown action {action}")


class RealSlot:
    """The real ``ServerSlot`` and ``ClientSlot`` over one slot of a real region."""

    def __init__(self, region, remote):
        self.region, self.remote = region, remote
        region.store_flag(BASE, SlotState.OFFLINE)
        self.server = ServerSlot(region, BASE, LAYOUT)
        self.client: ClientSlot | None = None
        self.sent: torch.Tensor | None = None
        self.count = 0

    def do(self, action: str):
        """Run ``action`` on the real ends; what it returns is checked by the caller."""
        if action == "send":
            self.count += 1
            hidden, ids, weights = _request(tokens=1 + self.count % 8, seed=self.count)
            self.client.send(self.count, hidden, ids, weights)
            self.sent = hidden
        elif action == "serve":
            if self.server.ready():  # as the serving loop does: read, compute, publish
                header, hidden, _, _ = self.server.request()
                assert torch.equal(hidden, self.sent)
                self.server.result_buffer(header.num_tokens).copy_(hidden * 2 + header.seq)
                self.server.publish(header.seq, header.num_tokens)
            else:  # an answer to no published request: a second or a late one
                self.server.publish(self.server.last_seq, 1)
        elif action == "reject":
            if self.server.ready():
                self.server.request()
            self.server.reject(RejectReason.UNKNOWN_LAYER)
        elif action == "wait":
            return self.client.wait(0.0, spin=0.0)
        elif action == "result":
            return self.client.result().clone()
        elif action == "leave":
            self.client.leave()
        elif action == "open":
            self.server.open()
            self.client = ClientSlot(self.remote, BASE, LAYOUT, REGION.bell)
        elif action == "reclaim":
            self.server.reclaim()
            self.client = None


def _actions_follow_the_model(region, remote, actions):
    real, model = RealSlot(region, remote), SlotModel()
    for action in actions:
        if action in CLIENT_ACTIONS and real.client is None:
            continue  # no client: no one to act
        after = model_step(model, action)
        if after is None:
            rejected = action == "result" and model.client == S.SERVER_DONE
            with pytest.raises(ProtocolError, match="UNKNOWN_LAYER" if rejected else None):
                real.do(action)
        else:
            got = real.do(action)
            if action == "wait":
                assert got == (after.client == S.SERVER_DONE)
            if action == "result":
                assert torch.equal(got, real.sent * 2 + real.client.seq)
            model = after
        # The flag in memory is the model's state (one byte; bytes 1-3 stay zero), and the
        # client's mirror is the model's client view.
        assert region.view(BASE + LAYOUT.flag, 4).tolist() == [model.flag, 0, 0, 0], action
        assert (real.client.state if real.client else None) == model.client, action


# Requests and answers come twice as often as joins and departures, so that sequences get past
# the first request and reach every state.
ACTION_LISTS = st.lists(st.sampled_from(2 * ("send", "serve", "wait", "result")
                                        + ("reject", "leave", "open", "reclaim")),
                        min_size=10, max_size=60)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTION_LISTS)
@pytest.mark.parametrize("transport", ["shm"], indirect=True)
def test_random_actions_on_real_slot_ends_follow_the_model(region, remote, actions):
    """send, serve, reject, wait, result, leave, open and reclaim in any order on the real ends
    over shared memory: each succeeds or raises ``ProtocolError`` exactly when the model says,
    and the flag in memory is the model's."""
    _actions_follow_the_model(region, remote, actions)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTION_LISTS)
@pytest.mark.parametrize("transport", [b for b in BACKENDS if b != "shm"], indirect=True)
def test_random_actions_follow_the_model_over_remote_backends(region, remote, actions):
    """The same over Mooncake and the device kernels, where the client's end writes remotely."""
    _actions_follow_the_model(region, remote, actions)


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


def test_an_answer_the_flag_refuses_changes_nothing(pair):
    """A second answer to an answered request raises and leaves the first answer, header and
    result, as the client reads it ("an illegal move raises ProtocolError and changes
    nothing", docs/protocol.md)."""
    client, server = pair
    hidden, ids, weights = _request()
    client.send(0, hidden, ids, weights)
    header = server.request()[0]
    server.result_buffer(3).copy_(hidden)
    server.publish(header.seq, 3)
    with pytest.raises(ProtocolError, match="SERVER_DONE"):
        server.reject(RejectReason.UNKNOWN_LAYER)
    assert client.wait(5.0) and torch.equal(client.result(), hidden)


def test_reclaimed_slot_refuses_a_late_answer(pair):
    client, server = pair
    client.send(0, *_request())
    server.request()
    server.reclaim()  # the client died meanwhile
    with pytest.raises(ProtocolError, match="OFFLINE"):
        server.publish(1, 3)


def test_an_answer_for_the_previous_client_never_passes_for_the_next(pair, region, remote):
    """A slot reclaimed mid-request and handed to a new client (join number << 32 as its
    sequence base): the old request's late answer lands in the new client's slot, and the new
    client refuses it instead of taking it for its own."""
    old_client, old_server = pair
    old_client.send(0, *_request())
    late = old_server.request()[0]  # being computed when the client dies
    old_server.reclaim()
    new_server = ServerSlot(region, BASE, LAYOUT)
    new_server.open(first_seq=2 << 32)
    new_client = ClientSlot(remote, BASE, LAYOUT, REGION.bell, first_seq=2 << 32)
    hidden, ids, weights = _request(seed=1)
    new_client.send(0, hidden, ids, weights)
    assert new_client.seq == (2 << 32) + 1
    old_server.result_buffer(3).copy_(hidden)
    old_server.publish(late.seq, 3)  # the late answer (same token count)
    assert new_client.wait(5.0)
    with pytest.raises(ProtocolError, match=f"result is for request {late.seq} of 3"):
        new_client.result()
