"""What every monitor backend offers its members and watchers (``tcp.py``, ``etcd.py``).

A *session* keeps one member registered (register, heartbeat, set_status,
set_holdings, leave); ``watch``
long-polls the tier's membership; ``report`` tells the monitor a server timed out, which evicts
it (it must register again to be used again); ``acquire`` ... ``operations`` are the tier
controller's lease and records (``protocol/operations.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from ibgda import TransportError
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.protocol.monitor import Member, MonitorStats, Snapshot
from sglang_eaas.protocol.operations import Acquired, OperationList, OperationRecord


class MemberLost(TransportError):
    """The monitor no longer has this registration (lost, evicted, or left): register again."""


class MemberSession(ABC):
    @abstractmethod
    def register(self, member: Member, heartbeat: float) -> Member:
        """Register ``member``; it comes back with the incarnation the monitor gave it."""

    @abstractmethod
    def heartbeat(self, load: dict) -> None:
        """Keep the registration alive; ``MemberLost`` if it is gone."""

    @abstractmethod
    def set_status(self, status: str) -> None: ...

    @abstractmethod
    def set_holdings(self, holdings: ServerHoldings) -> None:
        """A server now holds ``holdings``."""

    @abstractmethod
    def leave(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class MonitorBackend(ABC):
    address: str  # as given: HOST:PORT or etcd://HOST:PORT

    @abstractmethod
    def session(self) -> MemberSession: ...

    @abstractmethod
    def watch(self, after: int, timeout: float) -> Snapshot:
        """The membership as soon as its revision passes ``after`` (at once for -1), or after
        ``timeout`` seconds."""

    @abstractmethod
    def report(self, server: str, incarnation: str, why: str) -> bool:
        """Evict ``server`` (that incarnation) after a timeout; whether it was still there."""

    @abstractmethod
    def stats(self) -> MonitorStats:
        """The monitor's counters (over etcd: what this reader refused)."""

    # -- the tier controller's lease and records (protocol/operations.py) -----------------
    @abstractmethod
    def acquire(self, operation: OperationRecord, ttl: float, reclaim: int = 0) -> Acquired:
        """Take the tier's operation lease for ``operation`` (see ``Acquire``); a lease is
        this backend object's: keep it alive with ``renew`` on the same object."""

    @abstractmethod
    def renew(self, epoch: int) -> None:
        """Keep the lease of ``epoch`` alive; ``Refused("lease_lost")`` once it is not held."""

    @abstractmethod
    def record(self, epoch: int, operation: OperationRecord) -> None:
        """Record ``operation`` under the lease of ``epoch`` (a final state of the lease's own
        operation gives it back); ``Refused("lease_lost")`` once it is not held."""

    @abstractmethod
    def operations(self, op_id: str = "", limit: int = 16) -> OperationList:
        """One operation, or the latest ones, newest first."""

    def close(self) -> None:
        pass
