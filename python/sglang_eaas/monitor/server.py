"""``MonitorServer``: the embedded or standalone monitor every client and server heartbeats.

An ``endpoint.LineEndpoint`` (authentication first, bounded lines, refusals counted by reason)
whose sessions act on one ``Registry``, and a reaper thread that suspects, then loses, members
whose heartbeats stopped (``registry.py``). A server's registration is checked against the
server itself: the monitor asks the control address it registers under for its model
fingerprint, experts and pid, and refuses (``forged_registration``) a registration they do not
match, so nothing can announce experts that no server at that address holds.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from ibgda import TransportError
from sglang_eaas.endpoint import LineEndpoint
from sglang_eaas.membership import LOSS_TIMEOUT, suspect_timeout
from sglang_eaas.monitor.operations import OperationLog
from sglang_eaas.monitor.registry import Registry
from sglang_eaas.protocol import control
from sglang_eaas.protocol.lines import MAX_LINE, ControlError
from sglang_eaas.protocol.lines import Done, Message
from sglang_eaas.protocol.monitor import (
    CLIENT, OPS, SERVER, Evicted, Heartbeat, Leave, Member, MonitorStats, Register, Registered,
    Report, Revision, SetHoldings, SetStatus, Snapshot, Watch, Watched,
)
from sglang_eaas.protocol.operations import (
    LEASE_TTL, Acquire, ListOperations, OperationList, RecordOperation, Renew,
)

logger = logging.getLogger(__name__)
MAX_WATCH = 60.0  # seconds one watch call may block


@dataclass(frozen=True)
class MonitorConfig:
    host: str = "127.0.0.1"
    port: int = 0
    token: str = ""
    # seconds without a heartbeat before a member is lost, and before it is suspected (None:
    # SUSPECT_TIMEOUT, or the loss timeout if that is shorter)
    loss_timeout: float = LOSS_TIMEOUT
    suspect_timeout: float | None = None
    verify_servers: bool = True  # check a server's registration against the server
    # seconds a restarted monitor refuses new operation leases while the servers say one was
    # granted before it started (its holder reclaims it meanwhile: monitor/operations.py)
    operation_grace: float = LEASE_TTL


class MonitorServer:
    def __init__(self, config: MonitorConfig):
        self.config = config
        self.registry = Registry(config.loss_timeout,
                                 suspect_timeout(config.loss_timeout, config.suspect_timeout))
        self.operations = OperationLog(config.operation_grace)
        self.endpoint = LineEndpoint((config.host, config.port), config.token,
                                     lambda conn: _Session(self, conn), "eaas-monitor")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="eaas-monitor-reaper",
                                        daemon=True)

    @property
    def address(self) -> str:
        return self.endpoint.address

    def start(self) -> "MonitorServer":
        self.endpoint.thread.start()
        self._reaper.start()
        return self

    def _reap(self) -> None:
        """Every twelfth of the suspect timeout: suspect and lose members (``Registry.expire``),
        telling it for how long this thread was not running past its sleep (this process
        stalled: the heartbeats of that time may be unread yet), if that was more than half a
        suspect timeout."""
        period = self.registry.suspect_timeout / 12
        woke = time.monotonic()
        while not self._stop.wait(period):
            now = time.monotonic()
            late = now - woke - period
            woke = now
            self.registry.expire(late if late > self.registry.suspect_timeout / 2 else 0.0)
            self.operations.expire()

    def verify(self, member: Member) -> None:
        """``ControlError("forged_registration")`` unless the server at ``member.id`` is the
        process that registers, holding what it says."""
        try:
            stats = control.probe(member.id, self.config.token, timeout=5.0)
        except TransportError as exc:
            raise ControlError("forged_registration", f"server {member.id} registers, but its "
                               f"control endpoint does not answer: {exc}") from None

        def said(m) -> dict[str, Any]:
            return {"fingerprint": m.fingerprint, "pid": m.pid, "num_experts": m.num_experts,
                    "holdings": m.holdings}

        claims, found = said(member), said(stats)
        if found != claims:
            raise ControlError("forged_registration", f"server {member.id} registers "
                               f"{claims}, but the server at that address has {found}")

    def stats(self) -> MonitorStats:
        snapshot = self.registry.snapshot()
        endpoint = self.endpoint.counters()
        return MonitorStats(snapshot.revision, len(snapshot.servers()), len(snapshot.clients()),
                            endpoint["control_refused"], endpoint["refused_connections"],
                            dict(self.registry.counters))

    def close(self) -> None:
        self._stop.set()
        self.endpoint.close()


class _Session:
    """One connection: the members it registered live as long as it does."""

    ops = OPS

    def __init__(self, monitor: MonitorServer, connection: socket.socket):
        self.monitor, self.registry = monitor, monitor.registry
        self.closing = False

    def handle(self, op: str, message: dict[str, Any]) -> Message:
        registry = self.registry
        if op == "register":
            register = Register.from_message(message)
            member, suspect = register.member, registry.suspect_timeout
            if not 0 < register.heartbeat <= suspect / 2:
                raise ControlError("bad_field", f"a heartbeat period of {register.heartbeat}s "
                                   f"is too slow for this monitor's suspect timeout of "
                                   f"{suspect}s (at most half of it)")
            if member.kind == SERVER and self.monitor.config.verify_servers:
                self.monitor.verify(member)
            member = registry.register(member, self, register.heartbeat)
            self.monitor.operations.learn_epoch(member.epoch)
            return Registered(member.incarnation, registry.revision, registry.loss_timeout,
                              suspect)
        if op == "heartbeat":
            beat = Heartbeat.from_message(message)
            return Revision(registry.heartbeat(beat.incarnation, beat.load, self))
        if op == "set_status":
            change = SetStatus.from_message(message)
            return Revision(registry.set_status(change.incarnation, change.status, self))
        if op == "set_holdings":
            change = SetHoldings.from_message(message)
            member = registry.member_of(change.incarnation, self)
            if member.kind == SERVER and self.monitor.config.verify_servers:
                self.monitor.verify(member.with_holdings(change.holdings))
            return Revision(registry.set_holdings(change.incarnation, change.holdings, self))
        if op == "leave":
            registry.leave(Leave.from_message(message).incarnation, self)
            return Done()
        if op == "watch":
            watch = Watch.from_message(message)
            snapshot = registry.wait(watch.after, min(max(watch.timeout, 0.0), MAX_WATCH))
            return Watched(self._within_line(snapshot))
        if op == "report":
            report = Report.from_message(message)
            return Evicted(registry.report(report.server, report.incarnation, report.why))
        if op in ("acquire", "renew", "record_operation", "operations"):
            return self._operations(op, message)
        return self.monitor.stats()

    def _operations(self, op: str, message: dict[str, Any]) -> Message:
        log = self.monitor.operations
        if op == "acquire":
            request = Acquire.from_message(message)
            return log.acquire(request.operation, request.ttl, request.reclaim, self)
        if op == "renew":
            log.renew(Renew.from_message(message).epoch, self)
            return Done()
        if op == "record_operation":
            request = RecordOperation.from_message(message)
            log.record(request.epoch, request.operation, self)
            return Done()
        request = ListOperations.from_message(message)
        return _fitting(log.list(request.id, request.limit))

    def _within_line(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot``, without the clients' loads (their load windows: tens of KB each for
        a large model) if all of it would not fit in one reply line: watchers follow the
        membership, which must always reach them."""
        if len(json.dumps(snapshot.to_message())) < MAX_LINE - 1024:
            return snapshot
        self.registry.counters["client_loads_omitted"] += 1
        if self.registry.counters["client_loads_omitted"] == 1:
            logger.warning("a snapshot of %d members is over %d bytes with the clients' load "
                           "windows: watchers get it without them", len(snapshot.members),
                           MAX_LINE)
        return replace(snapshot, members=tuple(
            replace(m, load={}) if m.kind == CLIENT else m for m in snapshot.members))

    def close(self) -> None:
        self.registry.session_closed(self)
        self.monitor.operations.session_closed(self)


def _fitting(listed: OperationList) -> OperationList:
    """``listed``, with the latest operations' targets left out (``{}``) where all of it would
    not fit in one reply line (a rebalance's target names every server's experts)."""
    records = list(listed.operations)
    while len(json.dumps(replace(listed, operations=tuple(records)).to_message())) \
            > MAX_LINE - 1024:
        big = max(range(len(records)), key=lambda i: len(json.dumps(records[i].target)))
        if not records[big].target:
            records.pop()
            continue
        records[big] = replace(records[big], target={})
    return replace(listed, operations=tuple(records))
