"""The control endpoint: authentication before anything is parsed, bounded lines, typed fields,
every refusal counted by reason; joins refused for other expert weights of the same shape."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from conftest import model_path, open_log
from safetensors.torch import load_file, save_file

from ibgda import TransportError
from sglang_eaas.checkpoint import ModelIdentity, expert_digests
from sglang_eaas.client.connection import ServerConnection
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.control import JoinRequest, Stats, probe
from sglang_eaas.protocol.lines import MAX_AUTH_LINE, MAX_LINE, Channel, auth_line
from sglang_eaas.tools.make_tiny_model import PRESETS

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    log = open_log("control-server")
    (local,) = start_local_servers(tiny_qwen3, [[0, 1, 2, 3]], "float32", max_clients=2,
                                   stdout=log)
    yield local
    local.stop()
    log.close()


def _refused(address: str) -> tuple[dict, int]:
    stats = probe(address, TOKEN)
    return stats.control_refused, stats.refused_connections


def _exchange(address: str, data: bytes) -> tuple[list[dict], bool]:
    """Send raw bytes; the replies until the server closes or goes quiet, and whether it closed."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        sock.settimeout(1.0)
        received, closed = b"", False
        try:
            while chunk := sock.recv(65536):
                received += chunk
            closed = True
        except TimeoutError:
            pass
        except ConnectionResetError:  # closed with our unread bytes in its buffer
            closed = True
    return [json.loads(line) for line in received.splitlines()], closed


@pytest.mark.parametrize("data, reason", [
    (b"EAAS-AUTH wrong-token\n" + b'{"op": "stats"}\n', "unauthenticated"),
    # The old format (token inside the message) is not an authentication line.
    (json.dumps({"op": "stats", "token": TOKEN}).encode() + b"\n", "unauthenticated"),
    (b"\xff\xfe random bytes \x00\n", "unauthenticated"),
    (b"A" * (MAX_AUTH_LINE + 10), "line_too_long"),
])
def test_unauthenticated_connections_get_one_reply_and_are_closed(server, data, reason):
    before, closed_before = _refused(server.address)
    replies, closed = _exchange(server.address, data)
    after, closed_after = _refused(server.address)
    assert closed
    if reason == "unauthenticated":  # (an over-long line may be reset before the reply lands)
        assert replies == [{"ok": False, "error": replies[0]["error"], "reason": reason}]
        assert "authentication failed" in replies[0]["error"]
    assert after.get(reason, 0) == before.get(reason, 0) + 1
    assert closed_after == closed_before + 1


def test_authenticated_malformed_messages_are_answered_and_counted(server, tiny_qwen3):
    identity = ModelIdentity.of(tiny_qwen3)
    request = JoinRequest("c", identity.fingerprint, "float32", "auto",
                          list(identity.expert_digests))
    join = {"op": request.op, **request.to_message()}
    cases = [  # (line, counted reason, words of the error)
        (b"not json at all", "malformed", "one JSON object per line"),
        (b"[1, 2, 3]", "malformed", "must be a JSON object, not list"),
        (b"[" * 100000 + b"]" * 100000, "malformed", "one JSON object per line"),
        (b'{"op": "reboot"}', "unknown_op", "unknown op 'reboot'"),
        (b'{"op": 7}', "unknown_op", "unknown op 7"),
        (json.dumps({**join, "fingerprint": 12}).encode(), "bad_field",
         "field 'fingerprint' must be a string, got int"),
        (json.dumps({**join, "expert_digests": [1, 2]}).encode(), "bad_field",
         "field 'expert_digests' must be a list of strings"),
        (json.dumps({k: v for k, v in join.items() if k != "dtype"}).encode(), "bad_field",
         "needs field 'dtype'"),
        (json.dumps({**join, "expert_digests": ["x"]}).encode(), "bad_field",
         "one entry per expert (8), got 1"),
        (json.dumps({**join, "dtype": "int8"}).encode(), "bad_field", "unsupported dtype 'int8'"),
        (b'{"op": "ready"}', "out_of_order", "'ready' must follow one 'join'"),
    ]
    before, closed_before = _refused(server.address)
    data = auth_line(TOKEN) + b"".join(line + b"\n" for line, _, _ in cases)
    replies, closed = _exchange(server.address, data + b'{"op": "stats"}\n')
    assert not closed  # an authenticated client that errs keeps its connection
    assert len(replies) == len(cases) + 1 and replies[-1]["ok"]
    for reply, (_, _, words) in zip(replies, cases):
        assert not reply["ok"] and words in reply["error"], (reply, words)
    after, closed_after = _refused(server.address)
    for reason in {reason for _, reason, _ in cases}:
        expected = sum(r == reason for _, r, _ in cases)
        assert after.get(reason, 0) == before.get(reason, 0) + expected, reason
    assert closed_after == closed_before


def test_an_over_long_authenticated_line_is_refused_and_closed(server):
    before, closed_before = _refused(server.address)
    _, closed = _exchange(server.address, auth_line(TOKEN) + b"x" * (MAX_LINE + 1))
    after, closed_after = _refused(server.address)
    assert closed and closed_after == closed_before + 1
    assert after.get("line_too_long", 0) == before.get("line_too_long", 0) + 1


def test_a_wrong_token_through_the_client_is_one_clear_error(server, tiny_qwen3):
    with pytest.raises(TransportError, match="refused to join: authentication failed"):
        ServerConnection(server.address, "intruder", ModelIdentity.of(tiny_qwen3), "float32",
                         token="wrong")
    channel = Channel(server.address, TOKEN)
    try:  # and the server serves everyone else as before
        assert channel.call(Stats()).holdings.experts() == (0, 1, 2, 3)
    finally:
        channel.close()


@pytest.fixture(scope="module")
def reseeded(tiny_qwen3):
    """The tiny checkpoint's shape with other weights (another seed)."""
    return model_path(replace(PRESETS["tiny"], seed=1))


def test_other_weights_of_the_same_shape_are_refused_at_join(server, tiny_qwen3, reseeded):
    assert MoeModelInfo.from_model_path(reseeded).fingerprint() == \
        MoeModelInfo.from_model_path(tiny_qwen3).fingerprint()  # the shape alone can't tell
    before, _ = _refused(server.address)
    with pytest.raises(TransportError, match=r"holds other weights for experts \[0, 1, 2, 3\]"):
        ServerConnection(server.address, "other", ModelIdentity.of(reseeded), "float32")
    after, _ = _refused(server.address)
    assert after.get("join_other_weights", 0) == before.get("join_other_weights", 0) + 1
    ServerConnection(server.address, "same", ModelIdentity.of(tiny_qwen3), "float32").close()


def test_digests_follow_each_experts_weights(tiny_qwen3, tmp_path):
    """Changing one expert's down projection in one layer changes that expert's digest only;
    a copy of the checkpoint (another path, same bytes) has the same digests."""
    copy = tmp_path / "copy"
    shutil.copytree(tiny_qwen3, copy)
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    assert expert_digests(copy, info) == expert_digests(tiny_qwen3, info)
    weights = load_file(copy / "model.safetensors")
    name = info.expert_tensor_names(info.moe_layers[-1], 5)[2]
    weights[name] = weights[name] + torch.ones_like(weights[name])  # every byte changes
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    original, changed = expert_digests(tiny_qwen3, info), expert_digests(copy, info)
    assert [e for e in original if original[e] != changed[e]] == [5]


@pytest.mark.slow
def test_launch_refuses_a_separately_started_server_with_other_weights(tiny_qwen3, reseeded):
    """The launcher compares weight digests before any SGLang worker starts."""
    log = open_log("control-reseeded-server")
    (other,) = start_local_servers(reseeded, [list(range(8))], "float32", 1, stdout=log)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_qwen3),
             "--device", "cpu", "--eaas", "--eaas-expert-servers", other.address],
            capture_output=True, text=True, timeout=300)
    finally:
        other.stop()
        log.close()
    assert result.returncode != 0
    assert f"expert server {other.address} holds other weights for experts" in result.stderr
    assert "Traceback" not in result.stderr  # one sentence, not a stack


def test_a_connection_that_never_authenticates_is_closed_after_the_timeout(server):
    """A peer that connects and says nothing holds a thread only for AUTH_TIMEOUT."""
    from sglang_eaas.protocol.lines import AUTH_TIMEOUT

    before, closed_before = _refused(server.address)
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=AUTH_TIMEOUT + 10) as sock:
        started = time.monotonic()
        assert sock.recv(1024) == b""  # closed by the server, without a reply
        assert AUTH_TIMEOUT - 1 < time.monotonic() - started < AUTH_TIMEOUT + 10
    after, closed_after = _refused(server.address)
    assert after.get("auth_timeout", 0) == before.get("auth_timeout", 0) + 1
    assert closed_after == closed_before + 1
