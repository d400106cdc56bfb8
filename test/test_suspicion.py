"""Failure detection in two stages, with the product's default timings (heartbeat 0.3 s, suspect
1 s, loss 10 s, result timeout 2 s): a server whose heartbeats stop (SIGSTOP, with a CPU hog of
twice the cores running) is suspected and its experts go to their other holders, with no
change of holdings, and is used as before once it heartbeats again; a server cut off from the
monitor alone, the last holder of some experts, is lost by the monitor but kept by the client
while it answers, until it registers again. Sums are checked against transformers' experts; no
request fails."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from conftest import Hog, Partition, open_log
from hf_reference import assert_matches_hf
from prometheus_client import CollectorRegistry
from tier_steps import one_step, routed_batch, wait_until
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.client.metrics import PrometheusTierMetrics
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.membership import LOSS_TIMEOUT, SUSPECT_TIMEOUT
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import probe
from sglang_eaas.status import render

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
REPLICATED = [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7], [0, 1, 6, 7]]  # two holders each


@pytest.fixture(scope="module")
def monitor():
    made = MonitorServer(MonitorConfig(token=TOKEN)).start()  # the defaults
    assert (made.registry.suspect_timeout, made.registry.loss_timeout) == (SUSPECT_TIMEOUT,
                                                                          LOSS_TIMEOUT)
    yield made
    made.close()


@pytest.fixture()
def start(tiny_qwen3, request):
    log, started = open_log(f"suspicion-{request.node.name}"), []

    def make(placements, monitor_address: str):
        servers = start_local_servers(tiny_qwen3, placements, "float32", max_clients=2,
                                      extra_args=("--monitor", monitor_address), stdout=log)
        started.extend(servers)
        return servers

    yield make
    for server in started:
        server.process.send_signal(signal.SIGCONT)
        server.stop()
    log.close()


def _client(servers, monitor, info, tiny_qwen3, name: str, metrics=None) -> EaasClient:
    return EaasClient([s.address for s in servers], info, ModelIdentity.of(tiny_qwen3),
                      torch.float32, name, monitor=monitor.address, metrics=metrics)


def _every_layer(client, info, hf_experts, seed: int) -> None:
    """One step of every MoE layer, each output against transformers'; no row failed."""
    x, ids, w = routed_batch(info, 24, seed=seed)
    for layer in info.moe_layers:
        out, failed = one_step(client, layer, x, ids, w)
        assert not failed, failed
        assert_matches_hf(out, hf_experts, layer, x, ids, w)


def _member(monitor, server):
    return next((m for m in monitor.registry.snapshot().members if m.id == server.address),
                None)


def test_a_stopped_holder_is_suspected_then_used_again_with_no_change(
        start, monitor, info, tiny_qwen3, hf_experts):
    """With a CPU hog of twice the cores running (a neighbour's job), SIGSTOP one of three
    servers (every expert has two holders): after the suspect timeout the client routes around
    it, before any request waited on it; it stays the same incarnation with the same holdings,
    is shown suspected (status, /metrics), and once resumed it heartbeats, is cleared and
    serves again, never lost; no live server is lost meanwhile either."""
    with Hog():
        _stop_a_holder(start, monitor, info, tiny_qwen3, hf_experts)


def _stop_a_holder(start, monitor, info, tiny_qwen3, hf_experts):
    servers = start(REPLICATED, monitor.address)
    registry = CollectorRegistry()
    client = _client(servers, monitor, info, tiny_qwen3, "suspicion",
                     PrometheusTierMetrics(0, registry=registry))
    try:
        _every_layer(client, info, hf_experts, seed=1)
        victim = servers[1]
        first = _member(monitor, victim).incarnation
        os.kill(victim.process.pid, signal.SIGSTOP)
        try:
            # no step meanwhile: a request sent before the suspicion would wait on the victim
            # (and its result timeout would evict it: the data path's word, not this test's)
            wait_until(lambda: victim.address not in client.table.servers, 10,
                       "the suspected server out of the table")
            conn = client.view.connections[victim.address]
            assert conn.suspected and conn.incarnation == first
            member = _member(monitor, victim)
            assert member.suspected and member.incarnation == first
            assert "SUSPECTED" in render(monitor.registry.snapshot(), monitor.address)
            requests = probe(servers[0].address, TOKEN).counter("requests")
            for seed in range(2, 4):
                _every_layer(client, info, hf_experts, seed)
            assert probe(servers[0].address, TOKEN).counter("requests") > requests
            assert registry.get_sample_value("sglang_eaas_server_suspicions_total", {
                "rank": "0", "server": victim.address}) == 1
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
        wait_until(lambda: victim.address in client.table.servers, 10,
                   "the cleared server back in the table")
        assert client.view.connections[victim.address] is conn and not conn.suspected
        before = probe(victim.address, TOKEN).counter("requests")
        for seed in range(4, 6):
            _every_layer(client, info, hf_experts, seed)
        assert probe(victim.address, TOKEN).counter("requests") > before
        snapshot = monitor.registry.snapshot()
        assert _member(monitor, victim).incarnation == first
        assert not [d for d in snapshot.departures if d.id == victim.address]
        assert client.tier.stats["failovers"] == 0
        counters = monitor.stats().counters
        assert counters["suspicions_cleared"] >= 1
        assert not [k for k in counters if k.startswith("losses_")], counters
    finally:
        client.close()


def test_the_last_holder_cut_off_from_the_monitor_is_kept_while_it_answers(
        start, monitor, info, tiny_qwen3, hf_experts):
    """The only holder of experts 0-3 loses its way to the monitor (a partition of the monitor
    alone): suspected, then lost after the loss timeout on heartbeats, yet its clients reach it
    and it answers, so they keep it and no request fails; healed, it registers again as a new
    incarnation, which they use from then on."""
    partition = Partition(monitor.address)
    cut_off = start([[0, 1, 2, 3]], partition.address)[0]
    rest = start([[4, 5, 6, 7]], monitor.address)
    registry = CollectorRegistry()
    client = _client([cut_off, *rest], monitor, info, tiny_qwen3, "kept",
                     PrometheusTierMetrics(0, registry=registry))
    try:
        _every_layer(client, info, hf_experts, seed=1)
        first = _member(monitor, cut_off).incarnation
        partition.cut.set()
        cut_at = time.monotonic()
        wait_until(lambda: any(d.id == cut_off.address for d in
                               monitor.registry.snapshot().departures), LOSS_TIMEOUT + 10,
                   "the monitor losing the cut-off server",
                   step=lambda: _every_layer(client, info, hf_experts, seed=2))
        assert time.monotonic() - cut_at >= LOSS_TIMEOUT - 0.5
        departure = next(d for d in monitor.registry.snapshot().departures
                         if d.id == cut_off.address)
        assert departure.reason == "heartbeat" and departure.incarnation == first
        wait_until(lambda: client.tier.stats["kept_last_holders"] == 1, 10,
                   "the client keeping the last holder",
                   step=lambda: _every_layer(client, info, hf_experts, seed=3))
        kept = client.view.connections[cut_off.address]
        assert kept.incarnation == first and cut_off.address in client.table.servers
        for seed in range(4, 6):
            _every_layer(client, info, hf_experts, seed)
        partition.cut.clear()
        wait_until(lambda: client.view.connections[cut_off.address].incarnation
                   not in ("", first), 30, "the healed server's new incarnation in use",
                   step=lambda: _every_layer(client, info, hf_experts, seed=6))
        _every_layer(client, info, hf_experts, seed=7)
        # dropped once, when its new incarnation replaced it; never as lost on heartbeats
        losses = {reason: registry.get_sample_value("sglang_eaas_server_losses_total", {
            "rank": "0", "server": cut_off.address, "reason": reason})
            for reason in ("replaced", "heartbeat")}
        assert losses == {"replaced": 1.0, "heartbeat": None}, losses
    finally:
        partition.cut.clear()
        client.close()
        partition.close()
