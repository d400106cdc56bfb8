"""Replicas added and dropped while serving (``add_experts``/``drop_experts``, docs/protocol.md
"Replicas"): real expert-server processes, a monitor, a client stepping through layers; every
sum is checked against transformers' experts."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import open_log
from tier_steps import one_step, routed_batch, wait_until
from hf_reference import assert_matches_hf
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import AddExperts, DropExperts, ExpertWeights, call, probe
from sglang_eaas.protocol.lines import Refused

import os

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
# No test here waits for a loss: LOSS is generous, so a loaded CI machine's late heartbeats do
# not make the monitor evict the servers (and refuse a drop while they register again).
HEARTBEAT, LOSS = 0.1, 3.0
# Experts 2 and 3 only on server 0, 4 and 5 only on server 1; 0, 1, 6, 7 on two servers.
PLACEMENT = [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 6, 7]]


@pytest.fixture(scope="module")
def monitor():
    made = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=LOSS)).start()
    yield made
    made.close()


@pytest.fixture()
def servers(monitor, tiny_qwen3, request):
    log = open_log(f"replicas-{request.node.name}")
    made = start_local_servers(tiny_qwen3, PLACEMENT, "float32", max_clients=4,
                               extra_args=("--monitor", monitor.address, "--heartbeat",
                                           str(HEARTBEAT)), stdout=log)
    deadline = time.monotonic() + 15
    while {s.address for s in made} - {m.id for m in monitor.registry.snapshot().servers()}:
        assert time.monotonic() < deadline, "the servers did not register"
        time.sleep(0.05)
    yield made
    for server in made:
        server.stop()
    log.close()


@pytest.fixture()
def client_of(info, tiny_qwen3):
    made = []

    def make(servers, name: str, monitor: str, result_timeout: float = 30.0) -> EaasClient:
        made.append(EaasClient([s.address for s in servers], info, ModelIdentity.of(tiny_qwen3),
                               torch.float32, name, result_timeout=result_timeout,
                               monitor=monitor, heartbeat=HEARTBEAT))
        return made[-1]

    yield make
    for client in made:
        client.close()


def _tokens(server) -> int:
    return probe(server.address, TOKEN).counter("tokens")


def test_a_replica_added_from_a_peer_then_the_original_dropped_in_use(
        servers, client_of, monitor, info, hf_experts):
    """Server 2 loads experts 2 and 3 of MoE layer 0 from server 0 while the client serves;
    the client splits their tokens over both; then server 0 drops them while steps keep using
    them: every sum is right, no row fails, nothing fails over, and server 0 frees the rows."""
    client = client_of(servers, "replicas", monitor.address)
    layer, hot = 0, [2, 3]
    x, ids, w = routed_batch(info, 32, seed=1, experts=hot)
    assert_matches_hf(one_step(client, layer, x, ids, w)[0], hf_experts, layer, x, ids, w)

    reply = call(servers[2].address, AddExperts(layer, hot, servers[0].address), TOKEN)
    assert reply.from_peer == hot and reply.from_disk == []
    assert reply.layer_experts == [0, 1, 2, 3, 6, 7]
    other_layer = probe(servers[2].address, TOKEN).holdings[info.moe_layers[1]]
    assert other_layer == (0, 1, 6, 7)  # only that layer changed
    wait_until(lambda: 2 in client.table.holdings[servers[2].address][layer], 10,
           "the client's table with the replica", step=lambda: one_step(client, layer, x, ids, w))
    before = [_tokens(s) for s in servers]
    out, failed = one_step(client, layer, x, ids, w)
    assert_matches_hf(out, hf_experts, layer, x, ids, w)  # the fetched weights are right
    assert not failed
    added = [_tokens(s) - b for s, b in zip(servers, before)]
    assert added[1] == 0 and added[0] > 0 and added[2] > 0, added  # split over both holders

    errors, steps = [], [0]
    stop = threading.Event()

    def serve():
        seed = 100
        while not stop.is_set():
            seed += 1
            bx, bids, bw = routed_batch(info, 16, seed=seed, experts=hot + [0, 5])
            try:
                out, failed = one_step(client, layer, bx, bids, bw)
                assert not failed, failed
                assert_matches_hf(out, hf_experts, layer, bx, bids, bw)
                steps[0] += 1
            except AssertionError as exc:
                errors.append(exc)

    worker = threading.Thread(target=serve)
    worker.start()
    try:
        wait_until(lambda: steps[0] >= 3, 30, "steps before the drop")
        weights = probe(servers[0].address, TOKEN).weight_bytes
        reply = call(servers[0].address, DropExperts(layer, hot, grace=0.5), TOKEN)
        assert reply.layer_experts == [0, 1]
        wait_until(lambda: probe(servers[0].address, TOKEN).weight_bytes < weights, 30,
               "server 0 freeing the dropped experts")
        at = steps[0]
        wait_until(lambda: steps[0] >= at + 3, 30, "steps after the drop")
    finally:
        stop.set()
        worker.join(60)
    assert not errors, errors[0]
    assert client.tier.stats["failovers"] == 0 and client.tier.stats["holdings_changes"] >= 2
    assert 2 not in client.table.holdings[servers[0].address][layer]


def test_holdings_changes_that_are_refused_or_fall_back(servers, info):
    """The last holder cannot drop (unless forced); a peer that does not hold the expert, or
    does not answer, makes the server read the weights from disk; bad fields are refused."""
    layer = info.moe_layers[1]
    with pytest.raises(Refused, match="last live holder of experts \\[4\\]") as refused:
        call(servers[1].address, DropExperts(layer, [4]), TOKEN)
    assert refused.value.reason == "drop_uncovered"
    reply = call(servers[0].address, AddExperts(layer, [5], servers[2].address),
                 TOKEN)  # server 2 does not hold 5
    assert reply.from_disk == [5] and reply.from_peer == []
    reply = call(servers[0].address, AddExperts(layer, [4], "127.0.0.1:9"), TOKEN)
    assert reply.from_disk == [4]
    assert probe(servers[0].address, TOKEN).counter("replica_fetch_fallbacks") == 2
    for fields, reason in (
            (dict(layer=99, experts=[1]), "not a MoE layer"),
            (dict(layer=layer, experts=[]), "distinct expert ids"),
            (dict(layer=layer, experts=[1, 1]), "distinct expert ids"),
            (dict(layer=layer, experts=[info.num_experts]), "do not exist")):
        with pytest.raises(Refused, match=reason):
            call(servers[0].address, AddExperts(**fields), TOKEN)
    with pytest.raises(Refused, match="does not hold experts \\[3\\]"):
        call(servers[1].address, DropExperts(layer, [3]), TOKEN)
    with pytest.raises(Refused, match="does not hold expert 7"):
        call(servers[0].address, ExpertWeights(layer, 7, "w13"), TOKEN)


def _adapter_expert_sum(adapter, layer: int, x, base_ids, weights):
    """``sum_k w * expert(x)`` with the adapter's experts, read straight from its file."""
    from safetensors import safe_open

    out = torch.zeros_like(x)
    with safe_open(adapter / "adapter.safetensors", "pt") as f:
        for k, base in enumerate(base_ids):
            gate, up, down = (f.get_tensor(f"model.layers.{layer}.mlp.experts.{base}.{p}.weight")
                              .float() for p in ("gate_proj", "up_proj", "down_proj"))
            hidden = torch.nn.functional.silu(x @ gate.T) * (x @ up.T)
            out += weights[:, k:k + 1] * (hidden @ down.T)
    return out


def test_adapter_experts_added_served_copied_and_refused(servers, client_of, monitor, info,
                                                         tiny_qwen3, tmp_path):
    """ESFT adapter experts under physical ids past the model's: loaded from the adapter's
    file, described in stats and the monitor record, in the client's table as the adapter's
    map, computed with the adapter's weights, copied from a peer; the refusals."""
    layer, e = info.moe_layers[0], info.num_experts
    adapter = tmp_path / "adapter"
    subprocess.run([sys.executable, "-m", "sglang_eaas.tools.esft", "random", str(tiny_qwen3),
                    str(adapter), "--experts", f'{{"{layer}": [2, 5]}}'], check=True,
                   capture_output=True)
    client = EaasClient([s.address for s in servers], info, ModelIdentity.of(tiny_qwen3),
                        torch.float32, "esft", monitor=monitor.address, heartbeat=HEARTBEAT,
                        adapter_slots=4)
    try:
        add = dict(layer=layer, adapter="a", adapter_path=str(adapter))
        reply = call(servers[1].address, AddExperts(experts=[e, e + 1], replaces=[2, 5], **add),
                     TOKEN)
        assert reply.from_disk == [e, e + 1]
        described = probe(servers[1].address, TOKEN).holdings.adapters[layer]
        assert {p: v[:2] for p, v in described.items()} == {e: ("a", 2), e + 1: ("a", 5)}
        wait_until(lambda: client.table.adapters() == {"a": {layer: {2: e, 5: e + 1}}}, 10,
                   "the adapter's map in the client's table")
        x, _, w = routed_batch(info, 6, seed=3)
        ids = torch.tensor([[e, e + 1]] * 6)[:, :info.top_k]
        out, failed = one_step(client, layer, x, ids, w[:, :ids.shape[1]])
        assert not failed
        reference = _adapter_expert_sum(adapter, layer, x, [2, 5], w[:, :ids.shape[1]])
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)

        reply = call(servers[2].address, AddExperts(experts=[e, e + 1], replaces=[2, 5],
                                                    source=servers[1].address, **add), TOKEN)
        assert reply.from_peer == [e, e + 1]
        # a copy asked for by physical id alone, as for the model's experts: the peer says
        # what it is
        reply = call(servers[0].address, AddExperts(layer, [e + 1], servers[2].address), TOKEN)
        assert reply.from_peer == [e + 1]
        described = probe(servers[0].address, TOKEN).holdings.adapters[layer]
        assert described[e + 1][:2] == ("a", 5)
        with pytest.raises(Refused, match="holds no adapter expert"):
            call(servers[0].address, AddExperts(layer, [e + 3], servers[2].address), TOKEN)
        for fields, reason in (
                (dict(experts=[1], replaces=[2]), "physical ids >= "),
                (dict(experts=[e], replaces=[5]), "holds other experts under physical ids"),
                (dict(experts=[e + 2], replaces=[3]), "does not replace experts \\[3\\]"),
                (dict(experts=[e + 2], replaces=[2], adapter_path=str(tmp_path)),
                 "expert_config.json")):
            with pytest.raises(Refused, match=reason):
                call(servers[1].address, AddExperts(**{**add, **fields}), TOKEN)
        call(servers[1].address, DropExperts(layer, [e, e + 1], grace=0.0), TOKEN)
        assert layer not in probe(servers[1].address, TOKEN).holdings.adapters
        wait_until(lambda: client.table.adapters() == {"a": {layer: {2: e, 5: e + 1}}}
                   and servers[1].address not in client.table.holdings.holders(layer).get(e, ()),
                   10,
                   "the table without server 1's copies")
    finally:
        client.close()


def test_a_client_that_never_learns_of_a_drop(servers, client_of, info, hf_experts):
    """A client without the monitor keeps its old table; once the server has freed the
    experts it refuses them (FOREIGN_EXPERT), the client waits for a newer table, gets
    none, drops the server and sends those entries to the other holders: the sum is still
    right. (The client joins a server given at launch again once it answers, every
    ``sglang_eaas.client.tier.RETRY`` s: by the end of the step it may be back, with what it
    holds now.)"""
    client = client_of(servers, "no-monitor", monitor="", result_timeout=1.0)
    layer = info.moe_layers[0]
    x, ids, w = routed_batch(info, 24, seed=7, experts=[0, 1])  # on servers 0 and 2
    assert_matches_hf(one_step(client, layer, x, ids, w)[0], hf_experts, layer, x, ids, w)
    call(servers[2].address, DropExperts(layer, [0, 1], grace=0.0), TOKEN)
    wait_until(lambda: probe(servers[2].address, TOKEN).weight_bytes
               < probe(servers[0].address, TOKEN).weight_bytes, 10, "the rows freed")
    before = dict(client.tier.stats)
    out, failed = one_step(client, layer, x, ids, w)
    assert_matches_hf(out, hf_experts, layer, x, ids, w)
    assert not failed
    stats = client.tier.stats
    assert (stats["drops"], stats["failovers"]) == (before.get("drops", 0) + 1,
                                                    before.get("failovers", 0) + 1), stats
    back = client.table.holdings.get(servers[2].address)  # None: not joined again yet
    assert back is None or list(back[layer]) == [6, 7], back
    # Back-to-back changes: the table adopted after a refusal can be newer for another change
    # and still route to the server that refused. Its second refusal is waited out as the
    # first (a newer table, else the server is dropped), never an error of the step.
    client = client_of(servers, "refused-twice", monitor="", result_timeout=1.0)
    layer = info.moe_layers[1]
    freed = probe(servers[2].address, TOKEN).weight_bytes
    call(servers[2].address, DropExperts(layer, [0, 1], grace=0.0), TOKEN)
    wait_until(lambda: probe(servers[2].address, TOKEN).weight_bytes < freed, 10,
               "the rows freed")
    real, asked = client._adopt_newer, []

    def stale_once(layer_id: int, sent_with: int) -> bool:
        asked.append(sent_with)
        return True if len(asked) == 1 else real(layer_id, sent_with)

    client._adopt_newer = stale_once
    out, failed = one_step(client, layer, x, ids, w)
    assert_matches_hf(out, hf_experts, layer, x, ids, w)
    assert not failed and len(asked) == 2, asked


def test_the_balancer_replicates_a_hot_expert(servers, client_of, monitor, info, hf_experts,
                                             tmp_path):
    """Every token of MoE layer 0 needs experts 2 and 3, which only server 0 holds: the
    client's load windows reach the monitor with its heartbeats; ``tools.rebalance --load
    clients`` reads them (and the servers' counters for the measured ratio), gives 2 and 3
    replicas on other servers (from server 0's copy) and frees room for them; the client's
    next steps spread those tokens, and every sum stays right."""
    client = client_of(servers, "balanced", monitor.address)
    hot = [2, 3]
    batches = {layer: routed_batch(info, 24, seed=20 + layer, experts=hot if layer == 0 else
                             list(range(info.num_experts))) for layer in info.moe_layers}

    def step():
        client.begin_step()
        try:
            for layer, (x, ids, w) in batches.items():
                assert_matches_hf(client.forward(layer, x, ids, w), hf_experts, layer, x, ids, w)
        finally:
            assert not client.end_step()

    for _ in range(3 * client.load.window_steps):
        step()
    wait_until(lambda: any(m.load for m in monitor.registry.snapshot().clients()), 10,
           "a load window at the monitor")
    env = {**os.environ, "SGLANG_EAAS_TOKEN": TOKEN}
    run = subprocess.run([sys.executable, "-m", "sglang_eaas.tools.rebalance", "--monitor",
                          monitor.address, "--slots", "6", "--grace", "0.5", "--load",
                          "clients", "--state", str(tmp_path / "state.json")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "entries in the clients' last windows" in run.stdout, run.stdout
    found = re.search(r"MoE layer 0: busiest server measured ([\d.]+)x the mean, modelled "
                      r"([\d.]+)x -> plan ([\d.]+)x", run.stdout)
    assert found, run.stdout
    measured, before, after = map(float, found.groups())
    assert measured == before == pytest.approx(3.0), run.stdout  # all on 1 of 3 servers
    assert after <= 1.5, run.stdout
    holders = {e: monitor.registry.snapshot().holdings().holders(0).get(e, []) for e in hot}
    assert all(len(h) >= 2 for h in holders.values()), holders
    wait_until(lambda: all(e in client.table.holdings[s][0] for e in hot for s in holders[e]),
           10, "the client's table with the replicas", step=step)
    served = [_tokens(s) for s in servers]
    step()
    added = [_tokens(s) - b for s, b in zip(servers, served)]
    assert sum(a > 0 for a in added) >= 2, added  # layer 0's tokens no longer on one server
