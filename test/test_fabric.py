"""The weight fabric (docs/elastic.md, "Weight fabric"): expert weights kept in ibgda regions
and moved between servers one-sidedly, mapped in place where the layout allows.

Servers run in this process (their control endpoints on threads) so that the test can look at
what each holds; every weight is checked against the checkpoint's tensors as safetensors reads
them, not through the code under test. The last test kills a lending server process."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch
from safetensors import safe_open

from conftest import open_log
from hf_reference import assert_matches_hf, hf_routed_experts
from sglang_eaas.checkpoint import ModelIdentity, tensor_files
from sglang_eaas.client.client import EaasClient
from sglang_eaas.expert_server.experts import load_experts, row_experts
from sglang_eaas.expert_server.fabric import runs
from sglang_eaas.expert_server.server import ExpertServer, ExpertServerConfig
from sglang_eaas.expert_server.weight_store import WeightStore
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import (
    AddExperts, DropExperts, ExportWeights, ReleaseWeights, call, probe,
)
from sglang_eaas.protocol.lines import Refused
from tier_steps import one_step, routed_batch, wait_until

import ibgda
from ibgda.backends.shm import remove_orphans

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]


def checkpoint_rows(model, info: MoeModelInfo, layer: int, expert: int, dtype=torch.float32):
    """One expert's ``w13`` (gate then up) and ``w2``, read with safetensors directly."""
    files = tensor_files(model)
    gate, up, down = info.expert_tensor_names(layer, expert)
    parts = []
    for name in (gate, up, down):
        with safe_open(files[name], "pt") as f:
            parts.append(f.get_tensor(name).to(dtype))
    return torch.cat(parts[:2]), parts[2]


def assert_holds_checkpoint(server: ExpertServer, model, layer: int, experts: list[int]):
    held = server.held.layers[layer]
    for e in experts:
        row = int(held.local_index[e])
        w13, w2 = checkpoint_rows(model, server.info, layer, e, held.w13.dtype)
        assert torch.equal(held.w13[row], w13) and torch.equal(held.w2[row], w2), (layer, e)


def shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"ibgda-{os.getpid()}-")}


def test_rows_in_fabric_regions_are_the_checkpoints_and_go_with_their_last_reference(
        tiny_qwen3, info):
    before = shm_files()
    store = WeightStore(ibgda.create_transport("shm"), info, torch.float32)
    layers = load_experts(tiny_qwen3, info, [1, 4, 6], torch.float32, store)
    plain = load_experts(tiny_qwen3, info, [1, 4, 6], torch.float32)
    assert len(shm_files() - before) == len(info.moe_layers)  # one region per layer version
    for layer, rows in layers.items():
        assert rows.backing is not None and rows.backing.rows == 3
        assert torch.equal(rows.w13, plain[layer].w13) and torch.equal(rows.w2, plain[layer].w2)
        for row, e in enumerate([1, 4, 6]):
            w13, w2 = checkpoint_rows(tiny_qwen3, info, layer, e)
            assert torch.equal(rows.w13[row], w13) and torch.equal(rows.w2[row], w2)
        assert row_experts(rows).tolist() == [1, 4, 6]
    keep = layers[info.moe_layers[0]].w13  # a view outlives its layer: still mapped
    del layers, rows  # (the loop kept the last layer)
    gc.collect()
    assert shm_files() == before  # every region's file unlinked
    assert torch.equal(keep[0], checkpoint_rows(tiny_qwen3, info, info.moe_layers[0], 1)[0])


def test_runs_group_consecutive_rows():
    assert runs([4, 5, 6, 0, 2, 3]) == [(0, 3, 4), (3, 1, 0), (4, 2, 2)]
    assert runs([]) == []


@pytest.fixture()
def started(tiny_qwen3):
    made = []

    def start(experts=(), layer_experts=None, **fields) -> ExpertServer:
        server = ExpertServer(ExpertServerConfig(
            tiny_qwen3, tuple(experts), token=TOKEN, layer_experts=layer_experts or {},
            **fields))
        server.start()
        made.append(server)
        return server

    yield start
    for server in made:
        server.close()


def test_fills_over_the_fabric_map_read_and_convert(started, tiny_qwen3, info):
    """A layer the receiver holds none of is mapped from the holder (no copy); one it holds
    some of gets a new version with the rows read one-sidedly; a bfloat16 server reads a
    float32 holder's rows and converts them; a 'copy' server never maps."""
    first, second = info.moe_layers[0], info.moe_layers[1]
    holder = started(range(8))
    receiver = started(layer_experts={first: (0, 1), second: ()})
    reply = call(receiver.address, AddExperts(second, [6, 2, 3], holder.address), TOKEN)
    assert reply.from_peer == [6, 2, 3] and reply.layer_experts == [2, 3, 6]
    mapped = receiver.held.layers[second]
    assert mapped.backing.mapped and mapped.w13.shape[0] == 8  # the holder's rows, in place
    assert mapped.w13.data_ptr() != holder.held.layers[second].w13.data_ptr()  # its own mapping
    assert_holds_checkpoint(receiver, tiny_qwen3, second, [2, 3, 6])
    reply = call(receiver.address, AddExperts(first, [5, 4, 7], holder.address), TOKEN)
    assert reply.from_peer == [5, 4, 7] and reply.layer_experts == [0, 1, 4, 5, 7]
    assert not receiver.held.layers[first].backing.mapped
    assert receiver.held.layers[first].w13.shape[0] == 5
    assert_holds_checkpoint(receiver, tiny_qwen3, first, [0, 1, 4, 5, 7])
    # a mapped layer is lent on as a copy of its rows (its holder may retire its version)
    third = started(layer_experts={first: (0,), second: ()}, weight_fabric="copy")
    reply = call(third.address, AddExperts(second, [6, 2], receiver.address), TOKEN)
    assert reply.from_peer == [6, 2]
    assert probe(third.address, TOKEN).counters.get("fabric_fallbacks", 0) == 0
    assert_holds_checkpoint(third, tiny_qwen3, second, [2, 6])
    # adding to a mapped layer makes a version of its own with only the rows it holds
    call(receiver.address, AddExperts(second, [0], holder.address), TOKEN)
    assert not receiver.held.layers[second].backing.mapped
    assert receiver.held.layers[second].w13.shape[0] == 4
    assert_holds_checkpoint(receiver, tiny_qwen3, second, [0, 2, 3, 6])
    counters = probe(receiver.address, TOKEN).counters
    assert counters["replicas_mapped"] == 3 and counters["replicas_read"] == 4
    assert counters.get("fabric_fallbacks", 0) == 0
    assert probe(receiver.address, TOKEN).weight_bytes == 9 * (
        mapped.w13[0].nbytes + mapped.w2[0].nbytes)

    half = started(layer_experts={first: (), second: (1,)}, dtype="bfloat16",
                   weight_fabric="copy")
    call(half.address, AddExperts(first, [3, 2], holder.address), TOKEN)
    assert half.held.layers[first].w13.dtype == torch.bfloat16
    assert not half.held.layers[first].backing.mapped  # copy mode, and another dtype
    assert_holds_checkpoint(half, tiny_qwen3, first, [2, 3])


def test_spare_rows_take_adds_in_place_and_a_standby_fills_its_reserved_regions(
        started, tiny_qwen3, info):
    """With spare rows an add writes only its new rows, past the held ones in the layer's own
    region (those neither copied nor moved); a drop unmaps the id and leaves every row where
    it is; an add that does not fit compacts the live rows into a new region with spare rows
    again. A standby server's first fill of a layer lands in the region it reserved."""
    first, second = info.moe_layers
    monitor = MonitorServer(MonitorConfig(token=TOKEN)).start()
    try:
        holder = started(range(8), monitor=monitor.address)
        receiver = started(layer_experts={first: (0, 1), second: (0,)}, spare_experts=3,
                           weight_fabric="copy", monitor=monitor.address)
        before = receiver.held.layers[first]
        assert (before.backing.rows, before.backing.used, before.w13.shape[0]) == (5, 2, 2)
        kept_row = before.w13[1].clone()
        call(receiver.address, AddExperts(first, [5, 4], holder.address), TOKEN)
        after = receiver.held.layers[first]
        assert after.backing is before.backing and after.w13.data_ptr() == before.w13.data_ptr()
        assert after.w13.shape[0] == 4 and after.local_index[[5, 4]].tolist() == [2, 3]
        assert torch.equal(after.w13[1], kept_row)  # held rows untouched
        assert_holds_checkpoint(receiver, tiny_qwen3, first, [0, 1, 4, 5])

        call(receiver.address, DropExperts(first, [1], grace=0.0), TOKEN)
        wait_until(lambda: int(receiver.held.layers[first].local_index[1]) < 0, 10, "the drop")
        dropped = receiver.held.layers[first]
        assert dropped.backing is before.backing and dropped.w13.shape[0] == 4  # row 1: dead
        assert row_experts(dropped).tolist() == [0, -1, 5, 4]

        call(receiver.address, AddExperts(first, [2, 3], holder.address), TOKEN)  # 1 row free
        compacted = receiver.held.layers[first]
        assert compacted.backing is not before.backing
        assert (compacted.backing.rows, compacted.backing.used) == (5 + 3, 5)
        assert row_experts(compacted).tolist() == [0, 5, 4, 2, 3]  # live rows, in order
        assert_holds_checkpoint(receiver, tiny_qwen3, first, [0, 2, 3, 4, 5])

        standby = started(layer_experts={first: (), second: ()}, spare_experts=4,
                          weight_fabric="copy", monitor=monitor.address)
        assert standby.held.store.reserved() == 2  # one pre-faulted region per MoE layer
        call(standby.address, AddExperts(second, [7, 1, 6], holder.address), TOKEN)
        filled = standby.held.layers[second]
        assert standby.held.store.reserved() == 1
        assert (filled.backing.rows, filled.backing.used) == (4, 3)
        assert_holds_checkpoint(standby, tiny_qwen3, second, [1, 6, 7])
    finally:
        monitor.close()


def test_a_mapped_region_does_not_change_under_its_holders_appends_drops_and_compaction(
        started, tiny_qwen3, info):
    """A peer that mapped a holder's layer keeps seeing the same rows while the holder appends
    replicas into that region's spare rows, drops one (its row stays), and then compacts the
    layer into a new region (the old one unlinked: the mapping keeps its memory)."""
    first = info.moe_layers[0]
    monitor = MonitorServer(MonitorConfig(token=TOKEN)).start()
    try:
        source = started(range(8), monitor=monitor.address)
        holder = started(layer_experts={first: (0, 1, 2), info.moe_layers[1]: (0,)},
                         spare_experts=2, monitor=monitor.address)
        reader = started(layer_experts={first: (), info.moe_layers[1]: (0,)},
                         monitor=monitor.address)
        call(reader.address, AddExperts(first, [0, 1, 2], holder.address), TOKEN)
        mapped = reader.held.layers[first]
        assert mapped.backing.mapped and mapped.w13.shape[0] == 3
        before = mapped.w13.clone(), mapped.w2.clone()
        call(holder.address, AddExperts(first, [5, 6], source.address), TOKEN)  # in place
        assert holder.held.layers[first].backing.free == 0
        call(holder.address, DropExperts(first, [1], grace=0.0), TOKEN)
        wait_until(lambda: int(holder.held.layers[first].local_index[1]) < 0, 10, "the drop")
        call(holder.address, AddExperts(first, [7], source.address), TOKEN)  # compacts
        assert holder.held.layers[first].backing.rows == 5 + 2  # 4 live, 1 new, 2 spare
        gc.collect()
        assert torch.equal(mapped.w13, before[0]) and torch.equal(mapped.w2, before[1])
        assert_holds_checkpoint(reader, tiny_qwen3, first, [0, 1, 2])
        assert_holds_checkpoint(holder, tiny_qwen3, first, [0, 2, 5, 6, 7])
    finally:
        monitor.close()


def test_a_fill_over_mooncake_reads_with_the_transfer_engine(started, tiny_qwen3, info):
    """Mooncake regions are not mapped into the reader: the rows come by Transfer Engine reads
    (TCP on this host; RDMA or TCP across hosts), land in the receiver's spare rows, and equal
    the checkpoint's; nothing falls back to the control channel."""
    first, second = info.moe_layers
    holder = started(range(8), transport="mooncake")
    receiver = started(layer_experts={first: (0,), second: (0,)}, transport="mooncake",
                       spare_experts=4)
    assert receiver.held.store.backend == "mooncake"
    before = receiver.held.layers[first].backing
    reply = call(receiver.address, AddExperts(first, [3, 5, 6], holder.address), TOKEN)
    assert reply.from_peer == [3, 5, 6]
    assert receiver.held.layers[first].backing is before  # into the spare rows
    counters = probe(receiver.address, TOKEN).counters
    assert counters["replicas_read"] == 3 and counters.get("fabric_fallbacks", 0) == 0
    row = receiver.held.layers[first]
    assert counters["fabric_bytes_read"] == 3 * (row.w13[0].nbytes + row.w2[0].nbytes)
    assert_holds_checkpoint(receiver, tiny_qwen3, first, [0, 3, 5, 6])


def test_leases_keep_a_lent_version_and_refusals(started, info):
    layer = info.moe_layers[0]
    holder = started(range(4))
    lent = call(holder.address, ExportWeights(layer, [2, 0]), TOKEN)
    assert lent.expert_rows == [2, 0] and lent.rows == 4 and holder.exports.lent() == 1
    region = ibgda.create_transport("shm").connect(ibgda.RegionHandle.from_dict(lent.region))
    lent_w13 = region.mapped(0, 4).clone()
    # the holder changes that layer (a new version); the lent one stays readable
    holder.held.swap_layer(layer, None)
    gc.collect()
    again = ibgda.create_transport("shm").connect(ibgda.RegionHandle.from_dict(lent.region))
    assert torch.equal(again.mapped(0, 4), lent_w13)
    again.close()
    region.close()
    call(holder.address, ReleaseWeights(lent.lease), TOKEN)
    assert holder.exports.lent() == 0
    gc.collect()
    assert lent.region["name"] not in os.listdir("/dev/shm")  # released: the version went
    with pytest.raises(Refused, match="does not hold experts \\[7\\]") as refused:
        call(holder.address, ExportWeights(info.moe_layers[1], [7]), TOKEN)
    assert refused.value.reason == "weights_not_held"
    plain = started(range(4), weight_fabric="off")
    with pytest.raises(Refused, match="plain memory") as refused:
        call(plain.address, ExportWeights(layer, [1]), TOKEN)
    assert refused.value.reason == "no_weight_fabric"
    # a server without a fabric still fills from a peer, over the control channel
    receiver = started(layer_experts={layer: (0,), info.moe_layers[1]: (0,)},
                       weight_fabric="off")
    reply = call(receiver.address, AddExperts(layer, [3], plain.address), TOKEN)
    assert reply.from_peer == [3]
    assert probe(receiver.address, TOKEN).counter("fabric_fallbacks") == 0


def test_mapped_rows_serve_after_their_holder_is_killed(tiny_qwen3, info):
    """A server maps a whole layer from a peer process, then the peer is killed (kill -9) and
    its region files removed: the mapped rows stay (the memory goes with its last mapping),
    and a client's sums over that layer, all from the survivor, equal transformers'."""
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=2.0)).start()
    log = open_log("fabric-kill")
    first, second = info.moe_layers[0], info.moe_layers[1]
    servers = start_local_servers(
        tiny_qwen3, [list(range(8)), {first: list(range(8)), second: []}], "float32",
        max_clients=2, extra_args=("--monitor", monitor.address, "--heartbeat", "0.1"),
        stdout=log)
    client = None
    try:
        wait_until(lambda: len(monitor.registry.snapshot().servers()) == 2, 20, "registration")
        reply = call(servers[1].address, AddExperts(second, list(range(8)), servers[0].address),
                     TOKEN)
        assert reply.from_peer == list(range(8))
        assert probe(servers[1].address, TOKEN).counter("replicas_mapped") == 8
        servers[0].process.kill()
        servers[0].process.wait()
        remove_orphans()  # the dead holder's region files are unlinked; the mapping stays
        wait_until(lambda: len(monitor.registry.snapshot().servers()) == 1, 20, "the loss")
        client = EaasClient([servers[1].address], info, ModelIdentity.of(tiny_qwen3),
                            torch.float32, "fabric-kill", monitor=monitor.address,
                            heartbeat=0.1)
        hf = hf_routed_experts(tiny_qwen3)
        x, ids, w = routed_batch(info, 24, seed=5)
        out, failed = one_step(client, second, x, ids, w)
        assert not failed
        assert_matches_hf(out, hf, second, x, ids, w)
        time.sleep(0.3)
        assert probe(servers[1].address, TOKEN).counter("tokens") >= 24
    finally:
        if client is not None:
            client.close()
        for server in servers:
            server.stop()
        monitor.close()
        log.close()
