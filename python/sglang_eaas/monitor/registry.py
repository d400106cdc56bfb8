"""``Registry``: the monitor's state, the members of the tier and the revision they are at.

Every change of membership (a registration, a status change, a suspicion, a departure) bumps
the revision and wakes the watchers; heartbeats only refresh a member's clock and load.

Failure detection has two stages (docs/fault-tolerance.md, "Suspected, then lost"). A member
that misses heartbeats for ``suspect_timeout`` seconds is *suspected* (``Member.suspected``):
clients route its experts to their other holders, nothing else changes, and its next heartbeat
clears it. It is *lost* when the data path confirms (its session closes: the process died; a
client reports that it did not answer within the result timeout, an *eviction*) or when it has
missed heartbeats for the much longer ``loss_timeout``. A lost or evicted member must register
again, as a new incarnation, to be used again.

A monitor that was itself not running (a stall of its own process on a loaded host) saw no
heartbeats in that time: ``expire`` does not count the time it was late against the members.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.monitor import (
    CONNECTION_CLOSED, LEFT, NO_HEARTBEAT, REPLACED, RESULT_TIMEOUT, SERVER, Departure, Member,
    Snapshot,
)

logger = logging.getLogger(__name__)
DEPARTURES_KEPT = 64
# the per-kind departure counters (``servers_lost``, ``clients_left``, ...) by reason
DEPARTED_AS = {LEFT: "left", REPLACED: "replaced", RESULT_TIMEOUT: "evicted",
               CONNECTION_CLOSED: "lost", NO_HEARTBEAT: "lost"}


@dataclass
class _Entry:
    member: Member
    session: object  # the connection that registered it
    last_beat: float
    period: float = 0.0  # its heartbeat period, as it registered
    suspected_at: float = 0.0  # when it was suspected (0: it is not)


class Registry:
    def __init__(self, loss_timeout: float, suspect_timeout: float | None = None):
        """``suspect_timeout``: defaults to ``loss_timeout`` (one stage)."""
        self.loss_timeout = loss_timeout
        self.suspect_timeout = min(loss_timeout, suspect_timeout or loss_timeout)
        self._cond = threading.Condition()
        self.revision = 0
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._incarnations: dict[str, tuple[str, str]] = {}
        self._departures: collections.deque[Departure] = collections.deque(maxlen=DEPARTURES_KEPT)
        self.counters: collections.Counter[str] = collections.Counter()
        # called under the lock with (kind, member id, seconds) for every gap between two
        # heartbeats: how a benchmark sees the cadence of one window, not only the longest gap
        self.gap_listeners: list[Callable[[str, str, float], None]] = []

    def _bump(self) -> None:
        self.revision += 1
        self._cond.notify_all()

    def register(self, member: Member, session: object, period: float = 0.0) -> Member:
        """Add ``member`` as a new incarnation (replacing an older one of the same id) that
        heartbeats every ``period`` seconds."""
        member = replace(member, incarnation=secrets.token_hex(8), beat_age=0.0, suspected=False)
        with self._cond:
            old = self._entries.get(member.key())
            if old is not None:
                self._depart(old, "replaced by a new incarnation", REPLACED)
            self._entries[member.key()] = _Entry(member, session, time.monotonic(), period)
            self._incarnations[member.incarnation] = member.key()
            self.counters[f"{member.kind}s_registered"] += 1
            self._bump()
        held = (f", experts per MoE layer {member.holdings}" if member.kind == SERVER
                else "")
        logger.info("%s %s registered (incarnation %s, %s pid %d%s)", member.kind, member.id,
                    member.incarnation, member.host, member.pid, held)
        return member

    def _entry(self, incarnation: str, session: object | None = None) -> _Entry:
        key = self._incarnations.get(incarnation)
        entry = self._entries.get(key) if key else None
        if entry is None or entry.member.incarnation != incarnation:
            raise ControlError("unknown_incarnation", f"incarnation {incarnation[:32]!r} is not "
                               "registered (lost, evicted or left): register again")
        if session is not None and entry.session is not session:
            raise ControlError("out_of_order", "a member is kept alive only by the connection "
                               "that registered it")
        return entry

    def member_of(self, incarnation: str, session: object) -> Member:
        with self._cond:
            return self._entry(incarnation, session).member

    def heartbeat(self, incarnation: str, load: dict, session: object) -> int:
        with self._cond:
            entry = self._entry(incarnation, session)
            now = time.monotonic()
            self._count_gap(entry, now - entry.last_beat)
            if entry.suspected_at:
                self._clear(entry, now)
            entry.last_beat = now
            entry.member = replace(entry.member, load=load)
            return self.revision

    def _count_gap(self, entry: _Entry, gap: float) -> None:
        """Under the lock: the cadence heartbeats keep, by kind of member: the longest gap
        seen (ms), and how many gaps were over twice the member's period (``late``)."""
        kind = entry.member.kind
        longest = f"{kind}s_max_heartbeat_gap_ms"
        self.counters[longest] = max(self.counters[longest], round(gap * 1000))
        self.counters[f"{kind}s_heartbeats"] += 1
        if entry.period and gap > 2 * entry.period:
            self.counters[f"{kind}s_heartbeats_late"] += 1
        for listener in self.gap_listeners:
            listener(kind, entry.member.id, gap)

    def _clear(self, entry: _Entry, now: float) -> None:
        """Under the lock: a suspected member heartbeated again: no longer suspected, with no
        other change."""
        member = entry.member
        entry.suspected_at = 0.0
        entry.member = replace(member, suspected=False)
        self.counters["suspicions_cleared"] += 1
        self._bump()
        logger.info("%s %s heartbeats again after %.2fs: no longer suspected", member.kind,
                    member.id, now - entry.last_beat)

    def set_status(self, incarnation: str, status: str, session: object) -> int:
        with self._cond:
            entry = self._entry(incarnation, session)
            if entry.member.status != status:
                entry.member = entry.member.with_status(status)
                self._bump()
                logger.info("%s %s is %s", entry.member.kind, entry.member.id, status)
            return self.revision

    def set_holdings(self, incarnation: str, holdings: ServerHoldings, session: object) -> int:
        with self._cond:
            entry = self._entry(incarnation, session)
            if entry.member.holdings != holdings:
                entry.member = entry.member.with_holdings(holdings)
                self._bump()
                logger.info("%s %s now holds experts per MoE layer %s", entry.member.kind,
                            entry.member.id, holdings)
            return self.revision

    def leave(self, incarnation: str, session: object) -> None:
        with self._cond:
            self._depart(self._entry(incarnation, session), "left", LEFT)

    def session_closed(self, session: object) -> None:
        with self._cond:
            for entry in [e for e in self._entries.values() if e.session is session]:
                self._depart(entry, "lost: its monitor connection closed", CONNECTION_CLOSED)

    def report(self, server: str, incarnation: str, why: str) -> bool:
        """Evict ``server`` if it is still that incarnation; whether it was."""
        with self._cond:
            entry = self._entries.get((SERVER, server))
            if entry is None or entry.member.incarnation != incarnation:
                return False
            self.counters["evictions"] += 1
            self._depart(entry, f"evicted: {why}", RESULT_TIMEOUT)
            return True

    def expire(self, absent: float = 0.0) -> None:
        """Suspect every member whose last heartbeat is older than ``suspect_timeout``, lose
        every one older than ``loss_timeout``. ``absent``: seconds the caller itself was not
        running since its last call (more than it meant to sleep): heartbeats of that time may
        still be unread, so it is not counted against anyone."""
        now = time.monotonic()
        with self._cond:
            if absent > 0:
                for entry in self._entries.values():
                    entry.last_beat = min(now, entry.last_beat + absent)
                self.counters["monitor_stalls"] += 1
                logger.warning("the monitor was not running for %.2fs (a loaded host?): that "
                               "time is not counted against the members' heartbeats", absent)
            for entry in list(self._entries.values()):
                age = now - entry.last_beat
                if age > self.loss_timeout:
                    self._depart(entry, f"lost: no heartbeat for {age:.2f}s", NO_HEARTBEAT)
                elif age > self.suspect_timeout and not entry.suspected_at:
                    self._suspect(entry, now, age)

    def _suspect(self, entry: _Entry, now: float, age: float) -> None:
        member = entry.member
        entry.suspected_at = now
        entry.member = replace(member, suspected=True)
        self.counters["suspicions"] += 1
        self.counters[f"{member.kind}s_suspected"] += 1
        self._bump()
        logger.warning("%s %s (incarnation %s) suspected: no heartbeat for %.2fs (lost after "
                       "%.1fs without one, or at once if the data path confirms)", member.kind,
                       member.id, member.incarnation, age, self.loss_timeout)

    def _depart(self, entry: _Entry, why: str, reason: str) -> None:
        """Under the lock: drop ``entry``, record why (in words and as a ``reason``), wake the
        watchers."""
        member = entry.member
        del self._entries[member.key()]
        self._incarnations.pop(member.incarnation, None)
        self._departures.append(Departure(member.kind, member.id, member.incarnation, why,
                                          self.revision + 1, reason))
        self.counters[f"{member.kind}s_{DEPARTED_AS[reason]}"] += 1
        if reason not in (LEFT, REPLACED):
            self.counters[f"losses_{reason}"] += 1
        self._bump()
        log = logger.info if reason == LEFT else logger.warning
        log("%s %s (incarnation %s) %s", member.kind, member.id, member.incarnation, why)

    def snapshot(self) -> Snapshot:
        now = time.monotonic()
        with self._cond:
            members = tuple(replace(e.member, beat_age=round(max(0.0, now - e.last_beat), 3))
                            for e in self._entries.values())
            return Snapshot(self.revision, members, tuple(self._departures))

    def wait(self, after: int, timeout: float) -> Snapshot:
        """The snapshot as soon as the revision passes ``after``, or after ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self.revision > after, timeout)
        return self.snapshot()
