"""The registrar against another SGLang server placing an adapter under the same physical ids
at the same moment: it rolls its own copies back and places again under free ids, whether the
collision shows as a server's refusal (``adapter_slot_taken``) or as an id two servers describe
differently. The expert servers are a fake here (their holdings and descriptions, as the
routing table reads them from the monitor); their real refusal is tested in test_replicas."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_eaas.esft import registrar as R
from sglang_eaas.esft.adapter import AdapterError, load_adapter
from sglang_eaas.holdings import AdapterExpert, Holdings, ServerHoldings
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.control import AddExperts, DropExperts, HoldingsChange
from sglang_eaas.protocol.lines import Refused
from sglang_eaas.routing_table import RoutingTable

MODEL = Path(__file__).resolve().parent.parent / "models" / "tiny-moe-stdlib"
INFO = MoeModelInfo.from_model_path(MODEL)
E = INFO.num_experts
SLOTS = 8


class FakeTier:
    """Expert servers as the table sees them: what each holds, and which held ids are which
    adapter's experts. The registrar's ``call`` is routed here."""

    def __init__(self, servers: list[str]):
        layers = list(INFO.moe_layers)
        self.holdings = {s: {layer: [e for e in range(E) if e % len(servers) == i]
                             for layer in layers} for i, s in enumerate(servers)}
        self.described: dict[str, dict[int, dict[int, AdapterExpert]]] = {
            s: {} for s in servers}
        self.calls: list[tuple[str, str, AddExperts | DropExperts]] = []
        self.before_add = None  # called once before the next add: another SGLang's placement

    @property
    def table(self) -> RoutingTable:
        return RoutingTable.build(1, Holdings({s: ServerHoldings(held, self.described[s])
                                               for s, held in self.holdings.items()}),
                                  list(INFO.moe_layers), E + SLOTS, base_experts=E)

    def place(self, server: str, layer: int, ids: list[int], what: list[tuple]) -> None:
        self.holdings[server][layer] = sorted(set(self.holdings[server][layer]) | set(ids))
        self.described[server].setdefault(layer, {}).update(
            zip(ids, (AdapterExpert(*w) for w in what)))

    def call(self, server, request, token, timeout):
        self.calls.append((server, request.op, request))
        layer, ids = request.layer, request.experts
        if isinstance(request, DropExperts):
            self.holdings[server][layer] = [e for e in self.holdings[server][layer]
                                            if e not in ids]
            for p in ids:
                self.described[server].get(layer, {}).pop(p, None)
            return HoldingsChange(self.holdings[server][layer])
        assert isinstance(request, AddExperts)
        if self.before_add is not None:
            hook, self.before_add = self.before_add, None
            hook()
        mine = self.described[server].get(layer, {})
        taken = [p for p in ids if p in mine and mine[p].adapter != request.adapter]
        if taken:
            raise Refused(f"expert server {server} holds other experts under physical ids "
                          f"{taken} of MoE layer {layer}", "adapter_slot_taken")
        adapter = load_adapter(request.adapter_path, INFO)
        digests = adapter.digests(INFO, {layer: request.replaces})[layer]
        self.place(server, layer, ids, [(request.adapter, b, digests[b])
                                        for b in request.replaces])
        return HoldingsChange(self.holdings[server][layer], from_disk=list(ids))


class FakeClient:
    def __init__(self, tier: FakeTier):
        self.info, self.tier = INFO, tier

    @property
    def table(self) -> RoutingTable:
        return self.tier.table


@pytest.fixture
def tier(monkeypatch):
    tier = FakeTier(["s0", "s1", "s2"])
    monkeypatch.setattr(R, "call", tier.call)
    monkeypatch.setattr(R, "RETRY_PAUSE", (0.0, 0.01))
    monkeypatch.setattr(R, "POLL", 0.001)
    return tier


def _other_takes(tier: FakeTier, plan: dict, same_server: bool) -> dict[int, set[int]]:
    """Another SGLang's adapter ``other`` placed under the ids of ``plan`` (ours), each on the
    server ours goes to or on another one (base expert 0, a digest of its own), as the monitor
    would show it; MoE layer -> the ids it took."""
    servers = sorted(tier.holdings)
    taken: dict[int, set[int]] = {}
    for server, layers in plan.items():
        there = server if same_server else servers[(servers.index(server) + 1) % len(servers)]
        for layer, pairs in layers.items():
            ids = [p for p, _ in pairs]
            tier.place(there, layer, ids, [("other", 0, "d" * 64)] * len(ids))
            taken.setdefault(layer, set()).update(ids)
    return taken


def _check_placed(tier: FakeTier, registered, taken: dict[int, set[int]],
                  rolled_back: dict | None) -> None:
    table = tier.table
    assert table.untrusted == {}
    adapters = table.adapters()
    assert adapters["pytests"] == registered.mapping
    assert set(adapters) == {"pytests", "other"}
    for layer, by_base in registered.mapping.items():
        assert not set(by_base.values()) & taken[layer]  # none the other adapter took
        assert all(E <= p < E + SLOTS for p in by_base.values())
    drops = [c for c in tier.calls if c[1] == "drop_experts"]
    # refused by a server at the first add, nothing was placed; described differently, every
    # copy of the first placement was dropped again
    assert len(drops) == (sum(len(layers) for layers in rolled_back.values())
                          if rolled_back else 0)


@pytest.mark.parametrize("where", ["another server", "the same server"])
def test_a_collision_rolls_back_and_places_again_under_free_ids(tier, where):
    adapter = load_adapter(MODEL / "adapters" / "pytests", INFO)
    said = []
    registrar = R.Registrar(FakeClient(tier), "token", SLOTS, timeout=5.0, say=said.append)
    taken, first = {}, {}

    def other():  # the other SGLang read the same table: the same lowest free ids
        first.update(registrar._plan(registrar._allocate("pytests", adapter)))
        taken.update(_other_takes(tier, first, where == "the same server"))

    tier.before_add = other
    registered = registrar.register("pytests", adapter)
    _check_placed(tier, registered, taken, None if where == "the same server" else first)
    assert any("placing it again under other ids" in line for line in said)


def test_collisions_every_time_end_in_one_clear_error(tier, monkeypatch):
    adapter = load_adapter(MODEL / "adapters" / "pytests", INFO)
    registrar = R.Registrar(FakeClient(tier), "token", SLOTS, timeout=5.0, say=lambda _: None)
    real_call = tier.call

    def always_taken(server, request, token, timeout):
        if isinstance(request, AddExperts):
            raise Refused(f"expert server {server} holds other experts", "adapter_slot_taken")
        return real_call(server, request, token, timeout)

    monkeypatch.setattr(R, "call", always_taken)
    with pytest.raises(AdapterError, match=r"could not be placed on the expert servers: .*"
                                           r"3 times"):
        registrar.register("pytests", adapter)
    assert tier.table.adapters() == {}
