"""An expert server's control endpoint: the messages a client (or an operator) sends it.

Over the authenticated JSON-line channel (``protocol/lines.py``):

    -> {"op": "join", ...JoinRequest}  <- {"ok": true, ...JoinReply}
    -> {"op": "ready"}                 <- {"ok": true}: the slot is served from now on
    -> {"op": "stats"}                 <- {"ok": true, "stats": {...}}
    -> {"op": "leave"}                 <- {"ok": true}: the slot is back in the pool
    -> {"op": "drain", ...Drain}       <- {"ok": true, "clients": N}: the server leaves the tier
                                          gracefully (docs/protocol.md, "Leaving")

The records below are the only definition of these messages; both ends use them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sglang_eaas.protocol.header import DType
from sglang_eaas.protocol.layout import SlotLayout
from sglang_eaas.protocol.lines import Channel, Message

OPS = ("join", "ready", "stats", "leave", "drain")


@dataclass(frozen=True)
class JoinRequest(Message):
    """A client asks for a slot; the server checks it serves the same model and weights."""

    client: str  # the client's id: its monitor member id when it has a monitor, else a name
    fingerprint: str  # MoeModelInfo.fingerprint(): the model's MoE shape
    dtype: str  # the client's activations dtype: float32 | bfloat16 | float16
    transport: str  # the ibgda backend asked for, or "auto"
    expert_digests: list[str]  # weights.expert_digests(): one per expert of the model
    incarnation: str = ""  # the client's monitor incarnation: its slot goes when that does

    op = "join"


SLOTS_PER_CONNECTION = 2  # one per micro-batch in flight (two-batch overlap)


@dataclass(frozen=True)
class JoinReply:
    """Where the reserved slot is, and what the server holds."""

    slot: int
    region: dict  # ibgda.RegionHandle.to_dict()
    base: int  # the slot's offset in the region
    bell: int  # the server doorbell's offset
    layout: SlotLayout
    experts: list[int]  # held in at least one layer
    layer_experts: dict[int, list[int]]  # MoE layer -> experts held there (maybe none)
    moe_layers: list[int]
    first_seq: int  # the client's first request is first_seq + 1 (a fresh range per join)

    def to_message(self) -> dict[str, Any]:
        return {**asdict(self), "layout": {**asdict(self.layout), "dtype": int(self.layout.dtype)},
                "layer_experts": {str(layer): ids for layer, ids in self.layer_experts.items()}}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "JoinReply":
        layout = dict(message["layout"])
        layout["dtype"] = DType(layout["dtype"])
        return cls(message["slot"], message["region"], message["base"], message["bell"],
                   SlotLayout(**layout), list(message["experts"]),
                   {int(layer): list(ids) for layer, ids in message["layer_experts"].items()},
                   list(message["moe_layers"]), message["first_seq"])


@dataclass(frozen=True)
class Drain(Message):
    """Leave the tier gracefully: clients stop sending first, in-flight work finishes, then the
    server exits. Refused (``drain_uncovered``) where the server is the last live holder of an
    expert, unless ``force``."""

    force: bool = False
    timeout: float = 30.0  # seconds to wait for clients to stop using the server

    op = "drain"


def probe(address: str, token: str, timeout: float = 10.0) -> dict[str, Any]:
    """A server's stats (experts, model fingerprint, counters) over a fresh connection."""
    channel = Channel(address, token, timeout)
    try:
        return channel.call("stats")["stats"]
    finally:
        channel.close()
