"""``Presence``: keeps one member registered with the monitor while its process lives.

A thread heartbeats every ``period`` seconds. When the monitor has lost or evicted the member
(``MemberLost``), the member registers again as a new incarnation, and ``on_lost`` tells its
owner (a client must join its servers afresh). A beat is skipped while ``healthy()`` is false
(an expert server whose serving loop stalled), so the monitor loses a member that cannot serve
even though its process answers. If the monitor itself is unreachable, the presence keeps
trying to reconnect and register, once per period.

A status or holdings change is kept for every later registration; if the monitor lost the
member before the next heartbeat could tell (``MemberLost`` from the change itself), the change
is no error for its caller (an expert server has already changed what it serves): the next
heartbeat reports the loss and the one after registers again, with the change, as when a
heartbeat finds the loss.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Callable

from ibgda import TransportError
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.membership.base import MemberLost, MemberSession, MonitorBackend
from sglang_eaas.protocol.monitor import Member

logger = logging.getLogger(__name__)


class Presence:
    def __init__(self, backend: MonitorBackend, member: Member, period: float,
                 load: Callable[[], dict] = dict, healthy: Callable[[], bool] = lambda: True,
                 on_lost: Callable[[str], None] = lambda why: None):
        self.backend, self.period = backend, period
        self._template, self._load, self._healthy, self._on_lost = member, load, healthy, on_lost
        self._lock = threading.RLock()  # _beat registers while holding it
        self._session: MemberSession | None = None
        self.member: Member | None = None  # as registered (with its incarnation), or None
        self._status = member.status
        self._found_lost: str | None = None  # a loss a change found between heartbeats
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eaas-presence", daemon=True)

    def start(self) -> "Presence":
        """Register now (raising if the monitor refuses or is unreachable), then heartbeat."""
        self._register()
        self._thread.start()
        return self

    @property
    def incarnation(self) -> str:
        member = self.member
        return member.incarnation if member is not None else ""

    def _register(self) -> None:
        """Register (under the lock: one registration at a time, never two incarnations)."""
        with self._lock:
            if self._session is None:
                self._session = self.backend.session()
            template = self._template.with_status(self._status)
            self.member = self._session.register(template, self.period)

    def _drop_session(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None
            self.member = None

    def _beat(self) -> str | None:
        """One heartbeat, or a registration when the member has none; why the monitor lost
        the member, if it did. Under the lock, so ``register_again`` cannot come in between."""
        with self._lock:
            if self._found_lost is not None:
                lost, self._found_lost = self._found_lost, None
                return lost
            if self.member is None:
                self._register()
                logger.info("registered with the monitor %s again, as incarnation %s",
                            self.backend.address, self.incarnation)
                return None
            try:
                self._session.heartbeat(self._load())
            except MemberLost as exc:
                self.member = None
                return str(exc)
        return None

    def _run(self) -> None:
        unreachable = False
        while not self._stop.wait(self.period):
            if not self._healthy():
                continue
            try:
                lost = self._beat()
                unreachable = False
            except TransportError as exc:
                if not unreachable:
                    logger.warning("monitor %s unreachable (%s); retrying every %.2fs",
                                   self.backend.address, exc, self.period)
                unreachable = True
                was_registered = self.member is not None
                self._drop_session()
                if was_registered:
                    self._on_lost(f"monitor connection broke: {exc}")
                continue
            if lost is not None:
                logger.warning("the monitor no longer has %s %s (%s); registering again",
                               self._template.kind, self._template.id, lost)
                self._on_lost(lost)

    def register_again(self) -> None:
        """Register now as a new incarnation (the owner learned it was lost before the next
        heartbeat did)."""
        with self._lock:
            self.member, self._found_lost = None, None
            self._register()

    def set_status(self, status: str) -> None:
        """``serving`` or ``draining``, now and in every later registration."""
        self._status = status
        with self._lock:
            if self._session is not None and self.member is not None:
                try:
                    self._session.set_status(status)
                except MemberLost as exc:
                    self._lost_between_beats(exc)

    def set_holdings(self, holdings: ServerHoldings) -> None:
        """A server's experts per MoE layer (and which are adapter experts), now and in every
        later registration."""
        self._template = self._template.with_holdings(holdings)
        with self._lock:
            if self._session is not None and self.member is not None:
                try:
                    self._session.set_holdings(holdings)
                except MemberLost as exc:
                    self._lost_between_beats(exc)
                    return
                self.member = self.member.with_holdings(holdings)

    def set_epoch(self, epoch: int) -> None:
        """A server obeyed operation lease ``epoch``: said at its next registration (so a
        monitor that restarted learns it: ``monitor/operations.py``)."""
        self._template = replace(self._template, epoch=epoch)

    def _lost_between_beats(self, exc: MemberLost) -> None:
        """Under the lock: the monitor no longer has this registration (lost or evicted since
        the last heartbeat). Left to the heartbeat thread, which tells the owner and registers
        again, with the template (which has the change), unless ``healthy()`` is false."""
        logger.info("the monitor no longer has %s %s (%s): found by a change; the heartbeat "
                    "thread registers again", self._template.kind, self._template.id, exc)
        self.member, self._found_lost = None, str(exc)

    def close(self) -> None:
        """Leave in order (the monitor tells the others at once) and stop heartbeating."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.period + 1)
        with self._lock:
            if self._session is not None and self.member is not None:
                try:
                    self._session.leave()
                except TransportError:
                    pass
        self._drop_session()
