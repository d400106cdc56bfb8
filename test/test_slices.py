"""Sliced experts and tensor-parallel layers (issue 22, docs/switching.md): part p of P of every
expert, along the intermediate dimension, loaded from the checkpoint and computed by the same
kernels; the P parts' weighted sums add up to the whole experts' (float32, top-4, so a token's
sum has four entries and the order of additions is exercised), and to transformers' own
experts; the routing table's per-layer layout, read from the holdings; and real expert servers
holding parts (``--part``) serving a client whose layer is routed in parts, a part's replica
taking over from a killed server.

The reference slices are cut here from the safetensors tensors directly, not by the code under
test, and the reference sums are transformers' experts'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import model_path, open_log
from hf_reference import assert_matches_hf, hf_routed_experts
from sglang_eaas.checkpoint import ModelIdentity, tensor_files
from sglang_eaas.client.client import EaasClient
from sglang_eaas.holdings import Holdings, ServerHoldings
from sglang_eaas.placement import NO_HOLDER, PlacementError
from sglang_eaas.protocol.lines import ControlError, holdings_fields, read_holdings
from sglang_eaas.routing_table import RoutingTable
from sglang_eaas.expert_server.compute import local_experts, weighted_expert_sum
from sglang_eaas.expert_server.experts import load_experts
from sglang_eaas.slices import Part, part_rows
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.tools.make_tiny_model import PRESETS
from tier_steps import one_step, routed_batch


@pytest.fixture(scope="module")
def top4():
    path = model_path(PRESETS["tiny-top4"])
    return path, MoeModelInfo.from_model_path(path)


@pytest.mark.parametrize("parts", [2, 4])
def test_parts_are_the_checkpoints_rows_and_columns(top4, parts):
    path, info = top4
    layer, files = info.moe_layers[1], tensor_files(path)
    width = info.moe_intermediate_size // parts
    for index in range(parts):
        held = load_experts(path, info, {layer: [5, 2]}, torch.float32,
                            part=Part(index, parts))[layer]
        assert held.w13.shape == (2, 2 * width, info.hidden_size)
        assert held.w2.shape == (2, info.hidden_size, width)
        for row, expert in enumerate([5, 2]):
            gate, up, down = (safe_open(files[n], "pt").get_tensor(n)
                              for n in info.expert_tensor_names(layer, expert))
            cut = slice(index * width, (index + 1) * width)
            assert torch.equal(held.w13[row], torch.cat([gate[cut], up[cut]]))
            assert torch.equal(held.w2[row], down[:, cut])
        whole = load_experts(path, info, {layer: [5, 2]}, torch.float32)[layer]
        w13, w2 = part_rows(whole.w13, whole.w2, Part(index, parts))
        assert torch.equal(w13, held.w13) and torch.equal(w2, held.w2)


@pytest.mark.parametrize("kernel", ["fast", "reference"])
@pytest.mark.parametrize("parts", [2, 4])
def test_the_parts_sums_add_up_to_the_whole_experts(top4, kernel, parts):
    path, info = top4
    experts = list(range(info.num_experts))
    hf = hf_routed_experts(path)
    for layer in info.moe_layers[:2]:
        whole = load_experts(path, info, {layer: experts}, torch.float32)[layer]
        sliced = [load_experts(path, info, {layer: experts}, torch.float32,
                               part=Part(i, parts))[layer] for i in range(parts)]
        for tokens in (1, 7, 33):
            x, ids, w = routed_batch(info, tokens, seed=tokens + layer)
            out = weighted_expert_sum(whole, x, local_experts(whole, ids), w, kernel=kernel)
            total = sum(weighted_expert_sum(s, x, local_experts(s, ids), w, kernel=kernel)
                        for s in sliced)
            # the same products, the intermediate dimension summed in P pieces, then added
            torch.testing.assert_close(total, out, rtol=1e-6, atol=1e-6 * float(out.abs().max()))
            assert_matches_hf(total, hf, layer, x, ids, w)


def test_bad_parts_are_refused_in_one_sentence(top4):
    path, info = top4
    with pytest.raises(ValueError, match="does not split into 3 equal parts"):
        Part(0, 3).info(info)
    with pytest.raises(ValueError, match="part 4 of 4 does not exist"):
        Part(4, 4).check(info.moe_intermediate_size)
    with pytest.raises(ValueError, match="does not split"):
        load_experts(path, info, [0], torch.float32, part=Part(1, 5))


# -- the routing table's layout -------------------------------------------------------------
def _parts(parts: int, p: int, experts, layers=(0, 1)) -> ServerHoldings:
    """Part ``p`` of ``parts`` of ``experts`` in every one of ``layers``, no whole expert."""
    return ServerHoldings({layer: () for layer in layers},
                          parts={layer: (parts, [e * parts + p for e in experts])
                                 for layer in layers})


def test_a_layer_is_ep_while_whole_experts_cover_it_else_tp_over_the_parts_that_do():
    tp = Holdings({"a:1": _parts(2, 0, range(4)), "b:1": _parts(2, 1, range(4))})
    table = RoutingTable.build(0, tp, [0, 1], 4)
    assert table.layouts == {0: 2, 1: 2} and table.parts(0) == 2 and not table.missing
    ids = np.array([[3, 0], [1, -1]])
    routed = table.expand(0, ids)
    assert routed.tolist() == [[6, 7, 0, 1], [2, 3, -1, -1]]  # e * 2 + p, -1 kept
    assert table.assign(0, routed).tolist() == [[0, 1, 0, 1], [0, 1, -1, -1]]
    assert table.expand(0, np.zeros((0, 2), dtype=np.int64)).shape == (0, 4)  # an empty batch
    # whole experts in layer 1 too: that layer is EP (both cover it), layer 0 stays TP
    both = tp.with_server("c:1", ServerHoldings({0: [], 1: range(4)}))
    mixed = RoutingTable.build(1, both, [0, 1], 4)
    assert mixed.layouts == {0: 2} and mixed.expand(1, ids) is ids
    assert mixed.assign(1, ids).tolist() == [[2, 2], [2, -1]]
    # the smallest part count that covers a layer routes it
    four = both.with_server("d:1", ServerHoldings({0: [], 1: []}, parts={
        0: (4, [e * 4 + p for e in range(4) for p in range(4) if p == 0])}))
    assert RoutingTable.build(2, four, [0, 1], 4).layouts == {0: 2}


def test_a_layer_missing_a_part_routes_its_other_experts_and_names_the_lost_one():
    held = Holdings({"a:1": _parts(2, 0, range(4)), "b:1": _parts(2, 1, [0, 1, 2])})
    with pytest.raises(PlacementError, match=r"MoE layer 0: experts \[3\] are on no expert"):
        RoutingTable.build(0, held, [0, 1], 4)
    table = RoutingTable.build(0, held, [0, 1], 4, allow_missing=True)
    assert table.layouts == {0: 2, 1: 2} and table.missing == {0: [3], 1: [3]}
    assert table.assign(0, table.expand(0, np.array([[3, 1]]))).tolist() == [
        [0, NO_HOLDER, 0, 1]]
    # whole experts missing more than the parts: the parts route the layer
    fewer = held.with_server("c:1", ServerHoldings({0: [0], 1: [0]}))
    assert RoutingTable.build(1, fewer, [0, 1], 4, allow_missing=True).layouts == {0: 2, 1: 2}


def test_parts_held_travel_in_the_holdings_fields_and_bad_ones_are_refused():
    held = _parts(2, 1, [0, 5], layers=(0,)).with_layer(1, [2, 3])
    message = {"op": "x", **holdings_fields(held)}
    assert message["layer_parts"] == {"0": [2, [1, 11]]}
    rest, back = read_holdings(message)
    assert back == held and back.parts[0].experts() == (0, 5) and rest == {"op": "x"}
    assert "layer_parts" not in holdings_fields(ServerHoldings({0: [1]}))  # unchanged without
    for bad in ({"0": [1, [0]]}, {"0": [2, [0, -1]]}, {"x": [2, [0]]}, {"0": [2]}):
        with pytest.raises(ControlError, match="layer_parts maps MoE layer numbers"):
            read_holdings({"layer_parts": bad})
    with pytest.raises(ControlError, match="hold two parts of one expert"):
        read_holdings({"layer_parts": {"0": [2, [2, 3]]}})


# -- real servers holding parts --------------------------------------------------------------
@pytest.fixture(scope="module")
def part_servers(top4):
    """Whole experts on one server; part 0 of 2 on one; part 1 of 2 on two (a replica)."""
    from sglang_eaas.launcher.local_servers import start_local_servers

    path, _ = top4
    log = open_log("slices-servers")
    started = []
    try:
        for extra in ((), ("--part", "0/2"), ("--part", "1/2"), ("--part", "1/2")):
            started += start_local_servers(path, [["all"]], "float32", max_clients=4,
                                           extra_args=extra, stdout=log)
        yield started
    finally:
        for server in started:
            server.stop()
        log.close()


def _client(top4, servers, name):
    path, info = top4
    return EaasClient([s.address for s in servers], info, ModelIdentity.of(path, info),
                      torch.float32, name)


def test_servers_holding_parts_serve_a_tp_layer_as_the_whole_experts_do(top4, part_servers):
    path, info = top4
    whole, part0, part1, part1_replica = part_servers
    hf = hf_routed_experts(path)
    ep = _client(top4, [whole], "slices-ep")
    tp = _client(top4, [part0, part1], "slices-tp")
    try:
        assert ep.table.layouts == {}
        assert tp.table.layouts == {layer: 2 for layer in info.moe_layers}
        for layer in info.moe_layers[:2]:
            for tokens in (1, 9):
                x, ids, w = routed_batch(info, tokens, seed=100 + tokens + layer)
                expected, failed = one_step(ep, layer, x, ids, w)
                got, failed_tp = one_step(tp, layer, x, ids, w)
                assert not failed and not failed_tp
                torch.testing.assert_close(got, expected, rtol=1e-6,
                                           atol=1e-6 * float(expected.abs().max()))
                assert_matches_hf(got, hf, layer, x, ids, w)
        for conn in tp.connections:  # each part server computed every entry's share
            assert conn.stats().counter("requests") == 4
    finally:
        ep.close()
        tp.close()


def test_a_killed_part_server_leaves_its_parts_replica_serving_with_no_row_lost(top4,
                                                                                part_servers):
    path, info = top4
    _, part0, part1, part1_replica = part_servers
    hf = hf_routed_experts(path)
    tp = _client(top4, [part0, part1, part1_replica], "slices-failover")
    try:
        layer = info.moe_layers[0]
        x, ids, w = routed_batch(info, 12, seed=7)
        got, failed = one_step(tp, layer, x, ids, w)
        assert not failed
        assert_matches_hf(got, hf, layer, x, ids, w)
        part1.process.kill()
        part1.process.wait()
        got, failed = one_step(tp, layer, x, ids, w)  # part 1 goes to its replica
        assert not failed and part1.address not in tp.table.servers
        assert tp.table.layouts[layer] == 2
        assert_matches_hf(got, hf, layer, x, ids, w)
    finally:
        tp.close()
