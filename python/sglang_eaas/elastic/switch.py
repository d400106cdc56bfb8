"""Switching MoE layers between expert and tensor parallelism while serving (ParaSMoE on expert
servers; docs/switching.md).

A layer's layout is read from what the servers hold (``routing_table.py``): EP while whole
experts cover it, else TP over the parts that do. So a switch is two holdings changes, made
layer by layer, adds before drops:

* **EP -> TP** over a group of P servers: server ``p`` of the group adds part ``p`` of every
  expert of the layer (``add_parts``: cut from its own whole rows, else from a holder's over the
  weight fabric, else from the checkpoint), then every holder drops the layer's whole experts
  (``drop_experts``). The first drop flips the layer to TP for every client at its next step;
  requests routed by the old table are still answered until they stop coming.
* **TP -> EP**: the servers add whole experts again (``add_experts``: a placement's, by default
  contiguous blocks over the group), then drop the layer's parts (``drop_parts``).

Each layer waits until the monitor shows the adds before it drops, and until the dropped rows
are freed before the next layer begins, so at most one layer is held twice at any moment: the
extra memory per server is about one layer's weights (ParaSMoE's bound is two, (K+2)/K).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from sglang_eaas.expert_server.slices import Part
from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import current_snapshot
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import PlacementError, even_placement
from sglang_eaas.protocol.control import (
    AddExperts, AddParts, DropExperts, DropParts, Stats, call,
)
from sglang_eaas.routing_table import RoutingTable

LAYOUTS = ("ep", "tp")
SWITCH_GRACE = 0.05  # seconds a dropped layer's rows are still answered for after the last use
CALL_TIMEOUT = 120.0  # seconds one add may take (reading from disk included)
SHOWN_TIMEOUT = 30.0  # seconds for the monitor (or the frees) to show a change


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

    def holdings(self) -> Holdings:
        return current_snapshot(self.monitor, self.token).holdings(self.info.fingerprint())

    def switch(self, layers: list[int], to: str, group: list[str] | None = None
               ) -> list[LayerSwitch]:
        """Switch ``layers`` to ``to`` (``ep`` or ``tp``) one after the other, over ``group``
        (the TP group's servers, in part order; default: every serving server). A layer
        already in that layout is left as it is."""
        if to not in LAYOUTS:
            raise SwitchError(f"a layer switches to one of {LAYOUTS}, not {to!r}")
        unknown = sorted(set(layers) - set(self.info.moe_layers))
        if unknown:
            raise SwitchError(f"layers {unknown} are not MoE layers of the model (those are "
                              f"{list(self.info.moe_layers)})")
        done = []
        for layer in layers:
            holdings = self.holdings()
            servers = list(group or holdings.servers)
            missing = [s for s in servers if s not in holdings]
            if missing:
                raise SwitchError(f"servers {missing} are not serving in the tier")
            current = layouts(holdings, self.info)[layer]
            if (current == 1) == (to == "ep") and (to == "ep" or current == len(servers)):
                continue
            began, self._phases, self._mark = time.perf_counter(), {}, time.perf_counter()
            added = (self._to_tp(layer, servers, holdings) if to == "tp"
                     else self._to_ep(layer, servers, holdings))
            record = LayerSwitch(layer, to, len(servers) if to == "tp" else 1,
                                 time.perf_counter() - began, added, self._phases)
            self.say(f"MoE layer {layer}: {to.upper()} in {record.seconds:.2f}s "
                     f"(added {added})")
            done.append(record)
        return done

    def _to_tp(self, layer: int, servers: list[str], holdings: Holdings) -> dict[str, int]:
        parts, num_experts = len(servers), self.info.num_experts
        try:
            Part(0, parts).check(self.info.moe_intermediate_size)
        except ValueError as exc:
            raise SwitchError(f"MoE layer {layer} cannot be cut over {parts} servers: "
                              f"{exc}") from None
        if any(layer in holdings[s].parts for s in servers):
            self._each(servers, lambda s: DropParts(layer, force=True, grace=0.0)
                       if layer in holdings[s].parts else None)  # another cut: dropped first
        whole = holdings.layer(layer)
        adds = {s: AddParts(layer, parts, [e * parts + p for e in range(num_experts)],
                            {h: list(ids) for h, ids in whole.items() if ids and h != s})
                for p, s in enumerate(servers)}
        changes = self._each(servers, adds.get)
        self._phase("add")
        self._wait_shown(lambda held: all(
            layer in held[s].parts and len(held[s].parts[layer].ids) == num_experts
            for s in servers), f"MoE layer {layer}'s parts")
        self._phase("shown")
        self._each([s for s, ids in whole.items() if ids],
                   lambda s: DropExperts(layer, list(whole[s]), grace=self.grace))
        self._phase("drop")
        self._wait_freed(layer, [s for s, ids in whole.items() if ids])
        self._phase("freed")
        return {"self": sum(len(c.from_self) for c in changes),
                "peer": sum(len(c.from_peer) for c in changes),
                "disk": sum(len(c.from_disk) for c in changes)}

    def _to_ep(self, layer: int, servers: list[str], holdings: Holdings) -> dict[str, int]:
        try:
            blocks = even_placement(self.info.num_experts, len(servers))
        except PlacementError as exc:
            raise SwitchError(f"MoE layer {layer}: {exc}") from None
        target = dict(zip(servers, blocks))
        have = holdings.layer(layer)
        adds = {s: AddExperts(layer, [e for e in ids if e not in have.get(s, ())])
                for s, ids in target.items()}
        changes = self._each(servers, lambda s: adds[s] if adds[s].experts else None)
        self._phase("add")
        self._wait_shown(lambda held: all(set(target[s]) <= set(held[s].get(layer, ()))
                                          for s in servers), f"MoE layer {layer}'s experts")
        self._phase("shown")
        cut = [s for s, held in holdings.items() if layer in held.parts]
        self._each(cut, lambda s: DropParts(layer, grace=self.grace))
        self._phase("drop")
        self._wait_freed(layer, cut)
        self._phase("freed")
        return {"self": 0, "peer": sum(len(c.from_peer) for c in changes),
                "disk": sum(len(c.from_disk) for c in changes)}

    def _phase(self, name: str) -> None:
        now = time.perf_counter()
        self._phases[name] = now - self._mark
        self._mark = now

    def _each(self, servers: list[str], request_of: Callable) -> list:
        """``request_of(server)`` sent to each server at once (None: nothing for it); their
        replies. ``SwitchError`` naming the server for the first that failed."""
        calls = {s: r for s in servers if (r := request_of(s)) is not None}
        with ThreadPoolExecutor(max(1, len(calls))) as pool:
            futures = {s: pool.submit(call, s, r, self.token, CALL_TIMEOUT)
                       for s, r in calls.items()}
        replies = []
        for s, future in futures.items():
            try:
                replies.append(future.result())
            except Exception as exc:  # noqa: BLE001 (a control or transport error: said)
                raise SwitchError(f"expert server {s} refused {calls[s].op}: {exc}") from None
        return replies

    def _wait_shown(self, shown: Callable[[Holdings], bool], what: str) -> None:
        deadline = time.monotonic() + SHOWN_TIMEOUT
        while not shown(self.holdings()):
            if time.monotonic() > deadline:
                raise SwitchError(f"the monitor did not show {what} within {SHOWN_TIMEOUT:.0f}s")
            time.sleep(0.01)

    def _wait_freed(self, layer: int, servers: list[str]) -> None:
        """Until the servers freed what they dropped (nothing left retiring), so the next
        layer's adds do not meet this layer's dropped rows still held."""
        deadline = time.monotonic() + SHOWN_TIMEOUT
        for s in servers:
            while call(s, Stats(), self.token, CALL_TIMEOUT).counter("retiring"):
                if time.monotonic() > deadline:
                    raise SwitchError(f"expert server {s} still holds MoE layer {layer}'s "
                                      f"dropped weights after {SHOWN_TIMEOUT:.0f}s")
                time.sleep(0.01)
