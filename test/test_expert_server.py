"""Expert server processes driven by a real client: results, rejections, dead clients, resources."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest
import torch
from conftest import model_path, open_log
from hf_reference import assert_matches_hf
from ibgda_backends import BACKENDS, backend_transport
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.client.connection import ServerConnection
from sglang_eaas.launcher.prepare import probe
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.protocol import ProtocolError, RequestHeader, SlotState
from sglang_eaas.protocol.control import JoinRequest
from sglang_eaas.protocol.lines import Channel
from sglang_eaas.protocol.header import RejectReason
from sglang_eaas.tools.make_tiny_model import PRESETS

from ibgda import TransportError

PLACEMENT = [[0, 1, 2, 3], [4, 5, 6, 7, 0]]  # expert 0 has a replica


@pytest.fixture(scope="module")
def servers(tiny_qwen3):
    """Two expert servers with small slots (so a big batch is split) and 3 client slots."""
    log = open_log("expert-servers")
    local = start_local_servers(tiny_qwen3, PLACEMENT, "float32", max_clients=3,
                                extra_args=("--max-tokens", "64"), stdout=log)
    yield local
    for s in local:
        s.stop()
    log.close()


@functools.cache
def _identity() -> ModelIdentity:
    """The tiny checkpoint's identity (shape fingerprint and expert weight digests)."""
    return ModelIdentity.of(model_path(PRESETS["tiny"]))


def _client(servers, info, name="test") -> EaasClient:
    return EaasClient([s.address for s in servers], info, _identity(), torch.float32, name)


@pytest.mark.parametrize("tokens", [1, 5, 200])
def test_results_match_transformers_experts(servers, info, hf_experts, tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, info.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(info.num_experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    client = _client(servers, info)
    try:
        out = client.forward(1, x, ids, weights)
    finally:
        client.close()
    assert_matches_hf(out, hf_experts, 1, x, ids, weights)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "shm"])
def test_results_match_over_every_backend(backend, info, tiny_qwen3, hf_experts,
                                         monkeypatch):
    """The same expert computation when the slots travel over Mooncake or the device kernels;
    a client asking for another transport than the server offers is refused clearly."""
    backend_transport(backend, monkeypatch)  # device: kernels under the interpreter here
    (server,) = start_local_servers(tiny_qwen3, [list(range(info.num_experts))], "float32", 2,
                                    # both spellings of the flag: one per backend
                                    extra_args=("--transport" if backend == "mooncake"
                                                else "--eaas-transport", backend),
                                    stdout=open_log(f"expert-server-{backend}"))
    try:
        with pytest.raises(TransportError, match=f"offers transport '{backend}'"):
            EaasClient([server.address], info, _identity(), torch.float32, "shm-only",
                       transport="shm")
        g = torch.Generator().manual_seed(7)
        x = torch.randn(3, info.hidden_size, generator=g)
        ids = torch.stack([torch.randperm(info.num_experts, generator=g)[:2] for _ in range(3)])
        weights = torch.rand(3, 2, generator=g)
        client = EaasClient([server.address], info, _identity(), torch.float32, backend,
                            transport=backend)
        try:
            assert {c.region.handle.backend for c in client.connections} == {backend}
            out = [client.forward(layer, x, ids, weights) for layer in (0, 1)]
        finally:
            client.close()
    finally:
        server.stop()
    for layer in (0, 1):
        assert_matches_hf(out[layer], hf_experts, layer, x, ids, weights)


def _publish_corrupted(conn: ServerConnection, x, ids, weights) -> None:
    """What a client with a memory fault would publish: a request whose header has a bad byte."""
    slot, layout, base = conn.slot, conn.layout, conn.slot.base
    slot.seq += 1
    header = bytearray(RequestHeader(0, len(x), layout.top_k, layout.hidden_size, layout.dtype,
                                     slot.seq, layout.payload_bytes(len(x))).pack())
    header[8] ^= 0x07  # the layer id, covered by the checksum
    conn.region.put_signal([
        (base + layout.hidden, x), (base + layout.expert_ids, ids.int()),
        (base + layout.router_weights, weights),
        (base + layout.request_header, torch.frombuffer(header, dtype=torch.uint8)),
    ], base + layout.flag, SlotState.CLIENT_WRITE_DONE)
    slot.state = SlotState.CLIENT_WRITE_DONE
    conn.region.notify(slot.server_bell)


def test_rejections_are_counted_and_others_keep_being_served(servers, info):
    good, bad = _client(servers, info, "good"), ServerConnection(
        servers[0].address, "bad", _identity(), "float32")
    before = probe(servers[0].address)
    x, ids, w = torch.randn(2, info.hidden_size), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2)
    cases = {  # what goes wrong -> how to provoke it
        RejectReason.BAD_CHECKSUM: lambda: _publish_corrupted(bad, x, ids, w),
        RejectReason.UNKNOWN_LAYER: lambda: bad.slot.send(9, x, ids, w),
        RejectReason.FOREIGN_EXPERT: lambda: bad.slot.send(0, x, torch.tensor([[5, 1], [2, 3]]),
                                                           w),
    }
    try:
        for reason, provoke in cases.items():
            provoke()
            assert bad.slot.wait(10)
            with pytest.raises(ProtocolError, match=reason.name):
                bad.slot.result()
            assert good.forward(0, x, ids, w).shape == x.shape  # others are still served
        after = probe(servers[0].address)
        for reason in cases:
            key = f"rejected_{reason.name.lower()}"
            assert after.counter(key) == before.counter(key) + 1
    finally:
        good.close()
        bad.close()


def test_dead_client_slot_is_reclaimed(servers, info, tiny_qwen3):
    code = (
        "import sys, time, torch\n"
        "from sglang_eaas.client.client import EaasClient\n"
        "from sglang_eaas.checkpoint import ModelIdentity\n"
        "from sglang_eaas.model_info import MoeModelInfo\n"
        f"c = EaasClient({[s.address for s in servers]!r}, MoeModelInfo.from_model_path("
        f"{str(tiny_qwen3)!r}), ModelIdentity.of({str(tiny_qwen3)!r}), torch.float32, "
        "'doomed')\n"
        "print('joined', flush=True); time.sleep(600)\n"
    )
    before = probe(servers[0].address).clients
    doomed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert doomed.stdout.readline().strip() == "joined"
    assert probe(servers[0].address).clients == before + 1
    doomed.kill()
    doomed.wait()
    deadline = time.monotonic() + 10
    while probe(servers[0].address).clients != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert probe(servers[0].address).clients == before
    # All 3 slots can be taken again, and a 4th client is refused with a clear reason.
    clients = [_client(servers, info, f"c{i}") for i in range(3)]
    try:
        with pytest.raises(TransportError, match="larger --max-clients"):
            _client(servers, info, "one too many")
    finally:
        for c in clients:
            c.close()


def test_closing_waits_for_the_server_but_not_for_a_hung_one(servers, info):
    """An orderly close returns once the server has the slot back; a server that does not
    answer (stopped) delays it by LEAVE_TIMEOUT at most, not by the connection timeout."""
    from sglang_eaas.client.connection import LEAVE_TIMEOUT

    before = probe(servers[0].address).clients
    _client(servers, info, "orderly").close()
    assert probe(servers[0].address).clients == before  # no polling needed
    client = _client(servers, info, "patient")
    os.kill(servers[0].process.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        client.close()
        assert time.monotonic() - start < LEAVE_TIMEOUT + 5
    finally:
        os.kill(servers[0].process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10  # the server notices the closed socket once it runs again
    while probe(servers[0].address).clients != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert probe(servers[0].address).clients == before


def test_join_refused_for_another_model(servers, tiny_mixtral):
    with pytest.raises(TransportError, match="does not match the client's model"):
        ServerConnection(servers[0].address, "x", ModelIdentity.of(tiny_mixtral), "float32")


def test_idle_server_does_not_burn_a_core(servers):
    proc = psutil.Process(servers[1].process.pid)
    time.sleep(1.0)  # past any back-off ramp
    start = proc.cpu_times()
    time.sleep(2.0)
    end = proc.cpu_times()
    assert (end.user + end.system) - (start.user + start.system) < 0.3  # < 15% of one core


def test_resident_memory_scales_with_experts_held():
    """Experts are read one by one from safetensors: a server's RSS tracks what it holds."""
    spec = replace(PRESETS["tiny"], experts=16, hidden=256, moe_intermediate=1024, heads=4,
                   kv_heads=2)
    path = model_path(spec)
    per_expert = spec.layers * 3 * spec.hidden * spec.moe_intermediate * 4
    few, many = start_local_servers(path, [[0, 1], list(range(16))], "float32", 1,
                                    stdout=subprocess.DEVNULL)
    try:
        assert probe(few.address).weight_bytes == 2 * per_expert
        assert probe(many.address).weight_bytes == 16 * per_expert
        rss_gap = (psutil.Process(many.process.pid).memory_info().rss
                   - psutil.Process(few.process.pid).memory_info().rss)
        assert 0.8 * 14 * per_expert < rss_gap < 1.3 * 14 * per_expert
    finally:
        few.stop()
        many.stop()


def test_cli_refuses_bad_arguments(tiny_qwen3):
    for args, message in [(["--experts", "3-9"], "expert 9 does not exist: the model has 8"),
                          (["--experts", "x"], "is not an expert id"),
                          (["--experts", "0", "--listen", "nowhere"], "is not HOST:PORT"),
                          (["--experts", "0", "--token", ""], "needs a shared token"),
                          (["--experts", "0", "--spare-experts", "-1"],
                           "--spare-experts must be >= 0"),
                          (["--experts", "0", "--fill-threads", "0"],
                           "--fill-threads must be >= 1")]:
        result = subprocess.run([sys.executable, "-m", "sglang_eaas.expert_server",
                                 "--model-path", str(tiny_qwen3), *args],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and message in result.stderr


def test_unauthenticated_clients_are_refused(servers, info, monkeypatch):
    before = probe(servers[0].address).refused_connections
    with pytest.raises(TransportError, match="authentication failed"):
        ServerConnection(servers[0].address, "intruder", _identity(), "float32",
                         token="wrong")
    with monkeypatch.context() as env:
        env.delenv("SGLANG_EAAS_TOKEN")
        with pytest.raises(TransportError, match="refused a stats request: authentication"):
            probe(servers[0].address)
    assert probe(servers[0].address).refused_connections == before + 2


def test_a_join_never_confirmed_leaves_nothing_behind(servers, info):
    """A client that joins but dies before 'ready' holds no slot: all slots can be taken."""
    channel = Channel(servers[0].address, os.environ["SGLANG_EAAS_TOKEN"])
    try:
        identity = _identity()
        channel.call(JoinRequest("half", identity.fingerprint, "float32", "auto",
                                 list(identity.expert_digests)))
        assert probe(servers[0].address).clients == 0  # reserved, not served
    finally:
        channel.close()
    deadline = time.monotonic() + 10
    clients = []
    try:
        while len(clients) < 3 and time.monotonic() < deadline:
            try:
                clients.append(_client(servers, info, f"retry{len(clients)}"))
            except TransportError:
                time.sleep(0.1)  # the dead connection is still being torn down
        assert len(clients) == 3
    finally:
        for c in clients:
            c.close()


def test_minimum_batch_gathers_requests_of_several_clients(tiny_qwen3, info):
    """--min-batch-tokens/--max-wait-us: two clients' requests are computed as one batch."""
    (server,) = start_local_servers(tiny_qwen3, [list(range(8))], "float32", 2,
                                    extra_args=("--min-batch-tokens", "4",
                                                "--max-wait-us", "5000000"),
                                    stdout=subprocess.DEVNULL)
    a, b = (ServerConnection(server.address, n, _identity(), "float32") for n in "ab")
    try:
        x, ids = torch.randn(2, info.hidden_size), torch.tensor([[0, 1], [2, 3]])
        w = torch.rand(2, 2)
        a.slot.send(0, x, ids, w)
        time.sleep(0.2)  # a's 2 tokens wait for more
        assert not a.slot.wait(0)
        b.slot.send(0, x, ids, w)
        assert a.slot.wait(10) and b.slot.wait(10)
        assert torch.equal(a.slot.result(), b.slot.result())
        stats = probe(server.address)
        assert [stats.counter(c) for c in ("batches", "requests", "tokens")] == [1, 2, 4]
    finally:
        a.close()
        b.close()
        server.stop()


def test_a_local_server_that_cannot_start_is_reported(tiny_qwen3):
    with pytest.raises(TransportError, match=r"local expert server .* exited with code 2"):
        start_local_servers(tiny_qwen3, [[0, 99]], "float32", 1, stdout=subprocess.DEVNULL)
