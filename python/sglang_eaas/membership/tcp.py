"""The monitor backend of an embedded or standalone ``MonitorServer`` (``HOST:PORT``)."""

from __future__ import annotations

import threading

from dataclasses import replace

from ibgda import TransportError
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.membership.base import MemberLost, MemberSession, MonitorBackend
from sglang_eaas.protocol.lines import Channel, Refused, Request
from sglang_eaas.protocol.monitor import (
    Heartbeat, Leave, Member, MonitorStats, Register, Report, SetHoldings, SetStatus, Snapshot,
    TierStats, Watch,
)
from sglang_eaas.protocol.operations import (
    Acquire, Acquired, ListOperations, OperationList, OperationRecord, RecordOperation, Renew,
)

PEER = "monitor"
CALL_TIMEOUT = 10.0  # seconds for a reply that does not wait on purpose
FIRST_CONTACT = 5.0  # seconds the first call waits for the monitor's first reply


class TcpMonitor(MonitorBackend):
    def __init__(self, address: str, token: str):
        self.address, self.token = address, token
        self._lock = threading.Lock()  # one caller at a time on the shared channel
        self._channel: Channel | None = None
        self._answered = False  # the monitor has answered this object once

    def _call(self, request: Request, patience: float = CALL_TIMEOUT, retry: bool = True):
        """One call on the shared channel, reconnecting once if a connection that worked
        broke (unless not to ``retry``). Until the monitor first answered, the call waits
        ``FIRST_CONTACT`` seconds (past the wait it asks for) and is not repeated: a port that
        is not a monitor's (an HTTP server, say) reads the authentication line and never
        answers."""
        with self._lock:
            for attempt in range(2):
                if self._channel is None:
                    self._channel = Channel(self.address, self.token, CALL_TIMEOUT, PEER)
                first = not self._answered
                self._channel.settimeout(patience - CALL_TIMEOUT + FIRST_CONTACT if first
                                         else patience)
                try:
                    reply = self._channel.call(request)
                    self._answered = True
                    return reply
                except Refused:
                    raise
                except TransportError as exc:
                    self._channel.close()
                    self._channel = None
                    if first and isinstance(exc.__cause__, TimeoutError):
                        raise TransportError(
                            f"{PEER} {self.address} did not answer within {FIRST_CONTACT:.0f}s: "
                            "is it the tier's monitor (--eaas-monitor embedded:HOST:PORT or "
                            "python -m sglang_eaas.monitor), not another port such as "
                            "SGLang's HTTP one?") from None
                    if attempt or first or not retry:
                        raise
        raise AssertionError("unreachable")

    def session(self) -> "TcpSession":
        return TcpSession(self)

    def watch(self, after: int, timeout: float) -> Snapshot:
        return self._call(Watch(after, timeout), patience=timeout + CALL_TIMEOUT).snapshot

    def report(self, server: str, incarnation: str, why: str) -> bool:
        return self._call(Report(server, incarnation, why)).evicted

    def stats(self) -> MonitorStats:
        return self._call(TierStats())

    # A lease is bound to the connection that took it (the monitor lets it lapse when that
    # connection closes): these calls never reconnect, a broken line is the lease's loss.
    def acquire(self, operation: OperationRecord, ttl: float, reclaim: int = 0) -> Acquired:
        return self._call(Acquire(operation, ttl, reclaim), retry=False)

    def renew(self, epoch: int) -> None:
        self._call(Renew(epoch), retry=False)

    def record(self, epoch: int, operation: OperationRecord) -> None:
        self._call(RecordOperation(epoch, operation), retry=False)

    def operations(self, op_id: str = "", limit: int = 16) -> OperationList:
        return self._call(ListOperations(op_id, limit))

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


class TcpSession(MemberSession):
    """The member's own connection: if it closes, the monitor loses the member at once."""

    def __init__(self, monitor: TcpMonitor):
        self._channel = Channel(monitor.address, monitor.token, CALL_TIMEOUT, PEER)
        self._incarnation = ""

    def _call(self, request: Request):
        try:
            return self._channel.call(request)
        except Refused as exc:
            if exc.reason == "unknown_incarnation":
                raise MemberLost(str(exc)) from None
            raise

    def register(self, member: Member, heartbeat: float) -> Member:
        self._incarnation = self._call(Register(member, heartbeat)).incarnation
        return replace(member, incarnation=self._incarnation)

    def heartbeat(self, load: dict) -> None:
        self._call(Heartbeat(self._incarnation, load))

    def set_status(self, status: str) -> None:
        self._call(SetStatus(self._incarnation, status))

    def set_holdings(self, holdings: ServerHoldings) -> None:
        self._call(SetHoldings(self._incarnation, holdings))

    def leave(self) -> None:
        self._call(Leave(self._incarnation))

    def close(self) -> None:
        self._channel.close()
