"""An expert server's control endpoint: the messages a client (or an operator) sends it.

Over the authenticated JSON-line channel (``protocol/lines.py``), each request a record here
that names its op and its reply's record:

    JoinRequest ("join")            -> JoinReply: a reserved slot, and what the server holds
    Ready ("ready")                 -> Done: the slot is served from now on
    Stats ("stats")                 -> ServerStats
    ReleaseSlots ("leave")          -> Done: the slots are back in the pool
    Drain ("drain")                 -> Drained: the server leaves the tier gracefully
                                       (docs/protocol.md, "Leaving")
    AddExperts ("add_experts")      -> HoldingsChange: load replicas while serving, then hold
                                       them (docs/protocol.md, "Replicas")
    DropExperts ("drop_experts")    -> HoldingsChange: stop holding them; their weights go once
                                       no request uses them
    AddParts ("add_parts")          -> PartsChange: hold parts of experts too (tensor
                                       parallelism, docs/switching.md), served before said
    DropParts ("drop_parts")        -> PartsChange: stop holding a layer's parts; they go
                                       once no request uses them
    ExportWeights ("export_weights") -> WeightsRegion: where a peer reads experts' weights
                                       one-sidedly over the weight fabric (a lease)
    ReleaseWeights ("release_weights") -> Done: the peer has read them (the lease ends)
    ExpertWeights ("expert_weights") -> WeightsChunk: a peer reads one expert's weights over
                                       this channel (without a weight fabric between them)

The holdings changes (``drain``, ``add_experts``, ``drop_experts``, ``add_parts``,
``drop_parts``) carry the ``epoch`` of the tier controller's operation lease they are sent
under; a server refuses (``stale_epoch``) one older than the newest it obeyed, so a driver
whose lease lapsed cannot change it behind the next operation (``protocol/operations.py``).

The records below are the only definition of these messages; both ends use them: a sender
passes one to ``call`` (or ``Channel.call``) and gets the reply's record back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.protocol.header import DType
from sglang_eaas.protocol.layout import SlotLayout
from sglang_eaas.protocol.lines import (
    Channel, ControlError, Done, Message, Request, check_fields, holdings_fields, read_holdings,
    shown,
)

SLOTS_PER_CONNECTION = 2  # one per micro-batch in flight (two-batch overlap)


@dataclass(frozen=True)
class JoinReply(Message):
    """Where the reserved slot is, and what the server holds."""

    slot: int
    region: dict  # ibgda.RegionHandle.to_dict()
    base: int  # the slot's offset in the region
    bell: int  # the server doorbell's offset
    layout: SlotLayout
    holdings: ServerHoldings  # per MoE layer (maybe none in some), adapter experts described
    moe_layers: list[int]
    first_seq: int  # the client's first request is first_seq + 1 (a fresh range per join)

    def to_message(self) -> dict[str, Any]:
        return {"slot": self.slot, "region": self.region, "base": self.base, "bell": self.bell,
                "layout": {**asdict(self.layout), "dtype": int(self.layout.dtype)},
                **holdings_fields(self.holdings), "moe_layers": self.moe_layers,
                "first_seq": self.first_seq}

    _KINDS = {"slot": "int", "region": "dict", "base": "int", "bell": "int", "layout": "dict",
              "moe_layers": "list[int]", "first_seq": "int"}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "JoinReply":
        rest, held = read_holdings(message)
        values = check_fields(cls, rest, cls._KINDS)
        raw = values.pop("layout")
        try:
            layout = SlotLayout(**{**raw, "dtype": DType(raw["dtype"])})
        except (TypeError, ValueError, KeyError) as exc:
            raise ControlError("bad_field", f"join: bad layout ({exc})") from None
        return cls(**values, layout=layout, holdings=held)


@dataclass(frozen=True)
class JoinRequest(Request):
    """A client asks for a slot; the server checks it serves the same model and weights."""

    client: str  # the client's id: its monitor member id when it has a monitor, else a name
    fingerprint: str  # MoeModelInfo.fingerprint(): the model's MoE shape
    dtype: str  # the client's activations dtype: float32 | bfloat16 | float16
    transport: str  # the ibgda backend asked for, or "auto"
    expert_digests: list[str]  # weights.expert_digests(): one per expert of the model
    incarnation: str = ""  # the client's monitor incarnation: its slot goes when that does

    op = "join"
    reply = JoinReply


@dataclass(frozen=True)
class Ready(Request):
    """The client has mapped the slot it joined: serve it."""

    op = "ready"


@dataclass(frozen=True)
class ReleaseSlots(Request):
    """The client is done: its slots go back to the pool (answered once they have)."""

    op = "leave"


@dataclass(frozen=True)
class ServerStats(Message):
    """What a server holds and has done: ``stats``' reply (``python -m sglang_eaas.status``,
    the monitor's check of a registration, the launcher's and a peer's checks of weights)."""

    fingerprint: str  # MoeModelInfo.fingerprint() of the model it serves
    pid: int
    num_experts: int  # the model's routed experts per MoE layer
    weight_bytes: int
    expert_digests: Mapping[int, str]  # the model's experts it holds or held -> digest
    holdings: ServerHoldings
    adapter_paths: Mapping[str, str]  # ESFT adapter -> its directory (for copies from disk)
    clients: int  # connections holding slots
    slots: int  # slots in use
    expert_load: Mapping[int, Mapping[int, tuple[int, int]]]  # layer -> expert -> (tokens, ns)
    control_refused: Mapping[str, int]  # control refusals by reason
    refused_connections: int
    counters: Mapping[str, int]  # requests, tokens, batches, rejected_<reason>, replicas_...
    monitor: str = ""  # with a monitor: its URL,
    incarnation: str | None = None  # the server's incarnation there (None: not registered yet)
    status: str = ""  # and serving | draining

    _KINDS = {"fingerprint": "str", "pid": "int", "num_experts": "int", "weight_bytes": "int",
              "adapter_paths": "dict", "clients": "int", "slots": "int",
              "control_refused": "dict", "refused_connections": "int", "monitor": "str",
              "incarnation": "str | None", "status": "str"}

    def counter(self, name: str) -> int:
        return self.counters.get(name, 0)

    def to_message(self) -> dict[str, Any]:
        return {**self.counters, "fingerprint": self.fingerprint, "pid": self.pid,
                "num_experts": self.num_experts, "weight_bytes": self.weight_bytes,
                "expert_digests": {str(e): d for e, d in self.expert_digests.items()},
                **holdings_fields(self.holdings),
                "adapter_paths": dict(self.adapter_paths), "clients": self.clients,
                "slots": self.slots,
                "expert_load": {str(layer): {str(e): list(v) for e, v in experts.items()}
                                for layer, experts in self.expert_load.items()},
                "control_refused": dict(self.control_refused),
                "refused_connections": self.refused_connections,
                **({"monitor": self.monitor, "incarnation": self.incarnation,
                    "status": self.status} if self.monitor else {})}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "ServerStats":
        rest, held = read_holdings(message)
        typed = check_fields(cls, rest, cls._KINDS)
        digests, load = rest.get("expert_digests", {}), rest.get("expert_load", {})
        try:
            return cls(**typed, holdings=held,
                       expert_digests={int(e): str(d) for e, d in digests.items()},
                       expert_load={int(layer): {int(e): (int(v[0]), int(v[1]))
                                                 for e, v in experts.items()}
                                    for layer, experts in load.items()},
                       counters={k: v for k, v in rest.items()
                                 if type(v) is int and k not in cls._KINDS})
        except (AttributeError, ValueError, TypeError, IndexError) as exc:
            raise ControlError("bad_field", f"stats: {exc}") from None


@dataclass(frozen=True)
class Stats(Request):
    """What the server holds and has done."""

    op = "stats"
    reply = ServerStats


@dataclass(frozen=True)
class Drained(Message):
    clients: int  # clients still using the server when it started draining


@dataclass(frozen=True)
class Drain(Request):
    """Leave the tier gracefully: clients stop sending first, in-flight work finishes, then the
    server exits. Refused (``drain_uncovered``) where the server is the last live holder of an
    expert, unless ``force``."""

    force: bool = False
    timeout: float = 30.0  # seconds to wait for clients to stop using the server
    epoch: int = 0  # the operation lease it is sent under (0: none; protocol/operations.py)

    op = "drain"
    reply = Drained


@dataclass(frozen=True)
class HoldingsChange(Message):
    """What an add or drop did: the server's experts in that layer afterwards, and where the
    added weights came from."""

    layer_experts: list[int]
    from_peer: list[int] = field(default_factory=list)
    from_disk: list[int] = field(default_factory=list)


def _check_experts(layer: int, experts: list[int]) -> None:
    if layer < 0 or not experts or any(e < 0 for e in experts) or len(set(experts)) != len(
            experts):
        raise ControlError("bad_field", f"a holdings change names a MoE layer >= 0 and distinct "
                           f"expert ids >= 0, got layer {layer}, experts {shown(experts)}")


@dataclass(frozen=True)
class AddExperts(Request):
    """Hold ``experts`` of MoE ``layer`` too (replicas): their weights are read from the
    expert server ``source`` (its control address) if given, from the checkpoint on disk
    otherwise or if that fails; the server serves them before it says it holds them. With
    ``parts`` > 1 they are assembled instead from the parts of ``parts``-part slices this
    server holds and those ``part_sources`` (address -> routed part ids) hold, read over the
    weight fabric (an expert a part of which none gives: from disk).

    With ``adapter``: ``experts`` are physical ids (>= the model's expert count) of the ESFT
    adapter ``adapter`` (its directory ``adapter_path``), ``replaces[i]`` the base expert that
    ``experts[i]`` replaces; from disk, the weights come from the adapter's files."""

    layer: int
    experts: list[int]
    source: str = ""
    adapter: str = ""
    adapter_path: str = ""
    replaces: list[int] = field(default_factory=list)
    parts: int = 0
    part_sources: dict = field(default_factory=dict)  # control address -> [routed part ids]
    epoch: int = 0  # the operation lease it is sent under (0: none; protocol/operations.py)

    op = "add_experts"
    reply = HoldingsChange

    def validate(self) -> None:
        _check_experts(self.layer, self.experts)
        if self.parts and (self.parts < 2 or self.adapter or not _part_sources(
                self.part_sources)):
            raise ControlError("bad_field", f"experts assembled from parts name parts >= 2 and "
                               f"part_sources (address -> routed part ids), got parts "
                               f"{shown(self.parts)}, part_sources {shown(self.part_sources)}")
        if self.adapter and (not self.adapter_path or len(self.replaces) != len(self.experts)
                             or any(type(e) is not int or e < 0 for e in self.replaces)):
            raise ControlError("bad_field", f"an adapter's add names its path and one base "
                               f"expert per physical expert, got path {shown(self.adapter_path)}"
                               f", replaces {shown(self.replaces)} for {shown(self.experts)}")


@dataclass(frozen=True)
class DropExperts(Request):
    """Stop holding ``experts`` of MoE ``layer``: the server says so at once (clients stop
    sending them at their next step), still answers for them until none came for ``grace``
    seconds, then frees their weights. Refused (``drop_uncovered``) where it is their last
    live holder, unless ``force``."""

    layer: int
    experts: list[int]
    force: bool = False
    grace: float = 2.0
    epoch: int = 0  # the operation lease it is sent under (0: none)

    op = "drop_experts"
    reply = HoldingsChange

    def validate(self) -> None:
        _check_experts(self.layer, self.experts)
        if not 0 <= self.grace <= 600:
            raise ControlError("bad_field", f"grace must be 0-600 seconds, got {self.grace}")


@dataclass(frozen=True)
class PartsChange(Message):
    """What an add or drop of parts did: the layer's cut and the routed part ids the server
    holds there afterwards, and where the added parts were cut from (routed ids)."""

    parts: int
    ids: list[int]
    from_self: list[int] = field(default_factory=list)  # its own whole rows
    from_peer: list[int] = field(default_factory=list)  # a holder's, over the weight fabric
    from_disk: list[int] = field(default_factory=list)  # the checkpoint


def _part_sources(sources: object) -> bool:
    """Whether ``sources`` maps addresses to lists of ids >= 0."""
    return isinstance(sources, dict) and all(
        isinstance(a, str) and isinstance(ids, list) and all(type(e) is int and e >= 0
                                                              for e in ids)
        for a, ids in sources.items())


@dataclass(frozen=True)
class AddParts(Request):
    """Hold the parts ``ids`` (routed ids ``e * parts + p``: part ``p`` of ``parts`` of expert
    ``e``) of MoE ``layer`` too, for tensor parallelism (docs/switching.md). Each part is cut
    from this server's own whole rows of its expert where it holds them, else from the rows of
    a holder in ``sources`` (control address -> the experts to read there) over the weight
    fabric, else read from the checkpoint. Served before the server says it holds them. A
    layer holds parts of one cut at a time."""

    layer: int
    parts: int
    ids: list[int]
    sources: dict = field(default_factory=dict)  # control address -> [expert ids]
    epoch: int = 0  # the operation lease it is sent under (0: none)

    op = "add_parts"
    reply = PartsChange

    def validate(self) -> None:
        _check_experts(self.layer, self.ids)
        if type(self.parts) is not int or self.parts < 2:
            raise ControlError("bad_field", f"parts is the number of slices an expert is cut "
                               f"into, at least 2, got {shown(self.parts)}")
        if not _part_sources(self.sources):
            raise ControlError("bad_field", f"sources maps holders' control addresses to the "
                               f"expert ids to read there, got {shown(self.sources)}")


@dataclass(frozen=True)
class DropParts(Request):
    """Stop holding every part of MoE ``layer``: said at once (clients stop sending them at
    their next step), still answered until none came for ``grace`` seconds, then freed.
    Refused (``drop_uncovered``) where the layer would lose an expert, unless ``force``."""

    layer: int
    force: bool = False
    grace: float = 2.0
    epoch: int = 0  # the operation lease it is sent under (0: none)

    op = "drop_parts"
    reply = PartsChange

    def validate(self) -> None:
        if type(self.layer) is not int or self.layer < 0:
            raise ControlError("bad_field", f"layer is a MoE layer >= 0, got {shown(self.layer)}")
        if not 0 <= self.grace <= 600:
            raise ControlError("bad_field", f"grace must be 0-600 seconds, got {self.grace}")


WEIGHT_TENSORS = ("w13", "w2")  # LayerExperts' rows: gate and up stacked, then down
WEIGHT_CHUNK = 384 << 10  # raw bytes per chunk: base64 keeps a reply under MAX_LINE


@dataclass(frozen=True)
class WeightsChunk(Message):
    data: str  # base64 of the chunk's bytes
    total: int  # the tensor's bytes
    dtype: str  # float32 | bfloat16 | float16
    shape: list[int]
    sha256: str  # of the whole tensor's bytes (checked once all chunks are in)


@dataclass(frozen=True)
class ExpertWeights(Request):
    """Bytes ``offset .. offset + WEIGHT_CHUNK`` of one expert's ``tensor`` in ``layer``."""

    layer: int
    expert: int
    tensor: str
    offset: int = 0

    op = "expert_weights"
    reply = WeightsChunk

    def validate(self) -> None:
        if self.tensor not in WEIGHT_TENSORS or self.offset < 0:
            raise ControlError("bad_field", f"tensor must be one of {WEIGHT_TENSORS} and offset "
                               f">= 0, got {shown(self.tensor)}, {self.offset}")


@dataclass(frozen=True)
class WeightsRegion(Message):
    """Where the asked experts' weights are: rows of one layer version's region (``w13`` rows
    from offset 0, ``w2`` rows from ``w2_offset``), kept for the reader until it releases
    ``lease`` (or the lease times out)."""

    lease: str
    region: dict  # ibgda.RegionHandle.to_dict()
    dtype: str  # float32 | bfloat16 | float16
    rows: int  # rows of the version lent (the region may have spare rows past them)
    w2_offset: int
    experts: list[int]
    expert_rows: list[int]  # experts[i]'s row in the region
    digests: list[str]  # experts[i]'s digest (the checkpoint's or the adapter's expert)

    def validate(self) -> None:
        if not (len(self.experts) == len(self.expert_rows) == len(self.digests)) or any(
                not 0 <= r < self.rows for r in self.expert_rows) or self.w2_offset < 0:
            raise ControlError("bad_field", f"a weights region names one row (< rows "
                               f"{self.rows}) and one digest per expert, got "
                               f"{shown(self.expert_rows)} for {shown(self.experts)}")


@dataclass(frozen=True)
class ExportWeights(Request):
    """Lend ``experts``' weights of MoE ``layer`` for a one-sided read (``adapter``: ESFT
    adapter experts by physical id; ``parts``: the parts it holds, by routed id, each with its
    expert's digest). Refused (``weights_not_held``) for experts not held,
    (``no_weight_fabric``) by a server whose weights are not in the fabric."""

    layer: int
    experts: list[int]
    adapter: bool = False
    parts: int = 0  # > 1: the server's parts of ``parts``-part slices, ``experts`` routed ids

    op = "export_weights"
    reply = WeightsRegion

    def validate(self) -> None:
        _check_experts(self.layer, self.experts)


@dataclass(frozen=True)
class ReleaseWeights(Request):
    """The reader of ``lease`` is done with the region."""

    lease: str

    op = "release_weights"
    reply = Done


REQUESTS = (JoinRequest, Ready, Stats, ReleaseSlots, Drain, AddExperts, DropExperts, AddParts,
            DropParts,
            ExportWeights, ReleaseWeights, ExpertWeights)
OPS = tuple(r.op for r in REQUESTS)


def call(address: str, request: Request, token: str, timeout: float = 10.0):
    """``request`` to the server at ``address`` over a fresh connection; its reply's record
    (``Refused`` if refused, ``TransportError`` if the connection fails)."""
    channel = Channel(address, token, timeout)
    try:
        return channel.call(request)
    finally:
        channel.close()


def probe(address: str, token: str, timeout: float = 10.0) -> ServerStats:
    """A server's stats (experts, model fingerprint, counters) over a fresh connection."""
    return call(address, Stats(), token, timeout)
