"""The monitor's records: who is in the expert tier, and the messages that change or watch it.

Over the authenticated JSON-line channel (``protocol/lines.py``), on one connection per member
(its *session*: the member is lost when the session closes or its heartbeats stop), each request
a record here that names its op and its reply's record:

    Register ("register")         -> Registered: the incarnation, revision, suspect and loss
                                     timeouts
    Heartbeat ("heartbeat")       -> Revision; refused ("unknown_incarnation") once lost:
                                     register again
    SetStatus ("set_status")      -> Revision
    SetHoldings ("set_holdings")  -> Revision: a server now holds other experts (a replica
                                     added or dropped)
    Leave ("leave")               -> Done: the member leaves, in order
and on any connection:
    Watch ("watch")               -> Watched: the ``Snapshot`` as soon as the revision passes
                                     ``after`` (or at ``timeout``)
    Report ("report")             -> Evicted: a client saw a server time out; the monitor
                                     evicts it
    TierStats ("stats")           -> MonitorStats
and the tier controller's operation lease and records (``protocol/operations.py``):
    Acquire, Renew, RecordOperation, ListOperations

Members are named by a stable ``id`` (a server: its control address; a client: its client id)
and an ``incarnation`` the monitor gives each registration, so a server that comes back (after a
SIGSTOP, say) is a new incarnation that clients join afresh. The etcd backend
(``monitor_client/etcd.py``) stores the same ``Member`` records, signed with the shared token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from sglang_eaas.holdings import Holdings, ServerHoldings
from sglang_eaas.protocol import operations
from sglang_eaas.protocol.lines import (
    ControlError, Message, Request, check_fields, holdings_fields, read_holdings, shown,
)

SERVER, CLIENT = "server", "client"
SERVING, DRAINING = "serving", "draining"


def _check_status(status: str) -> None:
    if status not in (SERVING, DRAINING):
        raise ControlError("bad_field", f"status {shown(status)} is neither {SERVING!r} nor "
                           f"{DRAINING!r}")


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
    # servers: their experts per MoE layer, ESFT adapter experts described (on the wire:
    # ``layer_experts`` and ``adapter_experts``, ``lines.holdings_fields``)
    holdings: ServerHoldings = field(default_factory=ServerHoldings)
    load: dict = field(default_factory=dict)  # counters from the last heartbeat
    beat_age: float = 0.0  # seconds since the last heartbeat, when a snapshot was taken
    # no heartbeat for the suspect timeout, not lost (yet): clients prefer its experts' other
    # holders; its next heartbeat clears it (the monitor's, like beat_age)
    suspected: bool = False
    # servers: the newest operation epoch they obeyed (protocol/operations.py), so a monitor
    # that restarted never grants a lease older than what the servers have seen
    epoch: int = 0

    @classmethod
    def from_message(cls, message: Any) -> "Member":
        if not isinstance(message, dict):
            raise ControlError("bad_field", f"a member must be an object, got {shown(message)}")
        rest, held = read_holdings(message)
        kinds = {f.name: f.type for f in fields(cls) if f.name != "holdings"}
        record = cls(**check_fields(cls, rest, kinds), holdings=held)
        record.validate()
        return record

    def to_message(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "holdings"},
                **holdings_fields(self.holdings)}

    def validate(self) -> None:
        if self.kind not in (SERVER, CLIENT):
            raise ControlError("bad_field", f"member kind {shown(self.kind)} is neither "
                               f"{SERVER!r} nor {CLIENT!r}")
        _check_status(self.status)
        if not self.id or len(self.id) > 256:
            raise ControlError("bad_field", "a member id is 1 to 256 characters")

    def key(self) -> tuple[str, str]:
        return self.kind, self.id

    def with_status(self, status: str) -> "Member":
        return replace(self, status=status)

    def with_holdings(self, holdings: ServerHoldings) -> "Member":
        return replace(self, holdings=holdings)


# Why a member departed (``Departure.reason``): it left, a new incarnation of it registered, or
# it was lost: its monitor connection closed (its process died, or the network closed it), a
# client reported that it did not answer within the result timeout (an eviction: the data
# path's confirmation), or it sent no heartbeat for the loss timeout. Losses are counted by
# reason (``losses_REASON``, ``sglang_eaas_server_losses``).
LEFT, REPLACED = "left", "replaced"
CONNECTION_CLOSED, RESULT_TIMEOUT, NO_HEARTBEAT = "connection_closed", "result_timeout", "heartbeat"
DEPARTURE_REASONS = (LEFT, REPLACED, CONNECTION_CLOSED, RESULT_TIMEOUT, NO_HEARTBEAT)


@dataclass(frozen=True)
class Departure:
    """A member that left the tier: why, in words (for logs and ``status``) and as a reason of
    ``DEPARTURE_REASONS`` (for counting and for what a client does)."""

    kind: str
    id: str
    incarnation: str
    why: str  # "left", "lost: no heartbeat for 10.2s", "lost: connection closed", "evicted: ..."
    revision: int
    reason: str = ""  # "": a sender older than the field; read from ``why`` then

    def __post_init__(self) -> None:
        if not self.reason:
            object.__setattr__(self, "reason", loss_reason(self.why))
        elif self.reason not in DEPARTURE_REASONS:
            raise ControlError("bad_field", f"a departure's reason must be one of "
                               f"{', '.join(DEPARTURE_REASONS)}, not {self.reason!r}")


def loss_reason(why: str) -> str:
    """The reason of a departure whose sender gave only ``why`` (a monitor or etcd marker older
    than ``Departure.reason``): read from its words."""
    if why.startswith("lost: no heartbeat"):
        return NO_HEARTBEAT
    if why.startswith("evicted"):
        return RESULT_TIMEOUT
    if why.startswith("replaced"):
        return REPLACED
    return LEFT if why == LEFT else CONNECTION_CLOSED


@dataclass(frozen=True)
class Snapshot(Message):
    """The tier at one revision of the monitor: its members, and its latest departures."""

    revision: int
    members: tuple[Member, ...]
    departures: tuple[Departure, ...] = ()

    def servers(self, fingerprint: str | None = None) -> list[Member]:
        return [m for m in self.members if m.kind == SERVER
                and (fingerprint is None or m.fingerprint == fingerprint)]

    def clients(self) -> list[Member]:
        return [m for m in self.members if m.kind == CLIENT]

    def active_and_standby(self, fingerprint: str | None = None
                           ) -> tuple[list[str], list[str]]:
        """The serving servers (of ``fingerprint``'s model) that hold experts or parts, and
        those that hold none (standby)."""
        active, standby = [], []
        for m in self.servers(fingerprint):
            if m.status == SERVING:
                (active if m.holdings.holds_any() else standby).append(m.id)
        return active, standby

    def holdings(self, fingerprint: str | None = None) -> Holdings:
        """What the serving servers (of the model ``fingerprint``, if given) hold, in the
        snapshot's order: the one way from a snapshot to the tier's ``Holdings``."""
        return Holdings({m.id: m.holdings for m in self.servers(fingerprint)
                         if m.status == SERVING})

    def to_message(self) -> dict[str, Any]:
        return {"revision": self.revision, "members": [m.to_message() for m in self.members],
                "departures": [asdict(d) for d in self.departures]}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "Snapshot":
        if not isinstance(message, dict) or not isinstance(message.get("members"), list):
            raise ControlError("bad_field", "a snapshot is {revision, members, departures}")
        try:
            departures = tuple(Departure(**d) for d in message.get("departures", ()))
        except TypeError as exc:
            raise ControlError("bad_field", f"a snapshot's departure: {exc}") from None
        return cls(message["revision"], tuple(Member.from_message(m)
                                              for m in message["members"]), departures)


# -- replies ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Registered(Message):
    incarnation: str
    revision: int
    loss_timeout: float
    suspect_timeout: float


@dataclass(frozen=True)
class Revision(Message):
    """The monitor's revision after a change."""

    revision: int


@dataclass(frozen=True)
class Watched(Message):
    snapshot: Snapshot

    def to_message(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot.to_message()}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "Watched":
        return cls(Snapshot.from_message(message.get("snapshot")))


@dataclass(frozen=True)
class Evicted(Message):
    evicted: bool  # whether the server was still that incarnation


@dataclass(frozen=True)
class MonitorStats(Message):
    """The monitor's counters: registrations, losses and evictions by kind, refusals by
    reason (``control_refused``), and the tier's size now."""

    revision: int
    servers: int
    clients: int
    control_refused: Mapping[str, int]
    refused_connections: int
    counters: Mapping[str, int]  # servers_registered, clients_lost, evictions, ...

    _KINDS = {"revision": "int", "servers": "int", "clients": "int", "control_refused": "dict",
              "refused_connections": "int"}

    def to_message(self) -> dict[str, Any]:
        return {**self.counters, **{name: getattr(self, name) for name in self._KINDS}}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "MonitorStats":
        return cls(**check_fields(cls, message, cls._KINDS),
                   counters={k: v for k, v in message.items()
                             if type(v) is int and k not in cls._KINDS})


# -- requests ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Register(Request):
    member: Member  # incarnation, beat_age and suspected are the monitor's
    heartbeat: float  # the member's heartbeat period, seconds

    op = "register"
    reply = Registered

    def to_message(self) -> dict[str, Any]:
        member = {k: v for k, v in self.member.to_message().items()
                  if k not in ("incarnation", "beat_age", "suspected")}
        return {"member": member, "heartbeat": self.heartbeat}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "Register":
        values = check_fields(cls, message, {"heartbeat": "float"})
        if "member" not in message:
            raise ControlError("bad_field", "register needs field 'member'")
        return cls(Member.from_message(message["member"]), **values)


@dataclass(frozen=True)
class Heartbeat(Request):
    incarnation: str
    load: dict = field(default_factory=dict)

    op = "heartbeat"
    reply = Revision


@dataclass(frozen=True)
class SetStatus(Request):
    incarnation: str
    status: str

    op = "set_status"
    reply = Revision

    def validate(self) -> None:
        _check_status(self.status)


@dataclass(frozen=True)
class SetHoldings(Request):
    """A server's experts per MoE layer changed (and which of them are adapter experts)."""

    incarnation: str
    holdings: ServerHoldings

    op = "set_holdings"
    reply = Revision

    def to_message(self) -> dict[str, Any]:
        return {"incarnation": self.incarnation, **holdings_fields(self.holdings)}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "SetHoldings":
        rest, held = read_holdings(message)
        return cls(**check_fields(cls, rest, {"incarnation": "str"}), holdings=held)


@dataclass(frozen=True)
class Leave(Request):
    incarnation: str

    op = "leave"


@dataclass(frozen=True)
class Watch(Request):
    after: int = -1  # answer once the revision is past this (-1: at once)
    timeout: float = 10.0  # seconds to wait for that at most

    op = "watch"
    reply = Watched


@dataclass(frozen=True)
class Report(Request):
    """A client saw ``server`` (this ``incarnation``) fail to answer within its timeout."""

    server: str
    incarnation: str
    why: str

    op = "report"
    reply = Evicted


@dataclass(frozen=True)
class TierStats(Request):
    """The monitor's counters."""

    op = "stats"
    reply = MonitorStats


REQUESTS = (Register, Heartbeat, SetStatus, SetHoldings, Leave, Watch, Report, TierStats,
            *operations.REQUESTS)
OPS = tuple(r.op for r in REQUESTS)


# -- signed records (the etcd backend, where no monitor checks who writes) --------------------
def sign_json(body: Any, token: str) -> bytes:
    """``body`` (JSON) as stored in etcd: its JSON and an HMAC-SHA256 of it under the shared
    token."""
    text = json.dumps(body, sort_keys=True)
    mac = hmac.new(token.encode(), text.encode(), hashlib.sha256).hexdigest()
    return json.dumps({"member": text, "hmac": mac}).encode()


def verify_json(value: bytes, token: str) -> Any:
    """The JSON body of a stored record; ``ControlError("forged_registration")`` unless its HMAC
    is the shared token's, ``ControlError("malformed")`` for a malformed one."""
    try:
        record = json.loads(value)
        body, mac = record["member"], record["hmac"]
        assert isinstance(body, str) and isinstance(mac, str)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ControlError("malformed", "a stored record is not {member, hmac}") from None
    expected = hmac.new(token.encode(), body.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(mac, expected):
        raise ControlError("forged_registration", "a stored record is not signed with the "
                           "shared token")
    try:
        return json.loads(body)
    except ValueError:
        raise ControlError("malformed", "a stored record's body is not JSON") from None


def sign(member: Member, token: str) -> bytes:
    """``member`` as stored in etcd (``sign_json``)."""
    return sign_json(member.to_message(), token)


def verify(value: bytes, token: str) -> Member:
    """The member of a stored record (``verify_json``); ``ControlError("bad_field")`` for a
    record that is not a member."""
    return Member.from_message(verify_json(value, token))
