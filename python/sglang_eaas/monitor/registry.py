"""``Registry``: the monitor's state, the members of the tier and the revision they are at.

Every change of membership (a registration, a status change, a departure) bumps the revision and
wakes the watchers; heartbeats only refresh a member's clock and load. A member is *lost* when
its session closes or it misses heartbeats for ``loss_timeout`` seconds (``expire``), *evicted*
when a client reports that it timed out; either way it must register again, as a new
incarnation, to be used again.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace

from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.monitor import SERVER, Departure, Member, Snapshot

logger = logging.getLogger(__name__)
DEPARTURES_KEPT = 64


@dataclass
class _Entry:
    member: Member
    session: object  # the connection that registered it
    last_beat: float


class Registry:
    def __init__(self, loss_timeout: float):
        self.loss_timeout = loss_timeout
        self._cond = threading.Condition()
        self.revision = 0
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._incarnations: dict[str, tuple[str, str]] = {}
        self._departures: collections.deque[Departure] = collections.deque(maxlen=DEPARTURES_KEPT)
        self.counters: collections.Counter[str] = collections.Counter()

    def _bump(self) -> None:
        self.revision += 1
        self._cond.notify_all()

    def register(self, member: Member, session: object) -> Member:
        """Add ``member`` as a new incarnation (replacing an older one of the same id)."""
        member = replace(member, incarnation=secrets.token_hex(8), beat_age=0.0)
        with self._cond:
            old = self._entries.get(member.key())
            if old is not None:
                self._depart(old, "replaced by a new incarnation")
            self._entries[member.key()] = _Entry(member, session, time.monotonic())
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
            entry.last_beat = time.monotonic()
            entry.member = replace(entry.member, load=load)
            return self.revision

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
            self._depart(self._entry(incarnation, session), "left")

    def session_closed(self, session: object) -> None:
        with self._cond:
            for entry in [e for e in self._entries.values() if e.session is session]:
                self._depart(entry, "lost: its monitor connection closed")

    def report(self, server: str, incarnation: str, why: str) -> bool:
        """Evict ``server`` if it is still that incarnation; whether it was."""
        with self._cond:
            entry = self._entries.get((SERVER, server))
            if entry is None or entry.member.incarnation != incarnation:
                return False
            self.counters["evictions"] += 1
            self._depart(entry, f"evicted: {why}")
            return True

    def expire(self) -> None:
        """Lose every member whose last heartbeat is older than ``loss_timeout``."""
        now = time.monotonic()
        with self._cond:
            for entry in [e for e in self._entries.values()
                          if now - e.last_beat > self.loss_timeout]:
                self._depart(entry, f"lost: no heartbeat for {now - entry.last_beat:.2f}s")

    def _depart(self, entry: _Entry, why: str) -> None:
        """Under the lock: drop ``entry``, record why, wake the watchers."""
        member = entry.member
        del self._entries[member.key()]
        self._incarnations.pop(member.incarnation, None)
        self._departures.append(Departure(member.kind, member.id, member.incarnation, why,
                                          self.revision + 1))
        self.counters[f"{member.kind}s_{why.split(':')[0].split(' ')[0]}"] += 1
        self._bump()
        log = logger.info if why == "left" else logger.warning
        log("%s %s (incarnation %s) %s", member.kind, member.id, member.incarnation, why)

    def snapshot(self) -> Snapshot:
        now = time.monotonic()
        with self._cond:
            members = tuple(replace(e.member, beat_age=round(now - e.last_beat, 3))
                            for e in self._entries.values())
            return Snapshot(self.revision, members, tuple(self._departures))

    def wait(self, after: int, timeout: float) -> Snapshot:
        """The snapshot as soon as the revision passes ``after``, or after ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self.revision > after, timeout)
        return self.snapshot()
