"""The versioned routing table: servers by stable id, per-layer holders, epochs, and a client that
swaps tables only between steps."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from conftest import open_log

from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.holdings import AdapterExpert, Holdings, ServerHoldings
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import NO_HOLDER, PlacementError
from sglang_eaas.routing_table import RoutingTable

LAYERS = [0, 1]


def test_tables_name_servers_by_id_and_hold_per_layer_placements():
    table = RoutingTable.build(3, Holdings({"a:1": {0: [0, 1], 1: [0]},
                                            "b:1": {0: [2, 3], 1: [1, 2, 3]}}), LAYERS, 4)
    assert table.servers == ("a:1", "b:1") and table.epoch == 3
    assert table.holdings == {"a:1": {0: [0, 1], 1: [0]}, "b:1": {0: [2, 3], 1: [1, 2, 3]}}
    ids = np.array([[1, 0], [1, 3]])
    assert table.assign(0, ids).tolist() == [[0, 0], [0, 1]]  # expert 1: server a in layer 0
    assert table.assign(1, ids).tolist() == [[1, 0], [1, 1]]  # and server b in layer 1


def test_a_new_epoch_without_a_server_or_with_one_more():
    table = RoutingTable.uniform(0, {"a:1": [0, 1, 2], "b:1": [2, 3], "c:1": [0, 1, 3]},
                                 LAYERS, 4)
    fewer = table.without("b:1")
    assert fewer.epoch == 1 and fewer.servers == ("a:1", "c:1")
    assert fewer.holdings["a:1"] == {0: [0, 1, 2], 1: [0, 1, 2]}
    assert table.servers == ("a:1", "b:1", "c:1")  # the old table is unchanged
    with pytest.raises(PlacementError, match=r"MoE layer 0: experts \[2\] are on no expert"):
        fewer.without("a:1")  # expert 2's last holder
    more = fewer.with_server("d:1", {0: [2], 1: [2, 3]})
    assert more.epoch == 2 and more.servers == ("a:1", "c:1", "d:1")
    assert more.without("a:1").holdings["d:1"] == {0: [2], 1: [2, 3]}
    with pytest.raises(PlacementError, match="say nothing about MoE layer 1"):
        RoutingTable.build(0, Holdings({"a:1": {0: [0, 1, 2, 3]}}), LAYERS, 4)


@pytest.fixture(scope="module")
def servers(tiny_qwen3):
    from sglang_eaas.launcher.local_servers import start_local_servers

    log = open_log("routing-table-servers")
    local = start_local_servers(tiny_qwen3, [[0, 1, 2, 3], [4, 5, 6, 7, 0]], "float32",
                                max_clients=2, stdout=log)
    yield local
    for s in local:
        s.stop()
    log.close()


@pytest.fixture()
def client(servers, tiny_qwen3):
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    made = EaasClient([s.address for s in servers], info, ModelIdentity.of(tiny_qwen3, info),
                      torch.float32, "routing-table")
    yield made
    made.close()


def _requests(conn) -> int:
    return conn.stats().counter("requests")


def test_a_staged_table_is_adopted_at_the_next_steps_first_layer(client, servers):
    """Expert 0 has a replica on server 1 in table 0; table 1 drops it. A step already under way
    (layer 0 done) finishes on table 0; the next step uses table 1, and server 1 then gets none
    of expert 0's tokens."""
    a, b = (s.address for s in servers)
    x, w = torch.randn(6, 64), torch.rand(6, 2)
    only_zero = torch.tensor([[0, -1]] * 6)
    reference = client.forward(0, x, only_zero, w)
    conn_b = client._by_id[b]
    before = _requests(conn_b)
    client.forward(0, x, only_zero, w)
    assert _requests(conn_b) == before + 1  # table 0: three of the six tokens go to server 1

    client.stage(RoutingTable.uniform(1, {a: [0, 1, 2, 3], b: [4, 5, 6, 7]}, LAYERS, 8))
    mid_step = client.forward(1, x, only_zero, w)  # layer 1 of the step under way: table 0
    assert client.table.epoch == 0 and _requests(conn_b) == before + 2
    out = client.forward(0, x, only_zero, w)  # next step: table 1
    assert client.table.epoch == 1 and _requests(conn_b) == before + 2  # server 1 got nothing
    # The same sums; the last bits may differ: server 0 now computes six rows of expert 0 in one
    # F.linear instead of three (its row blocking depends on the row count).
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    assert mid_step.shape == x.shape
    with pytest.raises(PlacementError, match="not newer than the table in use"):
        client.stage(RoutingTable.uniform(1, {a: [0, 1, 2, 3], b: [4, 5, 6, 7]}, LAYERS, 8))
    with pytest.raises(PlacementError, match=r"names servers \['elsewhere:1'\]"):
        client.stage(RoutingTable.uniform(2, {"elsewhere:1": list(range(8))}, LAYERS, 8))


def test_no_step_sees_two_tables(client, servers):
    """Tables staged from another thread while steps run: every step's layers all read one
    table (the epoch each layer used is the same within a step), and the sums do not change."""
    a, b = (s.address for s in servers)
    tables = [{a: [0, 1, 2, 3], b: [4, 5, 6, 7, 0]}, {a: [0, 1, 2, 3], b: [4, 5, 6, 7]}]
    x, w = torch.randn(5, 64), torch.rand(5, 2)
    ids = torch.tensor([[0, 4], [0, 1], [5, 0], [7, 2], [0, 3]])
    expected = [client.forward(layer, x, ids, w) for layer in LAYERS]
    stop, staged = threading.Event(), [0]

    def stager():
        while not stop.is_set():
            epoch = staged[0] + 1
            try:
                client.stage(RoutingTable.uniform(epoch, tables[epoch % 2], LAYERS, 8))
                staged[0] = epoch
            except PlacementError:
                pass
            stop.wait(0.001)

    thread = threading.Thread(target=stager)
    thread.start()
    seen = []
    try:
        for _ in range(60):
            epochs = []
            for layer in LAYERS:
                out = client.forward(layer, x, ids, w)
                epochs.append(client.table.epoch)
                torch.testing.assert_close(out, expected[layer], rtol=1e-6, atol=1e-6)
            seen.append(epochs)
    finally:
        stop.set()
        thread.join()
    assert all(first == second for first, second in seen)
    assert len({first for first, _ in seen}) > 1  # tables really changed meanwhile


def test_servers_holding_other_experts_in_each_layer(tiny_qwen3, client):
    """Two servers that swap halves between the layers (--layer-experts): the client's table
    follows each layer's holders, and the sums equal the uniform placement's."""
    from sglang_eaas.launcher.local_servers import start_local_servers

    info = MoeModelInfo.from_model_path(tiny_qwen3)
    log = open_log("routing-table-per-layer-servers")
    swapped = start_local_servers(tiny_qwen3, [{0: [0, 1, 2, 3], 1: [4, 5, 6, 7]},
                                               {0: [4, 5, 6, 7], 1: [0, 1, 2, 3]}],
                                  "float32", max_clients=1, stdout=log)
    try:
        per_layer = EaasClient([s.address for s in swapped], info,
                               ModelIdentity.of(tiny_qwen3, info), torch.float32, "per-layer")
        try:
            a, b = (s.address for s in swapped)
            assert per_layer.table.holdings == {a: {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]},
                                                b: {0: [4, 5, 6, 7], 1: [0, 1, 2, 3]}}
            x, w = torch.randn(7, 64), torch.rand(7, 2)
            ids = torch.randint(0, 8, (7, 2))
            for layer in LAYERS:
                torch.testing.assert_close(per_layer.forward(layer, x, ids, w),
                                           client.forward(layer, x, ids, w),
                                           rtol=1e-6, atol=1e-6)
            assert per_layer._by_id[a].stats().holdings == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
        finally:
            per_layer.close()
    finally:
        for s in swapped:
            s.stop()
        log.close()


def test_adapter_experts_two_servers_describe_differently_are_routed_nowhere():
    """Two SGLang servers that placed two adapters under one physical id at once: each server
    describes that id as its own adapter's expert. No holder can be trusted to be the expert a
    request was rerouted to, so the id goes to no server (the rows fail instead of reaching the
    other adapter's weights); the model's experts and the agreed ids are routed as before."""
    layer, x, y = 3, AdapterExpert("x", 1, "dx"), AdapterExpert("y", 2, "dy")

    def described(a: dict, b: dict) -> Holdings:
        return Holdings({"a": ServerHoldings({layer: [0, 1, 4, 5]}, {layer: a}),
                         "b": ServerHoldings({layer: [2, 3, 4, 5]}, {layer: b})})

    agreed = RoutingTable.build(1, described({4: x, 5: y}, {4: x, 5: y}), [layer], 8,
                                base_experts=4)
    assert agreed.untrusted == {} and agreed.adapters() == {"x": {layer: {1: 4}},
                                                            "y": {layer: {2: 5}}}
    assert sorted(agreed.assign(layer, np.array([[4], [4]])).ravel().tolist()) == [0, 1]

    differ = RoutingTable.build(1, described({4: x, 5: y}, {4: y, 5: y}), [layer], 8,
                                base_experts=4)
    assert differ.untrusted == {layer: (4,)}
    assert differ.adapters() == {"y": {layer: {2: 5}}}
    assert differ.missing == {}  # the model's experts are all held
    assert differ.holdings["b"][layer] == (2, 3, 4, 5)  # what the servers say they hold
    got = differ.assign(layer, np.array([[4, 0], [5, 3]]))
    assert got[0, 0] == NO_HOLDER and got[0, 1] == 0 and got[1, 1] == 1
    assert got[1, 0] in (0, 1)
    # the tables that follow (a server leaves, one changes) are built the same way
    assert differ.without("a", allow_missing=True).untrusted == {}
    assert differ.with_server("a", {layer: [0, 1, 4]}).untrusted == {layer: (4,)}
