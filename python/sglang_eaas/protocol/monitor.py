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

    def holdings(self) -> dict[int, list[int]]:
        """A server's experts per MoE layer."""
        return {int(layer): sorted(ids) for layer, ids in self.layer_experts.items()}

    def to_message(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> tuple[str, str]:
        return self.kind, self.id

    def with_status(self, status: str) -> "Member":
        return replace(self, status=status)

    def with_holdings(self, layer_experts: dict) -> "Member":
        return replace(self, layer_experts=layer_experts)


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
    """A server's experts per MoE layer changed (``Member.layer_experts``'s form)."""

    incarnation: str
    layer_experts: dict

    def validate(self) -> None:
        _check_layer_experts(self.layer_experts)


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
