"""``sglang_eaas_exchange_imbalance`` (client/metrics.py), without SGLang: what one exchange's
observation is (busiest server's entries over the mean per server of the table), and that the
client observes each exchange it starts once, from its first send, and not the send again
after a server is lost."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
import torch
from conftest import open_log
from prometheus_client import CollectorRegistry
from tier_steps import one_step, routed_batch
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.client.metrics import EXCHANGE_BUCKETS, PrometheusTierMetrics, TierMetrics
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import probe

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
NAME = "sglang_eaas_exchange_imbalance"
# Every expert of the tiny model (8) on two of the three servers: any one may go.
REPLICATED = [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7], [0, 1, 6, 7]]


def sample(registry: CollectorRegistry, suffix: str, layer: int, **more: str) -> float:
    value = registry.get_sample_value(f"{NAME}{suffix}", {"rank": "0", "layer": str(layer),
                                                          **more})
    return 0.0 if value is None else value


def test_an_exchange_is_the_busiest_server_over_the_mean_of_the_tables_servers():
    registry = CollectorRegistry()
    metrics = PrometheusTierMetrics(0, registry=registry)
    # 8 entries over 4 servers (-1: no entry, -2: no holder): 5, 3, 0, 0 -> 5 / 2
    metrics.exchange(7, np.array([[0, 0, 1, -1], [0, 1, 0, -2], [1, 0, -1, -1]]), 4)
    # 4 entries, one per server: even
    metrics.exchange(7, np.array([[0, 1], [2, 3]]), 4)
    # nothing assigned: no observation
    metrics.exchange(7, np.array([[-1, -2]]), 4)
    metrics.exchange(9, np.array([[1, 1]]), 2)  # another layer: 2 entries, both on one of 2
    assert sample(registry, "_count", 7) == 2
    assert sample(registry, "_sum", 7) == pytest.approx(2.5 + 1.0)
    assert sample(registry, "_bucket", 7, le="1.0") == 1  # the even one
    assert sample(registry, "_bucket", 7, le="2.0") == 1
    assert sample(registry, "_bucket", 7, le="3.0") == 2
    assert (sample(registry, "_count", 9), sample(registry, "_sum", 9)) == (1, 2.0)
    assert EXCHANGE_BUCKETS[0] == 1.0 and list(EXCHANGE_BUCKETS) == sorted(EXCHANGE_BUCKETS)
    TierMetrics().exchange(7, np.array([[0]]), 1)  # metrics off: nothing, no error


@pytest.fixture(scope="module")
def tier(tiny_qwen3):
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=2.0)).start()
    log = open_log("exchange-metric")
    servers = start_local_servers(tiny_qwen3, REPLICATED, "float32", max_clients=4,
                                  extra_args=("--monitor", monitor.address, "--heartbeat", "0.1"),
                                  stdout=log)
    yield monitor, servers
    for server in servers:
        server.stop()
    log.close()
    monitor.close()


def entries(servers, layer: int) -> np.ndarray:
    """Each server's entries of ``layer`` so far, from its own counters."""
    return np.array([sum(tokens for tokens, _ in
                         probe(s.address, TOKEN).expert_load.get(layer, {}).values())
                     for s in servers])


def test_the_client_observes_each_exchange_it_starts_once(tier, info, tiny_qwen3):
    """One observation per layer call, equal to what the servers' own counters say they
    computed; a server lost mid-layer (its entries sent again to the other holders) adds no
    second one."""
    monitor, servers = tier
    registry = CollectorRegistry()
    client = EaasClient([s.address for s in servers], info, ModelIdentity.of(tiny_qwen3),
                        torch.float32, "exchange-metric", result_timeout=30.0,
                        monitor=monitor.address, heartbeat=0.1,
                        metrics=PrometheusTierMetrics(0, registry=registry))
    try:
        layer = info.moe_layers[0]
        x, ids, w = routed_batch(info, 24, seed=3)
        before = entries(servers, layer)
        assert not one_step(client, layer, x, ids, w)[1]
        done = entries(servers, layer) - before
        assert done.sum() == ids.numel()
        assert sample(registry, "_count", layer) == 1
        assert sample(registry, "_sum", layer) == pytest.approx(done.max() / done.mean())

        victim = servers[1]
        os.kill(victim.process.pid, signal.SIGSTOP)  # the request below waits in its slot
        threading.Timer(0.3, os.kill, (victim.process.pid, signal.SIGKILL)).start()
        assert not one_step(client, layer, x, ids, w)[1]
        assert client.tier.stats["failovers"] >= 1
        assert sample(registry, "_count", layer) == 2
    finally:
        client.close()
