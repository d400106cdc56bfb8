"""The tier's state as an operation reads it back from the monitor when it ends: what its
record keeps (``OperationRecord.end``) and what its driver checks against its target before it
calls itself done (a tool exits 0 only then)."""

from __future__ import annotations

from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import current_snapshot
from sglang_eaas.protocol.monitor import Snapshot
from sglang_eaas.routing_table import lenient_table


def layers_of(holdings: Holdings) -> list[int]:
    """Every MoE layer some server holds whole experts or parts of (or names), sorted."""
    return sorted({*holdings.layers(), *(layer for held in holdings.values()
                                         for layer in held.parts)})


def layouts_of(holdings: Holdings, num_experts: int) -> dict[int, int]:
    """MoE layer -> the parts its experts are routed in (1: EP), as clients would route them."""
    layers = layers_of(holdings)
    table = lenient_table(holdings, layers, num_experts)
    return {layer: table.parts(layer) for layer in layers}


def end_state(snapshot: Snapshot, fingerprint: str | None) -> dict:
    """``{"holdings": digest, "active": [...], "standby": [...], "layouts": {layer: parts},
    "missing": {layer: [experts]}}`` of the serving servers of ``fingerprint``'s model (the
    digest over the active ones: a standby server registering changes no holdings)."""
    servers = snapshot.servers(fingerprint)
    active, standby = snapshot.active_and_standby(fingerprint)
    holdings = snapshot.holdings(fingerprint).only(active)
    num_experts = max((m.num_experts for m in servers), default=0)
    layers = layers_of(holdings)
    table = lenient_table(holdings, layers, num_experts) if layers else None
    return {"holdings": holdings.digest(), "active": sorted(active),
            "standby": sorted(standby),
            "layouts": {str(layer): table.parts(layer) for layer in layers} if table else {},
            "missing": {str(layer): list(ids) for layer, ids in table.missing.items()}
            if table else {}}


def read_end_state(monitor: str, token: str, fingerprint: str | None) -> dict:
    return end_state(current_snapshot(monitor, token), fingerprint)
