"""Resizing the expert tier while it serves: scale out N -> M, scale in M -> N.

The tier's *active* servers hold experts; *standby* servers are registered and warm but hold
none (``--standby``). A resize to M active servers:

* **out**: takes standby servers, else starts new ones through a ``ServerLauncher`` (local
  processes by default; an orchestrator's implementation the same way), places the tier over
  the new set with the fewest moves (``plan.resize_holdings``), and applies it: every add first,
  read from a current holder over the weight fabric, then every drop; clients switch tables
  between steps as each server says what it holds (docs/protocol.md, "Replicas").
* **in**: picks the servers that go (those holding least), places over the others, applies,
  then drains the leaving servers (clients stop sending, in-flight work finishes, they exit).

* **retire** named servers: as *in*, with the leaving servers named (an orchestrator removing
  a pod); with a target count, standby servers take their place.

Servers are started in batches of at most ``LAUNCH_BATCH`` (each batch registers before the
next starts); a batch that fails to start or register is started again, up to ``ATTEMPTS``
times. A server lost during a resize (killed mid-fill, as receiver or as source) is left out
and the placement is made again from the monitor's view over the live servers, with another
standby or new server in its place; where none can be had, the resize rolls back to the
servers active before it. Either way every expert keeps a live holder (adds come before
drops), so no request fails: a request to a lost server fails over as after any loss
(docs/fault-tolerance.md). A resize ends by reading the tier back from the monitor: it
returns only if the active servers are those it placed over (``ResizeError`` otherwise).

Resizes run as operations of the tier controller (``controller/``): every change carries the
operation lease's ``Fence``; the bounds are ``controller/bounds.py``'s.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from ibgda import TransportError
from sglang_eaas.balance.apply import Applied, apply_placement
from sglang_eaas.elastic.plan import moved, resize_holdings
from sglang_eaas.holdings import Holdings, ServerHoldings
from sglang_eaas.membership import current_snapshot
from sglang_eaas.protocol.control import Drain, call, probe
from sglang_eaas.protocol.monitor import Snapshot
from sglang_eaas.protocol.operations import NO_FENCE, Fence

logger = logging.getLogger(__name__)
ATTEMPTS = 3  # placements tried when servers are lost mid-resize; starts of one batch
REGISTER_TIMEOUT = 120.0  # seconds a started server has to register
LAUNCH_BATCH = 4  # servers started at once (each batch registers before the next starts)


class ResizeError(RuntimeError):
    """A resize that could not be made (and what was done is said)."""


class ServerLauncher(Protocol):
    """Starts and stops expert servers for resizes (docs/elastic.md, "Launchers")."""

    def start(self, count: int) -> list[str]:
        """Start ``count`` standby servers registering with the tier's monitor; their control
        addresses (the resize waits for them to register). Raises ``TransportError`` if one
        cannot start (the resize starts the batch again)."""

    def stop(self, address: str) -> None:
        """The server at ``address`` has drained and is exiting, or never registered: reap it
        (a server this launcher did not start: nothing to do)."""


@dataclass
class Resized:
    """What a resize did."""

    before: int  # active servers before
    after: int  # and after
    taken: list[str] = field(default_factory=list)  # standby servers filled
    started: list[str] = field(default_factory=list)  # servers the launcher started
    retired: list[str] = field(default_factory=list)  # servers drained
    lost: list[str] = field(default_factory=list)  # servers lost during it, left out
    moved: int = 0  # replicas filled (per layer), placements cut short by a loss included
    from_peer: int = 0
    from_disk: int = 0
    rolled_back: bool = False
    seconds: float = 0.0

    def summary(self) -> str:
        parts = [f"{self.before} -> {self.after} active expert servers in {self.seconds:.1f}s",
                 f"{self.moved} replicas filled ({self.from_peer} from peers, "
                 f"{self.from_disk} from disk)"]
        for what, servers in (("standby taken", self.taken), ("started", self.started),
                              ("retired", self.retired), ("lost", self.lost)):
            if servers:
                parts.append(f"{what}: {', '.join(servers)}")
        if self.rolled_back:
            parts.append("rolled back")
        return "; ".join(parts)


class Resizer:
    """Resizes the tier registered with ``monitor`` (one resize at a time in this process; one
    operation at a time in the tier is the controller's)."""

    def __init__(self, monitor: str, token: str, num_experts: int,
                 launcher: ServerLauncher | None = None, fingerprint: str | None = None,
                 grace: float = 1.0, say: Callable[[str], None] = logger.info):
        self.monitor, self.token, self.num_experts = monitor, token, num_experts
        self.launcher, self.fingerprint, self.grace, self.say = launcher, fingerprint, grace, say
        self.lock = threading.Lock()
        self._replicas_of: Holdings | None = None  # the tier's holdings when a resize began
        self.fence: Fence = NO_FENCE  # the operation lease of the resize running

    def snapshot(self) -> Snapshot:
        return current_snapshot(self.monitor, self.token)

    def active(self) -> list[str]:
        return self.snapshot().active_and_standby(self.fingerprint)[0]

    def resize(self, servers: int, retire: Sequence[str] = (), fence: Fence = NO_FENCE,
               settle: bool = False) -> Resized:
        """Make ``servers`` expert servers active, the ``retire`` ones not among them (they
        are drained). ``settle``: with the count already right, place the tier over its
        active servers again anyway (finishing a resize cut short)."""
        if servers < 1:
            raise ResizeError(f"a tier keeps at least one active expert server, not {servers}")
        with self.lock:
            self.fence = fence
            began = time.monotonic()
            snapshot = self.snapshot()
            active, standby = snapshot.active_and_standby(self.fingerprint)
            serving = set(active) | set(standby)
            unknown = [s for s in retire if s not in serving]
            if unknown:
                raise ResizeError(f"expert servers {unknown} are not serving in the tier, so "
                                  "they cannot be retired")
            done = Resized(len(active), len(active))
            # the replicas each expert has now: kept through the resize, lost ones made again
            self._replicas_of = snapshot.holdings(self.fingerprint)
            for server in [s for s in retire if s in standby]:  # nothing to move: drained
                self._retire(server, done)
            standby = [s for s in standby if s not in retire]
            leaving = [s for s in active if s in retire]
            staying = [s for s in active if s not in retire]
            if leaving:
                self._in(servers, staying, leaving, standby, done)
            elif servers > len(active):
                self._out(servers, active, standby, done)
            elif servers < len(active):
                order = self._least_first(active)
                self._in(servers, [s for s in active if s not in order[:len(active) - servers]],
                         order[:len(active) - servers], [], done)
            elif settle:
                self._settle(active, done)
            done.seconds = time.monotonic() - began
            self._check_reached(servers, retire, done)
            self.say(f"resize: {done.summary()}")
            return done

    def _least_first(self, active: list[str]) -> list[str]:
        """The active servers, those holding least first (the last named first among
        equals): the ones a scale-in retires."""
        held = self.snapshot().holdings(self.fingerprint)
        order = sorted(range(len(active)), key=lambda i: (
            sum(map(len, held[active[i]].values())), -i))
        return [active[i] for i in order]

    def _check_reached(self, servers: int, retire: Sequence[str], done: Resized) -> None:
        """``ResizeError`` unless the monitor shows the tier as the resize left it: ``after``
        active servers (``servers`` unless rolled back), none of ``retire`` serving."""
        deadline = time.monotonic() + 10.0
        while True:
            active, standby = self.snapshot().active_and_standby(self.fingerprint)
            still = [s for s in retire if s in active or s in standby]
            if len(active) == done.after and not still:
                return
            if time.monotonic() > deadline:
                raise ResizeError(f"the tier has {len(active)} active expert servers"
                                  + (f" and {still} still serving" if still else "")
                                  + f" after the resize, not {done.after}: {done.summary()}")
            time.sleep(0.1)

    # -- out --------------------------------------------------------------------------------
    def _out(self, servers: int, active: list[str], standby: list[str], done: Resized) -> None:
        before = list(active)
        try:
            newcomers = self._newcomers(servers - len(active), standby, done)
        except ResizeError:
            self._stop_unused(done)
            raise
        for _ in range(ATTEMPTS):
            try:
                self._place_over(active + newcomers, done)
                done.after = len(active) + len(newcomers)
                return
            except TransportError as exc:
                lost = self._lost(active + newcomers, exc, done)
                active = [s for s in active if s not in lost]
                newcomers = [s for s in newcomers if s not in lost]
                try:
                    newcomers += self._newcomers(servers - len(active) - len(newcomers), [
                        s for s in self.snapshot().active_and_standby(self.fingerprint)[1]
                        if s not in newcomers and s not in done.lost], done)
                except ResizeError as why:
                    self.say(f"resize: no server to take the lost ones' place ({why}); "
                             "rolling back")
                    break
        self._roll_back([s for s in before if s not in done.lost], newcomers, done)

    def _newcomers(self, count: int, standby: list[str], done: Resized) -> list[str]:
        """``count`` servers to fill: standby ones first, then started ones (registered), in
        batches of ``LAUNCH_BATCH``, a batch that fails started again."""
        taken = standby[:max(count, 0)]
        done.taken += taken
        missing = count - len(taken)
        if missing <= 0:
            return taken
        if self.launcher is None:
            raise ResizeError(f"{missing} more expert servers are needed and there is no "
                              "standby server and no launcher to start one")
        started: list[str] = []
        while len(started) < missing:
            started += self._start_batch(min(LAUNCH_BATCH, missing - len(started)), done)
        return taken + started

    def _start_batch(self, count: int, done: Resized) -> list[str]:
        """``count`` servers started and registered; ``ResizeError`` after ``ATTEMPTS``
        failed starts (a server that exits before it answers or registers)."""
        why = ""
        for attempt in range(1, ATTEMPTS + 1):
            self.fence.check()
            try:
                started = self.launcher.start(count)
            except TransportError as exc:
                why = str(exc)
                self.say(f"resize: starting {count} expert servers failed ({why}); "
                         + ("trying again" if attempt < ATTEMPTS else "giving up"))
                continue
            done.started += started
            self.say(f"resize: started {', '.join(started)}; waiting for them to register")
            deadline = time.monotonic() + REGISTER_TIMEOUT
            while set(started) - set(self.snapshot().active_and_standby(self.fingerprint)[1]):
                if time.monotonic() > deadline or self._exited(started):
                    break
                time.sleep(0.2)
            else:
                return started
            standby = self.snapshot().active_and_standby(self.fingerprint)[1]
            missing = sorted(set(started) - set(standby))
            why = f"started expert servers {missing} did not register"
            for server in started:  # the batch goes, and is started again
                self.launcher.stop(server)
                done.started.remove(server)
            self.say(f"resize: {why}; " + ("starting the batch again" if attempt < ATTEMPTS
                                            else "giving up"))
        raise ResizeError(f"{count} expert servers could not be started ({why})")

    def _exited(self, started: list[str]) -> bool:
        exited = getattr(self.launcher, "exited", None)
        return bool(exited and exited(started))

    def _stop_unused(self, done: Resized) -> None:
        """Started servers the resize will not use (it failed before placing): stopped."""
        for server in done.started:
            self.launcher.stop(server)

    # -- in ---------------------------------------------------------------------------------
    def _in(self, servers: int, staying: list[str], leaving: list[str], standby: list[str],
            done: Resized) -> None:
        """``leaving`` go; ``staying`` plus standby servers (up to ``servers`` in all) hold
        the tier."""
        taken = standby[:max(0, servers - len(staying))]
        done.taken += taken
        staying = staying + taken
        for _ in range(ATTEMPTS):
            try:
                self._place_over(staying, done, leaving)
                break
            except TransportError as exc:
                lost = self._lost(staying + leaving, exc, done)
                staying = [s for s in staying if s not in lost]
                leaving = [s for s in leaving if s not in lost]
        else:
            raise ResizeError(f"scale-in: servers kept failing ({', '.join(done.lost)})")
        for server in leaving:
            self._retire(server, done)
        done.after = len(staying)

    def _settle(self, active: list[str], done: Resized) -> None:
        """The count is right: place the tier evenly over its active servers again."""
        self._place_over(active, done)
        done.after = len(active)

    def _retire(self, server: str, done: Resized) -> None:
        self.fence.check()
        try:
            call(server, Drain(epoch=self.fence.epoch), self.token, 30.0)
        except TransportError as exc:
            self.say(f"resize: {server} did not drain ({exc})")
        if self.launcher is not None:
            self.launcher.stop(server)
        done.retired.append(server)

    # -- placing ----------------------------------------------------------------------------
    def _place_over(self, servers: Sequence[str], done: Resized,
                    emptied: Sequence[str] = ()) -> None:
        """Move the tier onto ``servers`` (the ``emptied`` ones give everything up)."""
        current = self.snapshot().holdings(self.fingerprint)
        current = current.only([s for s in current if s not in done.lost])
        target = resize_holdings(current.only([s for s in current if s not in emptied]),
                                 servers, self.num_experts, self._replicas_of)
        layers = current.layers()
        for server in emptied:
            target = target.with_server(server, ServerHoldings({layer: () for layer in layers}))
        self.say(f"resize: placing over {len(servers)} servers: {moved(current, target)} "
                 "replicas to fill")
        applied = Applied()
        try:
            apply_placement(current, target, self.token, grace=self.grace, say=self.say,
                            done=applied, fence=self.fence)
        finally:  # a placement cut short by a lost server filled what it filled
            done.moved += applied.from_peer + applied.from_disk
            done.from_peer += applied.from_peer
            done.from_disk += applied.from_disk

    def _lost(self, servers: Sequence[str], exc: Exception, done: Resized) -> list[str]:
        """The servers of ``servers`` that no longer answer (after ``exc`` from one of them)."""
        lost = []
        for s in servers:
            try:
                probe(s, self.token, 5.0)
            except TransportError:
                lost.append(s)
        if not lost:
            raise ResizeError(f"resize failed: {exc}") from exc
        done.lost += lost
        self.say(f"resize: lost {', '.join(lost)} ({exc}); placing again without")
        return lost

    def _roll_back(self, before: list[str], newcomers: list[str], done: Resized) -> None:
        """Back to the servers active before (the newcomers emptied: standby again)."""
        if not before:
            raise ResizeError("every server active before the resize was lost")
        self._place_over(before, done, [s for s in newcomers if s not in done.lost])
        done.rolled_back, done.after = True, len(before)

    def restore(self, before: Sequence[str], fence: Fence = NO_FENCE) -> Resized:
        """Roll a resize cut short back: the tier placed over the servers of ``before`` that
        still serve, the other active servers emptied (standby again)."""
        with self.lock:
            self.fence = fence
            began = time.monotonic()
            snapshot = self.snapshot()
            active, standby = snapshot.active_and_standby(self.fingerprint)
            self._replicas_of = snapshot.holdings(self.fingerprint)
            back = [s for s in before if s in active or s in standby]
            done = Resized(len(active), len(active))
            self._roll_back(back, [s for s in active if s not in back], done)
            done.seconds = time.monotonic() - began
            self._check_reached(done.after, (), done)
            return done
