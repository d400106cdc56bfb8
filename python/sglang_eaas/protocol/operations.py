"""The tier controller's records: operations on the expert tier and the lease that serialises
them (docs/protocol.md, "Operations"; docs/elastic.md, "The tier controller").

Every change of what the tier holds (a resize, a retirement, an EP<->TP switch, a rebalance pass,
an ESFT adapter's placement or unload, a deployment's restart of a lost server) is one
*operation*: it takes the tier's one *operation lease* from the monitor, is recorded there from
start to end, and gives the lease back when it ends. The monitor ops (over the monitor's line
channel; the etcd backend keeps the same records as keys):

    Acquire ("acquire")             -> Acquired: the lease and its epoch, or why not (the
                                       running operation), or the known operation of that id
    Renew ("renew")                 -> Done; refused ("lease_lost") once the lease lapsed
    RecordOperation ("record_operation")
                                    -> Done: the holder's progress or end; a final state of
                                       the holder's own operation gives the lease back
    ListOperations ("operations")   -> OperationList: one operation, or the latest ones

The *epoch* of a lease grows with every grant and never goes back (etcd: the revision that
created the lease's key; the TCP monitor: a counter it re-learns, after a restart, from the
servers and from the holder that reclaims its lease). Every holdings change a driver sends an
expert server carries it, and a server refuses one older than the newest it has obeyed
(``stale_epoch``): a driver whose lease lapsed cannot change the tier behind its successor.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from sglang_eaas import envs
from sglang_eaas.holdings import Holdings
from sglang_eaas.protocol.lines import (
    ControlError, Message, Request, check_fields, holdings_fields, read_holdings, shown,
)

PENDING, RUNNING, DONE, FAILED, ROLLED_BACK = "pending", "running", "done", "failed", "rolled_back"
STATES = (PENDING, RUNNING, DONE, FAILED, ROLLED_BACK)
FINAL = (DONE, FAILED, ROLLED_BACK)
# what an operation does (its ``target``'s shape is the kind's: docs/protocol.md)
RESIZE, RETIRE, SWITCH, REBALANCE = "resize", "retire", "switch", "rebalance"
ADAPTER_LOAD, ADAPTER_UNLOAD, RESTART = "adapter-load", "adapter-unload", "restart"
KINDS = (RESIZE, RETIRE, SWITCH, REBALANCE, ADAPTER_LOAD, ADAPTER_UNLOAD, RESTART)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
MAX_TEXT = 2048  # characters of a requester, result or progress line
TOKEN_HEADER = "X-Eaas-Token"  # the admin API's HTTP header carrying the tier's token
MAX_WAIT = 600.0  # seconds a request may wait for the operation holding the tier, at most
LEASE_TTL = 10.0  # seconds an operation lease lasts without a renewal (renewed every quarter)


def lease_ttl() -> float:
    """The operation lease's ttl: ``SGLANG_EAAS_OPERATION_LEASE`` (1-600 s), else
    ``LEASE_TTL``; ``ValueError`` (one sentence) for another value."""
    given = envs.OPERATION_LEASE.get().strip()
    if not given:
        return LEASE_TTL
    try:
        ttl = float(given)
    except ValueError:
        ttl = -1.0
    if not 1 <= ttl <= 600:
        raise ValueError(f"{envs.OPERATION_LEASE.name}={given!r}: the operation lease lasts "
                         "1-600 seconds")
    return ttl


class LeaseLost(RuntimeError):
    """The operation lease lapsed or was taken over: the operation must stop changing the
    tier (expert servers refuse its older epoch once a newer holder changed them)."""


class Fence:
    """What a driver's holdings changes carry: the epoch of the operation lease they are sent
    under (``epoch`` on every change), and whether the lease still holds (``check`` between
    steps raises ``LeaseLost`` once the lease keeper lost it). ``NO_FENCE`` (epoch 0) is for
    changes made outside the tier controller (tests, a server's own start): servers take them
    whatever epoch they have seen."""

    def __init__(self, epoch: int = 0):
        self.epoch = epoch
        self._lost = ""

    def check(self) -> None:
        """``LeaseLost`` once the lease is lost."""
        if self._lost:
            raise LeaseLost(self._lost)

    def lose(self, why: str) -> None:
        self._lost = why or "the operation lease was lost"

    @property
    def lost(self) -> str:
        return self._lost


NO_FENCE = Fence()


def check_id(op_id: str) -> None:
    """``ControlError("bad_field")`` unless ``op_id`` is 1-64 letters, digits and ``_.:-``."""
    if not isinstance(op_id, str) or not _ID.fullmatch(op_id):
        raise ControlError("bad_field", f"an operation id is 1 to 64 letters, digits, '_', '.', "
                           f"':' or '-' (starting with a letter or digit), got {shown(op_id)}")


@dataclass(frozen=True)
class OperationRecord(Message):
    """One operation on the tier, as the monitor keeps it."""

    id: str
    kind: str  # one of KINDS
    requester: str  # who asked, where: "admin API of SGLang 127.0.0.1:30000 (pid 4242)"
    target: dict  # what it asked for, the kind's shape (enough to finish or roll it back)
    state: str = PENDING
    result: str = ""  # what it did, or why it failed or was rolled back
    epoch: int = 0  # the lease it ran under (0: not granted yet)
    started_at: float = 0.0  # wall-clock seconds
    finished_at: float = 0.0
    progress: str = ""  # its latest step, while it runs
    # the tier as the driver read it back from the monitor when it ended: "holdings" (a digest
    # of every serving server's holdings), and what the kind checks ("active", "layouts")
    end: dict = field(default_factory=dict)

    def validate(self) -> None:
        check_id(self.id)
        if self.kind not in KINDS:
            raise ControlError("bad_field", f"operation kind {shown(self.kind)} is not one of "
                               f"{', '.join(KINDS)}")
        if self.state not in STATES:
            raise ControlError("bad_field", f"operation state {shown(self.state)} is not one of "
                               f"{', '.join(STATES)}")
        if self.epoch < 0 or any(len(getattr(self, f)) > MAX_TEXT
                                 for f in ("requester", "result", "progress")):
            raise ControlError("bad_field", f"an operation's epoch is >= 0 and its texts at most "
                               f"{MAX_TEXT} characters")

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def ended(self, state: str, result: str, end: dict | None = None,
              at: float = 0.0) -> "OperationRecord":
        """This operation in a final ``state``."""
        assert state in FINAL
        return replace(self, state=state, result=result[:MAX_TEXT], progress="",
                       end=dict(end or {}), finished_at=at)

    def describe(self) -> str:
        """``resize to 4 (operation op-1, admin API of ..., running since 12:00:01)``."""
        what = describe_target(self.kind, self.target)
        since = (time.strftime("%H:%M:%S", time.localtime(self.started_at))
                 if self.started_at else "-")
        return (f"{what} (operation {self.id}, asked by {self.requester}, {self.state} since "
                f"{since})")

    def same_request(self, other: "OperationRecord") -> bool:
        """Whether ``other`` asks for what this asked for (an id repeated by a retry)."""
        return self.kind == other.kind and _request(self.target) == _request(other.target)


def _request(target: dict) -> dict:
    """A target without what the driver adds to it once it runs (keys starting with ``_``)."""
    return {k: v for k, v in target.items() if not k.startswith("_")}


def describe_target(kind: str, target: dict) -> str:
    """A target in a few words: ``resize to 4 active servers``, ``switch to TP``, ..."""
    if kind == RESIZE:
        return f"resize to {target.get('servers')} active expert servers"
    if kind == RETIRE:
        return f"retire {', '.join(target.get('retire', ()))}"
    if kind == SWITCH:
        return f"switch MoE layers {target.get('layers')} to {str(target.get('to')).upper()}"
    if kind == REBALANCE:
        return "rebalance pass"
    if kind in (ADAPTER_LOAD, ADAPTER_UNLOAD):
        return f"{kind.replace('-', ' ')} of ESFT adapter {target.get('adapter')}"
    return f"restart of expert server {target.get('server')}"


def tier_message(holdings: Holdings) -> dict[str, Any]:
    """A tier's holdings in a target (``{server: holdings_fields}``: experts, adapter experts
    and parts), as recovery reads them back (``read_tier``)."""
    return {s: holdings_fields(held) for s, held in holdings.items()}


def read_tier(message: Any) -> Holdings:
    """``tier_message``'s holdings; ``ControlError("bad_field")`` for another shape."""
    if not isinstance(message, dict) or not all(isinstance(v, dict) for v in message.values()):
        raise ControlError("bad_field", f"a tier's holdings are {{server: holdings}}, got "
                           f"{shown(message)}")
    return Holdings({s: read_holdings(held)[1] for s, held in message.items()})


def _record(value: Any, what: str) -> OperationRecord | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ControlError("bad_field", f"{what} must be an operation record, got {shown(value)}")
    return OperationRecord.from_message(value)


# -- requests and replies ---------------------------------------------------------------------
@dataclass(frozen=True)
class Acquired(Message):
    """``epoch`` > 0: the lease is the caller's (and ``lapsed``, where given, is an operation
    whose driver's lease lapsed before it ended: the caller finishes or rolls it back first).
    ``epoch`` 0: not granted; ``known`` is the operation of that id (a retried request: nothing
    starts), or ``busy`` says why (``holder``: the running operation)."""

    epoch: int = 0
    busy: str = ""
    holder: OperationRecord | None = None
    known: OperationRecord | None = None
    lapsed: OperationRecord | None = None

    def to_message(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "busy": self.busy,
                **{name: record.to_message() for name in ("holder", "known", "lapsed")
                   if (record := getattr(self, name)) is not None}}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "Acquired":
        values = check_fields(cls, message, {"epoch": "int", "busy": "str"})
        return cls(**values, **{name: _record(message.get(name), name)
                                for name in ("holder", "known", "lapsed")})


@dataclass(frozen=True)
class Acquire(Request):
    """Take the tier's operation lease for ``operation`` (recorded ``pending`` under the new
    epoch), kept alive by ``renew`` at least every ``ttl`` seconds. ``reclaim``: the epoch of a
    lease this caller held and lost (the monitor restarted, or the lease lapsed with nobody
    taking it since): granted again, under that epoch, only if no lease was granted since."""

    operation: OperationRecord
    ttl: float
    reclaim: int = 0

    op = "acquire"
    reply = Acquired

    def to_message(self) -> dict[str, Any]:
        return {"operation": self.operation.to_message(), "ttl": self.ttl,
                "reclaim": self.reclaim}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "Acquire":
        values = check_fields(cls, message, {"ttl": "float", "reclaim": "int"})
        record = _record(message.get("operation"), "operation")
        if record is None:
            raise ControlError("bad_field", "acquire needs field 'operation'")
        request = cls(record, **values)
        request.validate()
        return request

    def validate(self) -> None:
        if not 0.5 <= self.ttl <= 600 or self.reclaim < 0:
            raise ControlError("bad_field", f"an operation lease lasts 0.5-600 seconds and a "
                               f"reclaimed epoch is >= 0, got ttl {self.ttl}, reclaim "
                               f"{self.reclaim}")


@dataclass(frozen=True)
class Renew(Request):
    """Keep the lease of ``epoch`` alive; refused (``lease_lost``) once it is not held."""

    epoch: int

    op = "renew"


@dataclass(frozen=True)
class RecordOperation(Request):
    """Record ``operation`` (its progress, or its end) under the lease of ``epoch``: the
    holder's own operation, or a lapsed one the holder finished or rolled back. A final state
    of the holder's own operation gives the lease back."""

    epoch: int
    operation: OperationRecord

    op = "record_operation"

    def to_message(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "operation": self.operation.to_message()}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "RecordOperation":
        values = check_fields(cls, message, {"epoch": "int"})
        record = _record(message.get("operation"), "operation")
        if record is None:
            raise ControlError("bad_field", "record_operation needs field 'operation'")
        return cls(operation=record, **values)


@dataclass(frozen=True)
class OperationList(Message):
    """Operations, newest first, and the lease now (``holder``: the id of the operation that
    holds it, "" when none; ``epoch``: the newest granted)."""

    operations: tuple[OperationRecord, ...]
    holder: str = ""
    epoch: int = 0

    def to_message(self) -> dict[str, Any]:
        return {"operations": [r.to_message() for r in self.operations], "holder": self.holder,
                "epoch": self.epoch}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "OperationList":
        values = check_fields(cls, message, {"holder": "str", "epoch": "int"})
        records = message.get("operations")
        if not isinstance(records, list):
            raise ControlError("bad_field", "an operation list is {operations: [...]}")
        return cls(tuple(OperationRecord.from_message(r) for r in records), **values)

    def running(self) -> OperationRecord | None:
        """The operation holding the lease, if any."""
        return next((r for r in self.operations if r.id == self.holder), None)


@dataclass(frozen=True)
class ListOperations(Request):
    """One operation (``id``), or the latest ``limit`` ones (newest first)."""

    id: str = ""
    limit: int = 16

    op = "operations"
    reply = OperationList

    def validate(self) -> None:
        if self.id:
            check_id(self.id)
        if not 1 <= self.limit <= 256:
            raise ControlError("bad_field", f"limit is 1-256, got {self.limit}")


REQUESTS = (Acquire, Renew, RecordOperation, ListOperations)


def newest_first(records, limit: int) -> tuple[OperationRecord, ...]:
    return tuple(sorted(records, key=lambda r: (r.started_at, r.epoch), reverse=True)[:limit])

