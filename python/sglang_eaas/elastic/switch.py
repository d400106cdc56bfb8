"""Switching MoE layers between expert and tensor parallelism while serving (ParaSMoE on expert
servers; docs/switching.md).

A layer's layout is read from what the servers hold (``routing_table.py``): EP while whole
experts cover it, else TP over the parts that do. So a switch is two holdings changes, made
layer by layer, adds before drops:

* **EP -> TP** over a group (server ``i`` holds part ``i % P``; a group of 2P servers holds
  every part twice): each server adds its part of every expert of the layer (``add_parts``:
  cut from its own whole rows, else from a holder's over the weight fabric, else from the
  checkpoint), then every holder drops the layer's whole experts (``drop_experts``). The first
  drop flips the layer to TP for every client at its next step; requests routed by the old
  table are still answered until they stop coming.
* **TP -> EP**: the servers add whole experts again in contiguous blocks (``add_experts`` with
  ``parts``: each assembled from the server's own part and the others' over the weight
  fabric), then drop the layer's parts (``drop_parts``).

Each layer waits until the monitor shows the adds before it drops, and until the dropped rows
are freed before the next layer begins, so at most one layer is held twice at any moment: the
extra memory per server is about one layer's weights (ParaSMoE's bound is two, (K+2)/K). A
server lost mid-switch is left out; the survivors complete the layer where they can, else it
is rolled back (``Switcher.switch``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ibgda import TransportError
from sglang_eaas.slices import Part
from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import current_snapshot
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import PlacementError, even_placement
from sglang_eaas.protocol.control import (
    AddExperts, AddParts, DropExperts, DropParts, Stats, call,
)
from sglang_eaas.protocol.lines import Refused
from sglang_eaas.protocol.operations import NO_FENCE, Fence
from sglang_eaas.routing_table import RoutingTable

EP, TP = "ep", "tp"
LAYOUTS = (EP, TP)
SWITCH_GRACE = 0.05  # seconds a dropped layer's rows are still answered for after the last use
CALL_TIMEOUT = 120.0  # seconds one add may take (reading from disk included)
SHOWN_TIMEOUT = 30.0  # seconds for the monitor (or the frees) to show a change


def _origins(changes: list) -> dict[str, int]:
    """Where the added parts (or experts) came from, counted over the replies."""
    return {"self": sum(len(getattr(c, "from_self", ())) for c in changes),
            "peer": sum(len(c.from_peer) for c in changes),
            "disk": sum(len(c.from_disk) for c in changes)}


class SwitchError(RuntimeError):
    """A switch that cannot be made (or was cut short); the message says which layer and why."""


@dataclass
class LayerSwitch:
    """One layer's switch: where it went, how long it took, where the added weights came from
    (counts over the group: cut from the server's own rows, read from a peer, from disk)."""

    layer: int
    to: str
    parts: int  # the layer's parts afterwards (1: EP)
    seconds: float
    added: dict[str, int] = field(default_factory=dict)  # self / peer / disk -> count
    # seconds per phase: add (the servers' adds), shown (until the monitor shows them), drop,
    # freed (until the dropped rows are freed)
    phases: dict[str, float] = field(default_factory=dict)


def layouts(holdings: Holdings, info: MoeModelInfo) -> dict[int, int]:
    """MoE layer -> the parts its experts are routed in now (1: EP)."""
    table = RoutingTable.build(0, holdings, list(info.moe_layers), info.num_experts,
                               allow_missing=True)
    return {layer: table.parts(layer) for layer in info.moe_layers}


class Switcher:
    """Switches layers of the tier a monitor watches (its servers of ``info``'s model)."""

    def __init__(self, monitor: str, token: str, info: MoeModelInfo,
                 grace: float = SWITCH_GRACE, say: Callable[[str], None] = lambda line: None):
        self.monitor, self.token, self.info, self.grace, self.say = monitor, token, info, grace, say
        self._lost: set[str] = set()  # servers a call could not reach: left out from then on
        self.fence: Fence = NO_FENCE  # the operation lease of the switch running

    def holdings(self) -> Holdings:
        return current_snapshot(self.monitor, self.token).holdings(self.info.fingerprint())

    def switch(self, layers: list[int], to: str, group: list[str] | None = None,
               parts: int | None = None, fence: Fence = NO_FENCE) -> list[LayerSwitch]:
        """Switch ``layers`` to ``to`` (``ep`` or ``tp``) one after the other, over ``group``
        (default: every serving server). TP: ``parts`` parts per expert (default: one per
        server of the group), server ``i`` of the group holding part ``i % parts`` (a group of
        2P servers holds every part twice: a replica of each). EP: the experts in contiguous
        blocks, each block on ``len(group) // parts-now`` servers (so a TP tier holding every
        part twice gets back every expert twice). A layer already in that layout is left.

        A server of the group lost mid-switch (a call fails to reach it) is left out from then
        on: the layer completes with the survivors where they still hold every part (or take
        the lost server's experts), else it is rolled back to its old layout and
        ``SwitchError`` says so (the layers before it keep the new one).

        Every change carries ``fence``'s epoch (the operation lease it runs under). A layer
        already in the layout asked for keeps it, with what a switch cut short left of the
        other layout dropped. The end is read back from the monitor: ``SwitchError`` unless
        every layer asked for is in that layout."""
        self._lost, self.fence = set(), fence
        servers, parts = self.check(layers, to, group, parts)
        done = []
        for layer in layers:
            self.fence.check()
            holdings = self.holdings()
            for s in servers:
                if s not in holdings and s not in self._lost:  # the monitor lost it
                    self._lost.add(s)
                    self.say(f"expert server {s} is lost (no longer in the tier); the switch "
                             "goes on without it")
            servers = [s for s in servers if s not in self._lost]
            current = layouts(holdings, self.info)[layer]
            if (to == EP and current == 1) or (to == TP and current == parts):
                self._tidy(layer, to, holdings)
                continue
            began, self._phases, self._mark = time.perf_counter(), {}, time.perf_counter()
            added = (self._to_tp(layer, servers, parts, holdings) if to == TP
                     else self._to_ep(layer, servers, current, holdings))
            record = LayerSwitch(layer, to, parts if to == TP else 1,
                                 time.perf_counter() - began, added, self._phases)
            self.say(f"MoE layer {layer}: {to.upper()} in {record.seconds:.2f}s "
                     f"(added {added})")
            done.append(record)
        self._check_reached(layers, to, parts)
        return done

    def check(self, layers: list[int], to: str, group: list[str] | None = None,
              parts: int | None = None) -> tuple[list[str], int | None]:
        """``SwitchError`` (one sentence) unless the switch can be made on the tier as it is:
        a model some server serves, MoE layers of it, a group of distinct serving servers, and
        for TP parts the group can hold and the experts can be cut into. The group and parts
        it would use."""
        if to not in LAYOUTS:
            raise SwitchError(f"a layer switches to one of {LAYOUTS}, not {to!r}")
        unknown = sorted(set(layers) - set(self.info.moe_layers))
        if unknown:
            raise SwitchError(f"layers {unknown} are not MoE layers of the model (those are "
                              f"{list(self.info.moe_layers)})")
        holdings = self.holdings()
        if not holdings:
            raise SwitchError(f"no expert server of the tier serves this model "
                              f"({self.info.model_type}, {self.info.num_experts} experts, "
                              f"fingerprint {self.info.fingerprint()}): is --model-path the "
                              "checkpoint the tier serves?")
        servers = list(group or holdings.servers)
        missing = [s for s in servers if s not in holdings]
        if missing:
            raise SwitchError(f"servers {missing} are not serving in the tier")
        if len(set(servers)) != len(servers):
            raise SwitchError(f"the group {servers} names a server twice")
        parts = parts or (len(servers) if to == TP else None)
        if to == TP:
            if not 2 <= parts <= len(servers):
                raise SwitchError(f"TP cuts each expert into 2 to {len(servers)} parts (one "
                                  f"server at least per part), not {parts}")
            try:
                Part(0, parts).check(self.info.moe_intermediate_size)
            except ValueError as exc:
                raise SwitchError(f"the experts cannot be cut into {parts} parts: "
                                  f"{exc}") from None
        return servers, parts

    def _tidy(self, layer: int, to: str, holdings: Holdings) -> None:
        """A layer already in layout ``to``: what a switch cut short left of the other layout
        (whole experts beside a TP layer's parts, parts beside an EP layer's experts) is
        dropped."""
        num_experts = self.info.num_experts
        if to == TP:
            left = {s: [e for e in held.get(layer, ()) if e < num_experts]
                    for s, held in holdings.items()}
            left = {s: ids for s, ids in left.items() if ids}
            self._each(list(left), lambda s: DropExperts(layer, left[s], grace=self.grace,
                                                         epoch=self.fence.epoch))
        else:
            left = [s for s, held in holdings.items() if layer in held.parts]
            self._each(left, lambda s: DropParts(layer, grace=self.grace,
                                                 epoch=self.fence.epoch))
        if left:
            self.say(f"MoE layer {layer}: {to.upper()} already; dropped what an earlier switch "
                     f"left of the other layout on {len(left)} servers")

    def _check_reached(self, layers: list[int], to: str, parts: int | None) -> None:
        """``SwitchError`` unless the monitor shows every layer of ``layers`` in ``to``."""
        deadline = time.monotonic() + SHOWN_TIMEOUT
        while True:
            now = layouts(self.holdings(), self.info)
            want = 1 if to == EP else parts
            wrong = [layer for layer in layers if now[layer] != want]
            if not wrong:
                return
            if time.monotonic() > deadline:
                layout = "EP" if to == EP else f"TP over {parts} parts"
                raise SwitchError(f"MoE layers {wrong} are not {layout} after the switch "
                                  f"(parts per layer now: {now})")
            time.sleep(0.05)

    def _to_tp(self, layer: int, servers: list[str], parts: int, holdings: Holdings
               ) -> dict[str, int]:
        num_experts = self.info.num_experts
        adapters = sorted({e for s in holdings for e in holdings[s].get(layer, ())
                           if e >= num_experts})
        if adapters:
            raise SwitchError(f"MoE layer {layer} stays EP: the servers hold ESFT adapter "
                              f"experts there ({adapters}), which are routed whole only")
        cut_otherwise = [s for s in servers if layer in holdings[s].parts
                         and holdings[s].parts[layer].parts != parts]
        self._each(cut_otherwise, lambda s: DropParts(layer, force=True, grace=0.0,
                                                      epoch=self.fence.epoch))
        whole = holdings.layer(layer)
        part_of = {s: i % parts for i, s in enumerate(servers)}
        adds = {s: AddParts(layer, parts, [e * parts + part_of[s] for e in range(num_experts)],
                            {h: list(ids) for h, ids in whole.items() if ids and h != s},
                            epoch=self.fence.epoch)
                for s in servers}
        changes = self._each(servers, adds.get)
        live = [s for s in servers if s not in self._lost]
        if {part_of[s] for s in live} != set(range(parts)):
            self._each(live, lambda s: DropParts(layer, force=True, grace=0.0,  # roll back
                                                 epoch=self.fence.epoch))
            raise SwitchError(f"MoE layer {layer} stays EP: servers {sorted(self._lost)} were "
                              f"lost while it switched, and no server left holds parts "
                              f"{sorted(set(range(parts)) - {part_of[s] for s in live})}")
        self._phase("add")
        self._wait_shown(lambda held: all(
            s not in held or (layer in held[s].parts
                              and len(held[s].parts[layer].ids) == num_experts)
            for s in live), f"MoE layer {layer}'s parts")
        self._phase("shown")
        holders = [s for s, ids in whole.items() if ids and s not in self._lost]
        self._each(holders, lambda s: DropExperts(layer, list(whole[s]), grace=self.grace,
                                                  epoch=self.fence.epoch))
        self._phase("drop")
        self._wait_freed(layer, [s for s in holders if s not in self._lost])
        self._phase("freed")
        return _origins(changes)

    def _to_ep(self, layer: int, servers: list[str], parts: int, holdings: Holdings
               ) -> dict[str, int]:
        copies = max(1, len(servers) // max(parts, 1))
        try:
            blocks = even_placement(self.info.num_experts, len(servers) // copies)
        except PlacementError as exc:
            raise SwitchError(f"MoE layer {layer}: {exc}") from None
        target = {s: blocks[i % len(blocks)] for i, s in enumerate(servers)}
        have = holdings.layer(layer)
        cut = {s: list(h.parts[layer].ids) for s, h in holdings.items()
               if layer in h.parts and h.parts[layer].parts == parts and s not in self._lost}
        changes = self._add_whole(layer, target, have, parts, cut)
        live = [s for s in servers if s not in self._lost]
        orphans = sorted(set(range(self.info.num_experts))
                         - {e for s in live for e in target[s]})
        if orphans and live:  # a server lost with its block: the survivors take it
            again = {s: [e for e in orphans[i::len(live)]] for i, s in enumerate(live)}
            changes += self._add_whole(layer, again, have, parts, cut)
            for s in live:
                target[s] = [*target[s], *again.get(s, [])]
        live = [s for s in servers if s not in self._lost]
        if not live or set(range(self.info.num_experts)) - {e for s in live for e in target[s]}:
            raise SwitchError(f"MoE layer {layer} stays TP: servers {sorted(self._lost)} were "
                              "lost while it switched and the others could not take their "
                              "experts")
        self._phase("add")
        self._wait_shown(lambda held: all(s not in held or set(target[s]) <= set(
            held[s].get(layer, ())) for s in live), f"MoE layer {layer}'s experts")
        self._phase("shown")
        holders = [s for s, held in holdings.items() if layer in held.parts
                   and s not in self._lost]
        self._each(holders, lambda s: DropParts(layer, grace=self.grace, epoch=self.fence.epoch))
        self._phase("drop")
        self._wait_freed(layer, [s for s in holders if s not in self._lost])
        self._phase("freed")
        return _origins(changes)

    def _add_whole(self, layer: int, target: dict[str, list[int]],
                   have: dict[str, tuple[int, ...]], parts: int, cut: dict[str, list[int]]
                   ) -> list:
        """``target``'s experts added where not held, assembled from the parts ``cut`` (server
        -> routed part ids) holds, over the weight fabric."""
        def add(s: str, ids: list[int]) -> AddExperts:
            sources = {h: i for h, i in cut.items() if h != s and h not in self._lost}
            return (AddExperts(layer, ids, parts=parts, part_sources=sources,
                               epoch=self.fence.epoch) if sources
                    else AddExperts(layer, ids, epoch=self.fence.epoch))

        adds = {s: add(s, [e for e in ids if e not in have.get(s, ())])
                for s, ids in target.items()}
        return self._each(list(target), lambda s: adds[s] if adds[s].experts else None)

    def _phase(self, name: str) -> None:
        now = time.perf_counter()
        self._phases[name] = now - self._mark
        self._mark = now

    def _each(self, servers: list[str], request_of: Callable) -> list:
        """``request_of(server)`` sent to each server at once (None: nothing for it); the
        replies of those that answered. A server that cannot be reached is lost (``_lost``)
        and left out; one that refuses raises ``SwitchError`` naming it."""
        self.fence.check()
        calls = {s: r for s in servers if s not in self._lost
                 and (r := request_of(s)) is not None}
        with ThreadPoolExecutor(max(1, len(calls))) as pool:
            futures = {s: pool.submit(call, s, r, self.token, CALL_TIMEOUT)
                       for s, r in calls.items()}
        replies = []
        for s, future in futures.items():
            try:
                replies.append(future.result())
            except Refused as exc:
                raise SwitchError(f"expert server {s} refused {calls[s].op}: {exc}") from None
            except TransportError as exc:
                self._lost.add(s)
                self.say(f"expert server {s} is lost ({exc}); the switch goes on without it")
        return replies

    def _wait_shown(self, shown: Callable[[Holdings], bool], what: str) -> None:
        deadline = time.monotonic() + SHOWN_TIMEOUT
        while not shown(self.holdings()):
            if time.monotonic() > deadline:
                raise SwitchError(f"the monitor did not show {what} within {SHOWN_TIMEOUT:.0f}s")
            time.sleep(0.01)

    def _wait_freed(self, layer: int, servers: list[str]) -> None:
        """Until the servers freed what they dropped (nothing left retiring), so the next
        layer's adds do not meet this layer's dropped rows still held (a lost server: not
        waited for)."""
        deadline = time.monotonic() + SHOWN_TIMEOUT
        for s in servers:
            while True:
                try:
                    if not call(s, Stats(), self.token, CALL_TIMEOUT).counter("retiring"):
                        break
                except TransportError as exc:
                    self._lost.add(s)
                    self.say(f"expert server {s} is lost ({exc}); the switch goes on without it")
                    break
                if time.monotonic() > deadline:
                    raise SwitchError(f"expert server {s} still holds MoE layer {layer}'s "
                                      f"dropped weights after {SHOWN_TIMEOUT:.0f}s")
                time.sleep(0.01)
