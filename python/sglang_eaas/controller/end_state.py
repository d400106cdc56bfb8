"""The tier's state as an operation reads it back from the monitor when it ends: what its
record keeps (``OperationRecord.end``) and what its driver checks against its target before it
calls itself done (a tool exits 0 only then)."""

from __future__ import annotations

from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import current_snapshot
from sglang_eaas.protocol.monitor import SERVING, Snapshot
from sglang_eaas.routing_table import lenient_table


def active_and_standby(snapshot: Snapshot, fingerprint: str | None = None
                       ) -> tuple[list[str], list[str]]:
    """The serving servers that hold experts (or parts), and those that hold none (standby)."""
    active, standby = [], []
    for m in snapshot.servers(fingerprint):
        if m.status == SERVING:
            (active if m.holdings.holds_any() else standby).append(m.id)
    return active, standby


def layouts_of(holdings: Holdings, num_experts: int) -> dict[int, int]:
    """MoE layer -> the parts its experts are routed in (1: EP), as clients would route them."""
    layers = list(holdings.layers())
    table = lenient_table(holdings, layers, num_experts)
    return {layer: table.parts(layer) for layer in layers}


def end_state(snapshot: Snapshot, fingerprint: str | None) -> dict:
    """``{"holdings": digest, "active": [...], "standby": [...], "layouts": {layer: parts},
    "missing": {layer: [experts]}}`` of the serving servers of ``fingerprint``'s model."""
    servers = snapshot.servers(fingerprint)
    holdings = snapshot.holdings(fingerprint)
    num_experts = max((m.num_experts for m in servers), default=0)
    active, standby = active_and_standby(snapshot, fingerprint)
    layers = list(holdings.layers())
    table = lenient_table(holdings, layers, num_experts) if layers else None
    return {"holdings": holdings.digest(), "active": sorted(active),
            "standby": sorted(standby),
            "layouts": {str(layer): table.parts(layer) for layer in layers} if table else {},
            "missing": {str(layer): list(ids) for layer, ids in table.missing.items()}
            if table else {}}


def read_end_state(monitor: str, token: str, fingerprint: str | None) -> dict:
    return end_state(current_snapshot(monitor, token), fingerprint)
