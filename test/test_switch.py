"""The EP <-> TP switch of the expert tier while it serves (issue 22, docs/switching.md).

Two expert servers of the top-4 checkpoint (experts 0-7 and 8-15), a standalone monitor and a
client that follows it, running steps over every MoE layer on another thread the whole time:
every layer switches EP -> TP (each server adds its part of every expert, then the whole
experts are dropped) and back (whole experts added, the parts dropped). Every step's outputs
must match transformers' experts, none may fail, both layouts must have served steps, and
after the round trip every expert's rows are bit for bit the checkpoint's tensors (read back
from the servers, compared with safetensors' own reads). Then the same under SGLang: eight
streams decoding while every layer switches, token for token as without a switch.
"""

from __future__ import annotations

import re
import threading

import pytest
import requests
import torch
from safetensors import safe_open

from conftest import model_path, open_log, start_server
from hf_reference import assert_matches_hf, hf_routed_experts
from sglang_eaas.checkpoint import ModelIdentity, tensor_files
from sglang_eaas.client.client import EaasClient
from sglang_eaas.elastic.layout_cost import LayerCost
from sglang_eaas.elastic.switch import Switcher, SwitchError, layouts
from sglang_eaas.expert_server.replicas import fetch_from_peer
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import AddParts, DropParts, Stats, call
from sglang_eaas.protocol.lines import Refused
from sglang_eaas.status import render
from sglang_eaas.tools.switch import main as switch_tool
from sglang_eaas.tools.make_tiny_model import PRESETS
from streams import concurrent_streams
from tier_steps import routed_batch, wait_until

TOKEN = "sglang-eaas-test-token"
HEARTBEAT = 0.2


@pytest.fixture(scope="module")
def top4():
    path = model_path(PRESETS["tiny-top4"])
    return path, MoeModelInfo.from_model_path(path)


@pytest.fixture(scope="module")
def tier(top4):
    path, info = top4
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=2.0)).start()
    log = open_log("switch-servers")
    servers = start_local_servers(path, [list(range(8)), list(range(8, 16))], "float32",
                                  max_clients=4, extra_args=("--monitor", monitor.address,
                                                             "--heartbeat", str(HEARTBEAT)),
                                  stdout=log)
    wait_until(lambda: len(monitor.registry.snapshot().servers()) == 2, 15, "registration")
    yield monitor, servers
    for server in servers:
        server.stop()
    monitor.close()
    log.close()


class Steps(threading.Thread):
    """Steps over every MoE layer until stopped, each output checked against transformers'."""

    def __init__(self, client: EaasClient, info: MoeModelInfo, hf):
        super().__init__(daemon=True)
        self.client, self.info, self.hf = client, info, hf
        self.batches = {layer: routed_batch(info, 6, seed=layer) for layer in info.moe_layers}
        self.stop, self.steps, self.failed, self.errors = threading.Event(), 0, [], []
        self.layouts_seen: set[tuple[int, ...]] = set()

    def run(self):
        while not self.stop.is_set():
            self.client.begin_step()
            try:
                self.layouts_seen.add(tuple(self.client.table.parts(layer)
                                            for layer in self.info.moe_layers))
                for layer, (x, ids, w) in self.batches.items():
                    out = self.client.forward(layer, x, ids, w)
                    try:
                        assert_matches_hf(out, self.hf, layer, x, ids, w)
                    except AssertionError as exc:
                        self.errors.append(f"layer {layer}: {exc}")
            except Exception as exc:  # noqa: BLE001 (recorded, the test fails on it)
                self.errors.append(repr(exc))
            finally:
                self.failed += list(self.client.end_step().values())
            self.steps += 1

    def more(self, count: int, what: str) -> None:
        """Wait for ``count`` more steps."""
        at = self.steps
        wait_until(lambda: self.steps >= at + count, 30, what)

    def finish(self) -> None:
        """Stop stepping; no step may have failed a row or differed from transformers'."""
        self.stop.set()
        self.join(30)
        assert not self.errors, self.errors[:3]
        assert not self.failed


def _rows(address: str, layer: int, experts: list[int]):
    stats = call(address, Stats(), TOKEN, 10)
    return fetch_from_peer(address, TOKEN, layer, experts, dict(stats.expert_digests),
                           torch.float32)


def test_every_layer_switches_ep_to_tp_and_back_while_serving(top4, tier):
    path, info = top4
    monitor, servers = tier
    client = EaasClient([s.address for s in servers], info, ModelIdentity.of(path, info),
                        torch.float32, "switch", result_timeout=30.0, monitor=monitor.address,
                        heartbeat=HEARTBEAT)
    steps = Steps(client, info, hf_routed_experts(path))
    steps.start()
    switcher = Switcher(monitor.address, TOKEN, info)
    try:
        wait_until(lambda: steps.steps >= 3, 30, "steps before the switch")
        layers, group = list(info.moe_layers), [s.address for s in servers]
        to_tp = switcher.switch(layers, "tp", group)
        assert [r.layer for r in to_tp] == layers and all(r.parts == 2 for r in to_tp)
        # each server cut half its parts from its own rows, the other half from its peer's
        assert all(r.added == {"self": 16, "peer": 16, "disk": 0} for r in to_tp), to_tp
        assert layouts(switcher.holdings(), info) == {layer: 2 for layer in layers}
        tp_steps = steps.steps
        wait_until(lambda: steps.steps >= tp_steps + 3, 30, "steps in TP")
        for s in servers:  # the whole experts are gone, the parts held
            held = call(s.address, Stats(), TOKEN, 10).holdings
            assert not any(held.values()) and set(held.parts) == set(layers)
        shown = render(monitor.registry.snapshot(), monitor.address)  # python -m ...status
        assert f"layer {layers[0]} (TP over 2 parts): 16 with 1 holder" in shown, shown
        assert "parts: " in shown and "part 0/2 of 0-15" in shown, shown
        with pytest.raises(Refused, match=r"last live holder of experts \[0, 1, 2"):
            call(servers[0].address, DropParts(layers[0]), TOKEN, 10)  # its parts are needed
        to_ep = switcher.switch(layers, "ep", group)  # back to experts 0-7 and 8-15
        assert all(r.parts == 1 for r in to_ep)
        # each server assembled its 8 experts from its own parts and its peer's
        assert all(r.added == {"self": 0, "peer": 16, "disk": 0} for r in to_ep), to_ep
        assert layouts(switcher.holdings(), info) == {layer: 1 for layer in layers}
        ep_steps = steps.steps
        wait_until(lambda: steps.steps >= ep_steps + 3, 30, "steps in EP again")
    finally:
        steps.stop.set()
        steps.join(30)
        client.close()
    assert not steps.errors, steps.errors[:3]
    assert not steps.failed
    assert {(1,) * len(layers), (2,) * len(layers)} <= steps.layouts_seen
    files = tensor_files(path)
    for s, experts in zip(servers, (list(range(8)), list(range(8, 16)))):
        for layer in layers:
            w13, w2 = _rows(s.address, layer, experts)
            for row, e in enumerate(experts):
                gate, up, down = (safe_open(files[n], "pt").get_tensor(n)
                                  for n in info.expert_tensor_names(layer, e))
                assert torch.equal(w13[row], torch.cat([gate, up])) and torch.equal(w2[row], down)


def test_a_server_killed_mid_switch_leaves_the_survivors_to_complete_it(top4):
    """Four servers, every expert twice (A and C: 0-7, B and D: 8-15); EP -> TP with two parts,
    every part twice (A, C: part 0; B, D: part 1). D is killed as soon as the first layer is
    TP: the other layers switch over A, B and C, and back to EP over them; the stepping
    client loses no row and every output stays transformers'."""
    path, info = top4
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=1.0)).start()
    log = open_log("switch-kill-servers")
    placement = [list(range(8)), list(range(8, 16))] * 2
    servers = start_local_servers(path, placement, "float32", max_clients=4,
                                  extra_args=("--monitor", monitor.address, "--heartbeat",
                                              str(HEARTBEAT)), stdout=log)
    a, b, c, d = servers
    client = None
    try:
        wait_until(lambda: len(monitor.registry.snapshot().servers()) == 4, 15, "registration")
        client = EaasClient([s.address for s in servers], info, ModelIdentity.of(path, info),
                            torch.float32, "switch-kill", result_timeout=30.0,
                            monitor=monitor.address, heartbeat=HEARTBEAT)
        steps = Steps(client, info, hf_routed_experts(path))
        steps.start()
        wait_until(lambda: steps.steps >= 3, 30, "steps before the switch")

        def kill_after_first(line: str) -> None:
            if line.startswith(f"MoE layer {info.moe_layers[0]}: TP") and d.process.poll() is None:
                d.process.kill()
                d.process.wait()

        switcher = Switcher(monitor.address, TOKEN, info, say=kill_after_first)
        layers = list(info.moe_layers)
        to_tp = switcher.switch(layers, "tp", [s.address for s in servers], parts=2)
        assert [r.layer for r in to_tp] == layers and d.address in switcher._lost
        survivors = [a.address, b.address, c.address]
        held = switcher.holdings()
        assert d.address not in held or not held[d.address].parts.get(layers[-1])
        assert layouts(held, info) == {layer: 2 for layer in layers}
        steps.more(3, "steps in TP without D")
        switcher.switch(layers, "ep", survivors)
        assert layouts(switcher.holdings(), info) == {layer: 1 for layer in layers}
        steps.more(3, "steps in EP again")
        steps.finish()
    finally:
        if client is not None:
            client.close()
        for server in servers:
            server.stop()
        monitor.close()
        log.close()


def test_parts_added_back_while_retiring_are_reused_and_another_cut_replaces_them(top4, tier):
    _, info = top4
    monitor, servers = tier
    address, layer = servers[0].address, info.moe_layers[2]
    two = [e * 2 for e in range(8)]  # part 0 of 2 of experts 0-7 (held whole here too)
    assert call(address, AddParts(layer, 2, two), TOKEN, 10).from_self == two
    call(address, DropParts(layer, grace=30.0), TOKEN, 10)  # retiring for 30 s
    again = call(address, AddParts(layer, 2, two[:4]), TOKEN, 10)
    assert again.ids == two[:4] and not (again.from_self or again.from_peer or again.from_disk)
    call(address, DropParts(layer, grace=30.0), TOKEN, 10)
    four = call(address, AddParts(layer, 4, [e * 4 + 1 for e in range(8)]), TOKEN, 10)
    assert four.parts == 4 and len(four.from_self) == 8  # the 2-part rows replaced
    with pytest.raises(Refused, match="holds 4-part slices of MoE layer"):
        call(address, AddParts(layer, 2, two), TOKEN, 10)
    call(address, DropParts(layer, grace=0.0), TOKEN, 10)
    wait_until(lambda: not call(address, Stats(), TOKEN, 10).counter("retiring"), 10,
               "the parts freed")


def test_bad_part_requests_are_refused_in_one_sentence(top4, tier):
    _, info = top4
    monitor, servers = tier
    address = servers[0].address
    with pytest.raises(Refused, match="does not split into 3 equal parts"):
        call(address, AddParts(info.moe_layers[0], 3, [0]), TOKEN, 10)
    with pytest.raises(Refused, match="routed part ids .* do not exist"):
        call(address, AddParts(info.moe_layers[0], 2, [64]), TOKEN, 10)
    with pytest.raises(Refused, match="hold two parts of one expert"):
        call(address, AddParts(info.moe_layers[0], 2, [0, 1]), TOKEN, 10)
    with pytest.raises(Refused, match="holds no parts of MoE layer"):
        call(address, DropParts(info.moe_layers[0]), TOKEN, 10)
    switcher = Switcher(monitor.address, TOKEN, info)
    group = [s.address for s in servers]
    with pytest.raises(SwitchError, match="names a server twice"):
        switcher.switch([info.moe_layers[0]], "tp", group + group[:1], parts=2)
    with pytest.raises(SwitchError, match="2 to 2 parts"):
        switcher.switch([info.moe_layers[0]], "tp", group, parts=4)


STREAMS = ("Hello world, the quick brown fox", "def fibonacci(n):\n    if n < 2:",
           "1, 2, 3, 5, 8, 13, 21,", "Expert parallelism routes tokens",
           "Le renard brun saute par-dessus", "{\"name\": \"expert-0\", \"ready\":",
           "Q: What is the capital of France?\nA:", "Tensor parallelism cuts every expert")
STREAM_TOKENS = 64


@pytest.mark.slow
@pytest.mark.cpu_only  # SGLang through the CPU runtime
def test_a_switch_during_generation_changes_no_token(top4, tier, tmp_path):
    """SGLang (float32) with ``--eaas-layout auto`` and a cost model under which TP wins as soon
    as the servers' loads differ: the policy switches every layer to TP by itself (as soon as
    SGLang's warm-up request or the first eight streams give it load windows; logged with its
    reason, counted in ``/metrics``), once (the dwell). Then the
    same streams in TP, with every layer switched back to EP while they decode, and to TP
    again: not one token differs from the first run, and no request fails."""
    path, info = top4
    monitor, servers = tier
    cost = tmp_path / "tp-wins.json"  # no per-message or per-entry cost, servers in parallel
    cost.write_text(LayerCost(0.0, 0.0, 0.0, 10.0, 10.0, parallel=100.0).to_json())
    sglang = start_server(path, "--eaas", "--eaas-monitor", monitor.address, "--enable-metrics",
                          "--eaas-layout", "auto", "--eaas-layout-cost", str(cost),
                          "--eaas-layout-margin", "0.01", "--eaas-layout-patience", "1",
                          "--eaas-layout-dwell", "3600", "--eaas-load-window", "4",
                          name="switch-sglang")
    switcher = Switcher(monitor.address, TOKEN, info)
    layers, group = list(info.moe_layers), [s.address for s in servers]
    tp = {layer: 2 for layer in layers}
    try:
        first = concurrent_streams(sglang.url, STREAMS, STREAM_TOKENS)  # the policy switches
        wait_until(lambda: "every MoE layer is TP now" in sglang.log_path.read_text(), 60,
                   "the policy's switch to TP")
        assert layouts(switcher.holdings(), info) == tp
        log = sglang.log_path.read_text()
        assert re.search(r"eaas layout: switching every MoE layer to TP: [\d.]+ tokens per "
                         r"step: TP predicted .* less, margin 1%", log), log[-3000:]
        assert concurrent_streams(sglang.url, STREAMS, STREAM_TOKENS) == first
        metrics = requests.get(f"{sglang.url}/metrics", timeout=30).text
        assert re.search(r'^sglang_eaas_layout_switches_total\{to="tp"\} 1\.0$', metrics,
                         re.M), metrics
        assert re.search(r'^sglang_eaas_layer_parts\{[^}]*\} 2\.0$', metrics, re.M)
        assert concurrent_streams(sglang.url, STREAMS, STREAM_TOKENS,
                                  lambda: switcher.switch(layers, "ep", group)) == first
        assert concurrent_streams(sglang.url, STREAMS, STREAM_TOKENS,
                                  lambda: switcher.switch(layers, "tp", group)) == first
        assert layouts(switcher.holdings(), info) == tp
        assert sglang.log_path.read_text().count("eaas layout: switching") == 1  # the dwell
        assert "Traceback" not in sglang.log_path.read_text()
    finally:
        sglang.stop()
        switcher.switch(layers, "ep", group)  # as the module's tier began


def test_the_switch_tool(top4, tier, capsys):
    """``python -m sglang_eaas.tools.switch``: layer 1 to TP and back from a shell, and a bad
    argument refused in one sentence."""
    path, info = top4
    monitor, servers = tier
    base = ["--monitor", monitor.address, "--model-path", str(path), "--token", TOKEN]
    layer = info.moe_layers[1]
    assert switch_tool(base + ["--to", "tp", "--layers", str(layer)]) == 0
    out = capsys.readouterr().out
    assert f"MoE layer {layer}: TP in" in out and f"{layer}: 2" in out
    assert switch_tool(base + ["--to", "ep", "--layers", str(layer),
                               "--group", ",".join(s.address for s in servers)]) == 0
    assert "switched 1 MoE layers" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        switch_tool(base + ["--to", "ep", "--parts", "2"])
    assert exited.value.code == 2
    assert "--parts applies with --to tp" in capsys.readouterr().err
