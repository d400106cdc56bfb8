"""An expert server's control endpoint: the messages a client (or an operator) sends it.

Over the authenticated JSON-line channel (``protocol/lines.py``):

    -> {"op": "join", ...JoinRequest}  <- {"ok": true, ...JoinReply}
    -> {"op": "ready"}                 <- {"ok": true}: the slot is served from now on
    -> {"op": "stats"}                 <- {"ok": true, "stats": {...}}
    -> {"op": "leave"}                 <- {"ok": true}: the slot is back in the pool
    -> {"op": "drain", ...Drain}       <- {"ok": true, "clients": N}: the server leaves the tier
                                          gracefully (docs/protocol.md, "Leaving")
    -> {"op": "add_experts", ...AddExperts}   <- {"ok": true, ...HoldingsChange}: load replicas
                                          while serving, then hold them (docs/protocol.md,
                                          "Replicas")
    -> {"op": "drop_experts", ...DropExperts} <- {"ok": true, ...HoldingsChange}: stop holding
                                          them; their weights go once no request uses them
    -> {"op": "expert_weights", ...ExpertWeights} <- {"ok": true, ...WeightsChunk}: a peer
                                          reads one expert's weights from this server

The records below are the only definition of these messages; both ends use them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_eaas.protocol.header import DType
from sglang_eaas.protocol.layout import SlotLayout
from sglang_eaas.protocol.lines import Channel, ControlError, Message, shown

OPS = ("join", "ready", "stats", "leave", "drain", "add_experts", "drop_experts",
       "expert_weights")


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
    adapter_experts: dict = field(default_factory=dict)  # Member.adapter_experts's form

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
                   list(message["moe_layers"]), message["first_seq"],
                   dict(message.get("adapter_experts", {})))


@dataclass(frozen=True)
class Drain(Message):
    """Leave the tier gracefully: clients stop sending first, in-flight work finishes, then the
    server exits. Refused (``drain_uncovered``) where the server is the last live holder of an
    expert, unless ``force``."""

    force: bool = False
    timeout: float = 30.0  # seconds to wait for clients to stop using the server

    op = "drain"


def _check_experts(layer: int, experts: list[int]) -> None:
    if layer < 0 or not experts or any(e < 0 for e in experts) or len(set(experts)) != len(
            experts):
        raise ControlError("bad_field", f"a holdings change names a MoE layer >= 0 and distinct "
                           f"expert ids >= 0, got layer {layer}, experts {shown(experts)}")


@dataclass(frozen=True)
class AddExperts(Message):
    """Hold ``experts`` of MoE ``layer`` too (replicas): their weights are read from the
    expert server ``source`` (its control address) if given, from the checkpoint on disk
    otherwise or if that fails; the server serves them before it says it holds them.

    With ``adapter``: ``experts`` are physical ids (>= the model's expert count) of the ESFT
    adapter ``adapter`` (its directory ``adapter_path``), ``replaces[i]`` the base expert that
    ``experts[i]`` replaces; from disk, the weights come from the adapter's files."""

    layer: int
    experts: list[int]
    source: str = ""
    adapter: str = ""
    adapter_path: str = ""
    replaces: list[int] = field(default_factory=list)

    op = "add_experts"

    def validate(self) -> None:
        _check_experts(self.layer, self.experts)
        if self.adapter and (not self.adapter_path or len(self.replaces) != len(self.experts)
                             or any(type(e) is not int or e < 0 for e in self.replaces)):
            raise ControlError("bad_field", f"an adapter's add names its path and one base "
                               f"expert per physical expert, got path {shown(self.adapter_path)}"
                               f", replaces {shown(self.replaces)} for {shown(self.experts)}")


@dataclass(frozen=True)
class DropExperts(Message):
    """Stop holding ``experts`` of MoE ``layer``: the server says so at once (clients stop
    sending them at their next step), still answers for them until none came for ``grace``
    seconds, then frees their weights. Refused (``drop_uncovered``) where it is their last
    live holder, unless ``force``."""

    layer: int
    experts: list[int]
    force: bool = False
    grace: float = 2.0

    op = "drop_experts"

    def validate(self) -> None:
        _check_experts(self.layer, self.experts)
        if not 0 <= self.grace <= 600:
            raise ControlError("bad_field", f"grace must be 0-600 seconds, got {self.grace}")


@dataclass(frozen=True)
class HoldingsChange:
    """What an add or drop did: the server's experts in that layer afterwards, and where the
    added weights came from."""

    layer_experts: list[int]
    from_peer: list[int] = field(default_factory=list)
    from_disk: list[int] = field(default_factory=list)

    def to_message(self) -> dict[str, Any]:
        return asdict(self)


WEIGHT_TENSORS = ("w13", "w2")  # LayerExperts' rows: gate and up stacked, then down
WEIGHT_CHUNK = 384 << 10  # raw bytes per chunk: base64 keeps a reply under MAX_LINE


@dataclass(frozen=True)
class ExpertWeights(Message):
    """Bytes ``offset .. offset + WEIGHT_CHUNK`` of one expert's ``tensor`` in ``layer``."""

    layer: int
    expert: int
    tensor: str
    offset: int = 0

    op = "expert_weights"

    def validate(self) -> None:
        if self.tensor not in WEIGHT_TENSORS or self.offset < 0:
            raise ControlError("bad_field", f"tensor must be one of {WEIGHT_TENSORS} and offset "
                               f">= 0, got {shown(self.tensor)}, {self.offset}")


@dataclass(frozen=True)
class WeightsChunk:
    data: str  # base64 of the chunk's bytes
    total: int  # the tensor's bytes
    dtype: str  # float32 | bfloat16 | float16
    shape: list[int]
    sha256: str  # of the whole tensor's bytes (checked once all chunks are in)

    def to_message(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "WeightsChunk":
        return cls(*(message[f] for f in ("data", "total", "dtype", "shape", "sha256")))


def call(address: str, token: str, op: str, timeout: float = 10.0, **fields: Any
         ) -> dict[str, Any]:
    """One request to the server at ``address`` over a fresh connection; its reply
    (``Refused`` if refused, ``TransportError`` if the connection fails)."""
    channel = Channel(address, token, timeout)
    try:
        return channel.call(op, **fields)
    finally:
        channel.close()


def probe(address: str, token: str, timeout: float = 10.0) -> dict[str, Any]:
    """A server's stats (experts, model fingerprint, counters) over a fresh connection."""
    return call(address, token, "stats", timeout)["stats"]
