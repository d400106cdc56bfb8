"""Putting an ESFT adapter's experts on the expert servers, and taking them off.

An adapter's experts are more experts of the tier: each gets a *physical id* per MoE layer past
the model's own (``[E, E + slots)``, the lowest no server holds), and ``replicas`` servers load
it (``add_experts`` with the adapter's directory: the server reads the weights from the
adapter's files, checks them and says it holds them, with which adapter and base expert they
are, in its monitor record). Servers are picked per layer with the fewest experts there, never
two copies on one server. The adapter is *published* (requests may use it) only once this
rank's routing table shows every one of its experts held: the physical ids come from the
table, so a rank that did not place them (another TP rank, another SGLang sharing the tier)
finds them there. A failed placement is rolled back.

Nothing reserves physical ids across SGLang servers sharing a tier: two registrations that start
at the same moment can pick the same ids. A server refuses an id it holds for another adapter
(``adapter_slot_taken``), and when the copies land on different servers the routing table marks
the id untrusted (``RoutingTable.untrusted``: routed nowhere). Either way the registration that
is still placing sees it, rolls back at once and places again under other ids, after a random
pause (up to ``PLACE_ATTEMPTS`` times); an adapter already published keeps its ids.

Unloading drops the experts this registrar placed (``drop_experts`` with ``force``: they are
their adapter's only copies by design; the servers free them after a grace period).

With a tier controller (a monitor: every SGLang with ``--eaas``; the client's hook gives the
registrar its ``operation``), a placement and an unload are each an operation (``adapter-load``,
``adapter-unload``): they wait up to ``timeout`` for another operation holding the tier, look
again for the adapter once they hold it (another instance may have placed it meanwhile),
record the placement they plan before they make it (so a successor can roll back one cut
short), and carry the lease's epoch.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ibgda import TransportError
from sglang_eaas.esft.adapter import AdapterError, EsftAdapter
from sglang_eaas.holdings import Holdings
from sglang_eaas.protocol.control import AddExperts, DropExperts, call
from sglang_eaas.protocol.lines import ControlError, Refused
from sglang_eaas.protocol.operations import (
    ADAPTER_LOAD, ADAPTER_UNLOAD, NO_FENCE, Fence, tier_message,
)
from sglang_eaas.routing_table import RoutingTable

if TYPE_CHECKING:
    from sglang_eaas.client.client import EaasClient
    from sglang_eaas.controller.controller import Held

    Body = Callable[[Fence, "Held | None"], str]  # an operation's work: what it did
    Operation = Callable[[str, dict, Body], None]

logger = logging.getLogger(__name__)
POLL = 0.05  # seconds between looks at the routing table while waiting for it
DROP_GRACE = 2.0  # seconds servers keep an unloaded adapter's experts for late requests
PLACE_ATTEMPTS = 3  # placements under fresh ids when another adapter took the same ones
RETRY_PAUSE = (0.2, 1.0)  # seconds, times the attempt: a random pause before placing again


class _Collision(Exception):
    """Another adapter was placed under some of the same physical ids at the same moment."""


@dataclass
class Registered:
    """One adapter on the tier: its experts' physical ids, and which of them this registrar
    placed (and so drops at unload)."""

    name: str
    adapter: EsftAdapter
    mapping: dict[int, dict[int, int]]  # MoE layer -> base expert -> physical id
    placed: Holdings = field(default_factory=Holdings)  # the physical ids placed, per server


class Registrar:
    def __init__(self, client: "EaasClient", token: str, slots: int, replicas: int = 1,
                 timeout: float = 60.0, orchestrate: bool = True,
                 say: Callable[[str], None] = logger.info,
                 operation: "Operation | None" = None):
        """``operation(kind, target, body)``: runs ``body(fence, held)`` as an operation of
        the tier controller and raises ``AdapterError`` unless it is done (the client's hook
        gives it, ``client/esft_hooks.py``); None: the changes are made as they are."""
        self.client, self.token, self.slots, self.replicas = client, token, slots, replicas
        self.timeout, self.orchestrate, self.say = timeout, orchestrate, say
        self.operation = operation
        self.info = client.info

    def _operation(self, kind: str, target: dict, body: "Body") -> None:
        if self.operation is None:
            body(NO_FENCE, None)
        else:
            self.operation(kind, target, body)

    # -- load -------------------------------------------------------------------------------
    def register(self, name: str, adapter: EsftAdapter) -> Registered:
        """Place ``adapter``'s experts (or find them placed) and wait until this rank's table
        shows them all; ``AdapterError`` naming what failed."""
        digests = adapter.digests(self.info, adapter.experts)
        found = self._found(name, digests)
        if found is not None:
            self.say(f"sglang-eaas: ESFT adapter {name}: its {adapter.count} experts are on the "
                     "expert servers already")
            return Registered(name, adapter, found)
        if not self.orchestrate:
            return Registered(name, adapter, self._wait_found(name, digests))
        started = time.monotonic()
        placed: list[Registered] = []

        def place(fence: Fence, held: "Held | None") -> str:
            found = self._found(name, digests)  # placed by another while this one waited
            if found is not None:
                placed.append(Registered(name, adapter, found))
                return f"its {adapter.count} experts were on the expert servers already"
            for attempt in range(1, PLACE_ATTEMPTS + 1):
                try:
                    placed.append(self._place(name, adapter, digests, fence, held))
                    return (f"{adapter.count} experts placed on {len(placed[0].placed)} "
                            "expert servers")
                except _Collision as exc:
                    if attempt == PLACE_ATTEMPTS:
                        raise AdapterError(f"ESFT adapter {name} could not be placed on the "
                                           f"expert servers: {exc}, {attempt} times") from None
                    self.say(f"sglang-eaas: ESFT adapter {name}: {exc}; placing it again under "
                             "other ids")
                    time.sleep(random.uniform(*RETRY_PAUSE) * attempt)
            raise AssertionError("unreachable")

        self._operation(ADAPTER_LOAD, {"adapter": name, "path": str(adapter.path),
                                       "replicas": self.replicas}, place)
        registered = placed[0]
        self.say(f"sglang-eaas: ESFT adapter {name}: {adapter.count} experts on "
                 f"{len(registered.placed) or 'the'} expert servers in "
                 f"{time.monotonic() - started:.1f}s")
        return registered

    def _place(self, name: str, adapter: EsftAdapter, digests: dict[int, dict[int, str]],
               fence: Fence = NO_FENCE, held: "Held | None" = None) -> Registered:
        """One placement under the lowest free ids, rolled back if it fails; ``_Collision``
        if another adapter took some of the same ids meanwhile. The plan is recorded in the
        operation (``held``) before the first add."""
        mapping = self._allocate(name, adapter)
        plan = self._plan(mapping)
        registered = Registered(name, adapter, mapping)
        if held is not None:
            held.note(_placed=tier_message(Holdings({
                server: {layer: [p for p, _ in pairs] for layer, pairs in layers.items()}
                for server, layers in plan.items()})))
        try:
            for server, layers in plan.items():
                for layer, pairs in layers.items():
                    fence.check()
                    try:
                        call(server, AddExperts(layer, [p for p, _ in pairs], adapter=name,
                                                adapter_path=str(adapter.path),
                                                replaces=[b for _, b in pairs],
                                                epoch=fence.epoch),
                             self.token, self.timeout)
                    except Refused as exc:
                        if exc.reason == "adapter_slot_taken":
                            raise _Collision(str(exc)) from None
                        raise
                    registered.placed = registered.placed.with_server(server, {
                        **registered.placed.get(server, {}), layer: [p for p, _ in pairs]})
            self._wait_found(name, digests, mapping)
        except _Collision:
            self._drop(registered, grace=0.0, fence=fence)
            raise
        except (TransportError, ControlError, AdapterError) as exc:
            self._drop(registered, grace=0.0, fence=fence)
            raise AdapterError(f"ESFT adapter {name} could not be placed on the expert "
                               f"servers: {exc}") from None
        return registered

    def _found(self, name: str, digests: dict[int, dict[int, str]]
               ) -> dict[int, dict[int, int]] | None:
        """The physical ids of ``name``'s experts if the table holds them all, as these
        weights; ``AdapterError`` if the tier holds other weights under that name."""
        table = self.client.table
        mapping, theirs = table.adapters().get(name, {}), table.adapter_digests(name)
        other = [(layer, b) for layer, by_base in theirs.items() for b, d in by_base.items()
                 if digests.get(layer, {}).get(b) != d]
        if other:
            raise AdapterError(f"the expert servers hold another adapter named {name} (other "
                               f"weights for layer/expert {other[:4]}); pick another name")
        if all(b in mapping.get(layer, {}) and self._held(table, layer, mapping[layer][b])
               for layer, by_base in digests.items() for b in by_base):
            return {layer: {b: mapping[layer][b] for b in by_base}
                    for layer, by_base in digests.items()}
        return None

    @staticmethod
    def _held(table: RoutingTable, layer: int, physical: int) -> bool:
        return physical in table.holdings.holders(layer)

    def _wait_found(self, name: str, digests: dict[int, dict[int, str]],
                    expected: dict[int, dict[int, int]] | None = None
                    ) -> dict[int, dict[int, int]]:
        deadline = time.monotonic() + self.timeout
        while True:
            if expected is not None:
                self._check_collision(expected)
            found = self._found(name, digests)
            if found is not None and (expected is None or found == expected):
                return found
            if time.monotonic() > deadline:
                raise AdapterError(f"ESFT adapter {name}'s experts did not all appear in the "
                                   f"routing table within {self.timeout:.0f}s")
            time.sleep(POLL)

    def _check_collision(self, mapping: dict[int, dict[int, int]]) -> None:
        """``_Collision`` if the table says a server holds another expert under one of
        ``mapping``'s ids."""
        untrusted = self.client.table.untrusted
        taken = {layer: sorted(set(by_base.values()) & set(untrusted.get(layer, ())))
                 for layer, by_base in mapping.items()}
        taken = {layer: ids for layer, ids in taken.items() if ids}
        if taken:
            raise _Collision(f"another adapter was placed under the same physical ids at the "
                             f"same moment (MoE layer -> ids: {taken})")

    def _allocate(self, name: str, adapter: EsftAdapter) -> dict[int, dict[int, int]]:
        """The lowest physical ids of each layer that no server holds."""
        table, base = self.client.table, self.info.num_experts
        mapping = {}
        for layer, bases in adapter.experts.items():
            used = {e for e in table.holdings.holders(layer) if e >= base}
            free = [p for p in range(base, base + self.slots) if p not in used]
            if len(free) < len(bases):
                raise AdapterError(
                    f"ESFT adapter {name} needs {len(bases)} expert slots in MoE layer {layer}, "
                    f"{len(free)} of the {self.slots} there are free; unload an adapter or "
                    "start with a larger --eaas-esft-slots")
            mapping[layer] = dict(zip(bases, free))
        return mapping

    def _plan(self, mapping: dict[int, dict[int, int]]
              ) -> dict[str, dict[int, list[tuple[int, int]]]]:
        """server -> layer -> [(physical, base)]: each expert on ``replicas`` servers, those
        with the fewest experts in its layer first."""
        table = self.client.table
        if len(table.servers) < self.replicas:
            raise AdapterError(f"{self.replicas} copies of each adapter expert were asked for "
                               f"(--eaas-esft-replicas), the tier has {len(table.servers)} "
                               "expert servers")
        count = {(s, layer): len(table.holdings[s].get(layer, ())) for s in table.servers
                 for layer in mapping}
        plan: dict[str, dict[int, list[tuple[int, int]]]] = {}
        for layer, by_base in mapping.items():
            for base, physical in by_base.items():
                chosen = sorted(table.servers, key=lambda s: (count[s, layer], s))
                for server in chosen[:self.replicas]:
                    plan.setdefault(server, {}).setdefault(layer, []).append((physical, base))
                    count[server, layer] += 1
        return plan

    # -- unload -----------------------------------------------------------------------------
    def unregister(self, registered: Registered, grace: float = DROP_GRACE) -> None:
        """Drop the experts this registrar placed for ``registered`` (servers that are gone
        have dropped them already)."""
        if registered.placed:
            def drop(fence: Fence, held: "Held | None") -> str:
                count = sum(len(ids) for s in registered.placed.values() for ids in s.values())
                self._drop(registered, grace, fence)
                return f"{count} experts dropped"

            self._operation(ADAPTER_UNLOAD, {"adapter": registered.name,
                                             "_placed": tier_message(registered.placed)}, drop)
        self.say(f"sglang-eaas: ESFT adapter {registered.name}: unloaded")

    def _drop(self, registered: Registered, grace: float, fence: Fence = NO_FENCE) -> None:
        for server, layers in registered.placed.items():
            for layer, physical in layers.items():
                try:
                    call(server, DropExperts(layer, list(physical), force=True, grace=grace,
                                             epoch=fence.epoch),
                         self.token, self.timeout)
                except (TransportError, ControlError) as exc:
                    logger.warning("ESFT adapter %s: could not drop experts %s of MoE layer %d "
                                   "from %s: %s", registered.name, physical, layer, server, exc)
        registered.placed = Holdings()
