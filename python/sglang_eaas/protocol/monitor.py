"""The monitor's records: who is in the expert tier, and the messages that change or watch it.

Over the authenticated JSON-line channel (``protocol/lines.py``), on one connection per member
(its *session*: the member is lost when the session closes or its heartbeats stop):

    -> {"op": "register", ...Register}     <- {"ok": true, "incarnation": I, "revision": R,
                                                "loss_timeout": S}
    -> {"op": "heartbeat", ...Heartbeat}   <- {"ok": true, "revision": R}; refused
                                              ("unknown_incarnation") once lost: register again
    -> {"op": "set_status", ...SetStatus}  <- {"ok": true, "revision": R}
    -> {"op": "set_holdings", ...SetHoldings} <- {"ok": true, "revision": R}: a server now
                                              holds other experts (a replica added or dropped)
    -> {"op": "leave", ...Leave}           <- {"ok": true}: the member leaves, in order
and on any connection:
    -> {"op": "watch", ...Watch}           <- {"ok": true, "snapshot": Snapshot}: as soon as the
                                              revision passes ``after`` (or at ``timeout``)
    -> {"op": "report", ...Report}         <- {"ok": true, "evicted": bool}: a client saw a
                                              server time out; the monitor evicts it
    -> {"op": "stats"}                     <- {"ok": true, "stats": {...}}

Members are named by a stable ``id`` (a server: its control address; a client: its client id)
and an ``incarnation`` the monitor gives each registration, so a server that comes back (after a
SIGSTOP, say) is a new incarnation that clients join afresh. The etcd backend
(``monitor/etcd.py``) stores the same ``Member`` records, signed with the shared token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from sglang_eaas.protocol.lines import ControlError, Message, shown

OPS = ("register", "heartbeat", "set_status", "set_holdings", "leave", "watch", "report",
       "stats")
SERVER, CLIENT = "server", "client"
SERVING, DRAINING = "serving", "draining"


def _check_status(status: str) -> None:
    if status not in (SERVING, DRAINING):
        raise ControlError("bad_field", f"status {shown(status)} is neither {SERVING!r} nor "
                           f"{DRAINING!r}")


def _check_layer_experts(layer_experts: dict) -> None:
    for layer, ids in layer_experts.items():
        if not (layer.isdigit() and isinstance(ids, list)
                and all(type(e) is int and e >= 0 for e in ids)):
            raise ControlError("bad_field", f"layer_experts maps MoE layer numbers to lists of "
                               f"expert ids, got {shown(layer)}: {shown(ids)}")


def _check_adapter_experts(adapter_experts: dict) -> None:
    """``{str(layer): {str(physical id): [adapter name, base expert, digest]}}``."""
    for layer, experts in adapter_experts.items():
        ok = layer.isdigit() and isinstance(experts, dict) and all(
            physical.isdigit() and isinstance(v, list) and len(v) == 3
            and isinstance(v[0], str) and type(v[1]) is int and v[1] >= 0
            and isinstance(v[2], str) for physical, v in experts.items())
        if not ok:
            raise ControlError("bad_field", f"adapter_experts maps MoE layer numbers to "
                               f"{{physical expert id: [adapter, base expert, digest]}}, got "
                               f"{shown(layer)}: {shown(experts)}")


@dataclass(frozen=True)
class Member(Message):
    """One expert server or attention client, as the monitor knows it."""

    kind: str  # SERVER | CLIENT
    id: str  # a server's control address; a client's client id
    host: str
    pid: int
    incarnation: str = ""  # given by the monitor at registration
    status: str = SERVING  # SERVING | DRAINING (servers)
    fingerprint: str = ""  # servers: MoeModelInfo.fingerprint() of what they serve
    num_experts: int = 0  # servers: the model's routed experts per MoE layer
    layer_experts: dict = field(default_factory=dict)  # servers: str(MoE layer) -> expert ids
    # servers: which held experts are ESFT adapter experts (``_check_adapter_experts``)
    adapter_experts: dict = field(default_factory=dict)
    load: dict = field(default_factory=dict)  # counters from the last heartbeat
    beat_age: float = 0.0  # seconds since the last heartbeat, when a snapshot was taken

    @classmethod
    def from_message(cls, message: Any) -> "Member":
        if not isinstance(message, dict):
            raise ControlError("bad_field", f"a member must be an object, got {shown(message)}")
        return super().from_message(message)

    def validate(self) -> None:
        if self.kind not in (SERVER, CLIENT):
            raise ControlError("bad_field", f"member kind {shown(self.kind)} is neither "
                               f"{SERVER!r} nor {CLIENT!r}")
        _check_status(self.status)
        if not self.id or len(self.id) > 256:
            raise ControlError("bad_field", "a member id is 1 to 256 characters")
        _check_layer_experts(self.layer_experts)
        _check_adapter_experts(self.adapter_experts)

    def holdings(self) -> dict[int, list[int]]:
        """A server's experts per MoE layer."""
        return {int(layer): sorted(ids) for layer, ids in self.layer_experts.items()}

    def to_message(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> tuple[str, str]:
        return self.kind, self.id

    def with_status(self, status: str) -> "Member":
        return replace(self, status=status)

    def base_holdings(self) -> dict[int, list[int]]:
        """A server's experts of the model per MoE layer, without ESFT adapter experts
        (physical ids past the model's experts: the balancer leaves those alone)."""
        return {layer: [e for e in ids if e < self.num_experts]
                for layer, ids in self.holdings().items()}

    def adapter_holdings(self) -> dict[int, dict[int, tuple[str, int, str]]]:
        """A server's adapter experts: MoE layer -> physical id -> (adapter, base, digest)."""
        return {int(layer): {int(p): tuple(v) for p, v in experts.items()}
                for layer, experts in self.adapter_experts.items()}

    def with_holdings(self, layer_experts: dict, adapter_experts: dict | None = None
                      ) -> "Member":
        return replace(self, layer_experts=layer_experts,
                       adapter_experts=self.adapter_experts if adapter_experts is None
                       else adapter_experts)


@dataclass(frozen=True)
class Departure:
    """A member that left the tier, and why (for logs and ``status``)."""

    kind: str
    id: str
    incarnation: str
    why: str  # "left", "lost: no heartbeat for 0.6s", "lost: connection closed", "evicted: ..."
    revision: int


@dataclass(frozen=True)
class Snapshot:
    """The tier at one revision of the monitor: its members, and its latest departures."""

    revision: int
    members: tuple[Member, ...]
    departures: tuple[Departure, ...] = ()

    def servers(self, fingerprint: str | None = None) -> list[Member]:
        return [m for m in self.members if m.kind == SERVER
                and (fingerprint is None or m.fingerprint == fingerprint)]

    def clients(self) -> list[Member]:
        return [m for m in self.members if m.kind == CLIENT]

    def to_message(self) -> dict[str, Any]:
        return {"revision": self.revision, "members": [m.to_message() for m in self.members],
                "departures": [asdict(d) for d in self.departures]}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "Snapshot":
        return cls(message["revision"], tuple(Member(**m) for m in message["members"]),
                   tuple(Departure(**d) for d in message.get("departures", ())))


@dataclass(frozen=True)
class Register(Message):
    member: dict  # a Member's fields (incarnation and beat_age are the monitor's)
    heartbeat: float  # the member's heartbeat period, seconds

    def validate(self) -> None:
        Member.from_message(self.member)


@dataclass(frozen=True)
class Heartbeat(Message):
    incarnation: str
    load: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SetStatus(Message):
    incarnation: str
    status: str

    def validate(self) -> None:
        _check_status(self.status)


@dataclass(frozen=True)
class SetHoldings(Message):
    """A server's experts per MoE layer changed (``Member.layer_experts``'s form), and which
    of them are adapter experts (``Member.adapter_experts``'s form)."""

    incarnation: str
    layer_experts: dict
    adapter_experts: dict = field(default_factory=dict)

    def validate(self) -> None:
        _check_layer_experts(self.layer_experts)
        _check_adapter_experts(self.adapter_experts)


@dataclass(frozen=True)
class Leave(Message):
    incarnation: str


@dataclass(frozen=True)
class Watch(Message):
    after: int = -1  # answer once the revision is past this (-1: at once)
    timeout: float = 10.0  # seconds to wait for that at most


@dataclass(frozen=True)
class Report(Message):
    """A client saw ``server`` (this ``incarnation``) fail to answer within its timeout."""

    server: str
    incarnation: str
    why: str


# -- signed records (the etcd backend, where no monitor checks who writes) --------------------
def sign(member: Member, token: str) -> bytes:
    """``member`` as stored in etcd: its JSON and an HMAC-SHA256 of it under the shared token."""
    body = json.dumps(member.to_message(), sort_keys=True)
    mac = hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"member": body, "hmac": mac}).encode()


def verify(value: bytes, token: str) -> Member:
    """The member of a stored record; ``ControlError("forged_registration")`` unless its HMAC
    is the shared token's, ``ControlError("bad_field")`` for a malformed one."""
    try:
        record = json.loads(value)
        body, mac = record["member"], record["hmac"]
        assert isinstance(body, str) and isinstance(mac, str)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ControlError("malformed", "a stored member record is not {member, hmac}") from None
    expected = hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac, expected):
        raise ControlError("forged_registration", "a stored member record is not signed with "
                           "the shared token")
    return Member.from_message(json.loads(body))
