"""``ClientTier``: one attention rank's live view of the expert tier.

It owns the rank's connections (one per expert server, by stable server id) and turns every
change of the tier into a new ``View`` (a routing table with the next epoch, and the connections
of its servers), which the data path (``EaasClient``) adopts between steps:

* the monitor says a server registered: join it (here, never on the data path), next view;
* the monitor suspects a server (its heartbeats are late): its experts go to their other
  holders where they have some, next view; it is used as before once cleared;
* the monitor says a server was lost, left, re-registered as a new incarnation or is draining:
  drop it, next view; a wait on it stops at once (``ServerConnection.lost_why``). Except a
  server lost on heartbeats alone that is the last holder of some expert and whose connection
  is open: it answers exchanges, so it is kept (``kept_why``) until it registers again or the
  data path fails it (docs/fault-tolerance.md, "Suspected, then lost");
* the data path saw a server fail (no answer within the result timeout, a broken connection):
  ``lose`` drops it at once and reports it to the monitor, which evicts it (it is used again
  only once it has registered again);
* the monitor lost *this* client (it hung, or its process stalled): its servers took its
  slots back (and closed its connections), so ``recover`` registers again at once and joins
  them all afresh;
* a server's control connection closed (the fastest sign of a crash): drop it, next view, and
  report it (over etcd nothing else would take it out of the table before its lease's TTL).

A dropped connection is closed only once the data path has adopted a view without it, so no
step ever uses a closed connection. Servers given at launch that the monitor does not know are
kept until they fail, then joined again when they answer (every ``RETRY`` seconds).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ibgda import TransportError
from sglang_eaas import transports
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.connection import ServerConnection
from sglang_eaas.client.metrics import TierMetrics
from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import HEARTBEAT, connect
from sglang_eaas.membership.presence import Presence
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import PlacementError
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.monitor import CLIENT, NO_HEARTBEAT, SERVING, Member, Snapshot
from sglang_eaas.protocol.slot import DTYPE_NAMES
from sglang_eaas.routing_table import RoutingTable

logger = logging.getLogger(__name__)
RETRY = 2.0  # seconds between attempts to join a server that failed to join
WATCH = 5.0  # seconds one monitor watch call waits for a change
CLOSES_POLL = 0.1  # seconds between looks at which control connections a server closed
START_TIMEOUT = 30.0  # seconds a server given at launch may take to answer a join
JOIN_TIMEOUT = 5.0  # at runtime (a hung server must not hold the tier thread for long)
CONFIRM_TRIES, CONFIRM_WAIT = 5, 0.05  # asking a server still registering for its incarnation


@dataclass(frozen=True)
class View:
    """What a step uses: a routing table and the connection of each of its servers."""

    table: RoutingTable
    connections: Mapping[str, ServerConnection]

    @property
    def epoch(self) -> int:
        return self.table.epoch


@dataclass(frozen=True)
class TierSettings:
    addresses: tuple[str, ...] = ()  # servers given at launch: each must answer at start
    monitor: str = ""  # the monitor's URL (HOST:PORT, etcd://HOST:PORT), "" for none
    heartbeat: float = HEARTBEAT
    result_timeout: float = 2.0  # seconds a server may take to answer before it is dropped
    transport: str = transports.AUTO
    expected: Holdings | None = None  # a placement file's servers and their experts
    wait_for_experts: float = 30.0  # seconds to wait at start until every expert has a holder
    token: str | None = field(default=None, repr=False)
    micro_batches: int = 1  # slots per server: 2 with two-batch overlap (one per micro-batch)
    adapter_slots: int = 0  # expert ids per MoE layer past the model's, for ESFT adapters


class ClientTier:
    def __init__(self, settings: TierSettings, info: MoeModelInfo, model: ModelIdentity,
                 dtype: torch.dtype, client_id: str, metrics: TierMetrics | None = None,
                 load: Callable[[], dict] = dict, adopted: Callable[[], int] = lambda: 0):
        """``load``: what the heartbeat carries (the client's last load window);
        ``adopted``: the epoch of the view the data path uses now (a connection dropped from
        the views is closed only once the data path has adopted one past it)."""
        self.settings, self.info, self.model = settings, info, model
        self._load, self._adopted = load, adopted
        self.metrics = metrics or TierMetrics()
        self.dtype, self.client_id = DTYPE_NAMES[dtype], client_id
        self._lock = threading.RLock()
        self._conns: dict[str, ServerConnection] = {}  # every live connection, by server id
        self._retired: list[tuple[int, ServerConnection]] = []  # closed once adopted past
        self._failed_joins: dict[tuple[str, str], float] = {}  # (id, incarnation) -> retry at
        self._static = set(settings.addresses)
        self._known: set[str] = set()  # servers the monitor has listed (it tells their fate)
        self._dead: set[tuple[str, str]] = set()  # (id, incarnation) that failed this client
        self._recovering = threading.Lock()  # one recovery at a time
        self._check_backend = None
        self._epoch = -1  # the first view is epoch 0
        self.evicted = False
        self._joined_as = ""  # this client's incarnation that its connections belong to
        self.stats: collections.Counter[str] = collections.Counter()
        # The data path's way to take a new view (it ignores one older than what it has).
        self.on_view: Callable[[View], None] = lambda view: None
        self.backend = self.presence = None
        self._revision = -1
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="eaas-client-tier",
                                         daemon=True)
        self._closes = threading.Thread(target=self._watch_closes, name="eaas-client-closes",
                                        daemon=True)
        self._rejoins = threading.Thread(target=self._rejoin_static, name="eaas-client-rejoins",
                                         daemon=True)

    # -- start -----------------------------------------------------------------------------
    def start(self) -> View:
        """Register with the monitor, join every server and wait until every expert has a
        holder (``PlacementError`` after ``wait_for_experts``): the first view. ``follow``
        then follows the tier."""
        s = self.settings
        try:
            snapshot = None
            if s.monitor:
                self.backend = connect(s.monitor, self._token())
                member = Member(CLIENT, self.client_id, socket.gethostname(), os.getpid())
                self.presence = Presence(connect(s.monitor, self._token()), member,
                                         s.heartbeat, load=self._load,
                                         on_lost=self._on_evicted).start()
                snapshot = self.backend.watch(-1, 0.0)
                self._joined_as = self.presence.incarnation
            for address in s.addresses:  # each must answer now, as at any launch
                known = snapshot and {m.id: m for m in snapshot.servers()}.get(address)
                self._conns[address] = self._join(address, known.incarnation if known else "",
                                                  timeout=START_TIMEOUT)
            self._check_expected()
            view = self._apply(snapshot) if snapshot else self._build()
            return self._wait_for_experts(view)
        except BaseException:
            self.close()
            raise

    def follow(self, on_view: Callable[[View], None]) -> None:
        """From now on, hand every new view to ``on_view`` (the data path's: it ignores one
        older than what it has)."""
        self.on_view = on_view
        self._watcher.start()
        self._closes.start()
        self._rejoins.start()

    def token(self) -> str:
        """The shared secret of the expert servers' control endpoints."""
        return self._token()

    def _token(self) -> str:
        from sglang_eaas import envs

        return envs.TOKEN.get() if self.settings.token is None else self.settings.token

    def _join(self, address: str, incarnation: str, timeout: float = JOIN_TIMEOUT
              ) -> ServerConnection:
        return ServerConnection(address, self.client_id, self.model, self.dtype,
                                token=self._token(), transport=self.settings.transport,
                                timeout=timeout, incarnation=incarnation,
                                client_incarnation=self.presence.incarnation
                                if self.presence else "", slots=self.settings.micro_batches)

    def _check_expected(self) -> None:
        expected = self.settings.expected or Holdings()
        for address, conn in self._conns.items():
            planned = expected.get(address)
            if planned is not None and not conn.holdings.same_experts(planned):
                raise PlacementError(
                    f"expert server {address} holds experts {conn.holdings} (per MoE "
                    f"layer), the placement file says {planned}")

    def _wait_for_experts(self, view: View) -> View:
        deadline = time.monotonic() + self.settings.wait_for_experts
        while view.table.missing:
            if self.backend is None or time.monotonic() > deadline:
                raise PlacementError(f"{_missing(view.table)} (waited "
                                     f"{self.settings.wait_for_experts:.0f}s)")
            logger.info("sglang-eaas: waiting for expert servers: %s", _missing(view.table))
            snapshot = self.backend.watch(self._revision, min(WATCH, max(
                0.1, deadline - time.monotonic())))
            view = self._apply(snapshot)
        return view

    # -- views -----------------------------------------------------------------------------
    def _build(self) -> View:
        """The next view of the live connections (under the lock)."""
        with self._lock:
            self._epoch += 1
            conns = dict(self._conns)
            table = self._table(self._epoch, conns)
            return View(table, conns)

    def _table(self, epoch: int, conns: Mapping[str, ServerConnection]) -> RoutingTable:
        """The routing table of ``conns``' holdings (ids past the model's experts: ESFT
        adapter slots, ``TierSettings.adapter_slots`` per layer; an adapter expert past them,
        placed by a client with more slots, is not this client's to use). Suspected servers
        are left out where the others hold what they do: each is added back, the most recently
        suspected first, only if it holds something the table has no other holder for."""
        size = self.info.num_experts + self.settings.adapter_slots

        def build(servers: list[str]) -> RoutingTable:
            return RoutingTable.build(epoch, Holdings({s: conns[s].holdings.below(size)
                                                       for s in servers}),
                                      list(self.info.moe_layers), size,
                                      allow_missing=True, base_experts=self.info.num_experts)

        # the most recently suspected first: the least suspicious (a false suspicion on a busy
        # host comes and goes; a dead or hung server stays suspected from its first)
        suspected = sorted((s for s, c in conns.items() if c.suspected),
                           key=lambda s: -conns[s].suspected_at)
        if not suspected:
            return build(list(conns))
        used = [s for s, c in conns.items() if not c.suspected]
        table = build(used)
        for server in suspected:
            more = build([s for s in conns if s in used or s == server])
            if _missing_count(more) < _missing_count(table):
                used.append(server)
                table = more
        return table

    def live_connections(self) -> dict[str, ServerConnection]:
        with self._lock:
            return dict(self._conns)

    def _apply(self, snapshot: Snapshot) -> View:
        """Follow the monitor: drop what left, join what came; the next view."""
        self._revision = snapshot.revision
        servers = {m.id: m for m in snapshot.servers(self.model.fingerprint)}
        self._known |= set(servers)  # followed through the monitor from now on
        gone_as = {d.id: d for d in snapshot.departures}
        kept = self._kept_on_heartbeats(servers, snapshot)
        listed = {(sid, m.incarnation) for sid, m in servers.items()}
        confirmed = self._confirm_incarnations(servers)
        with self._lock:
            # a failed join is retried only while the monitor lists that incarnation
            self._failed_joins = {k: at for k, at in self._failed_joins.items() if k in listed}
            for sid, conn in list(self._conns.items()):
                m = servers.get(sid)
                if m is None and sid in self._static and not conn.incarnation:
                    continue  # a server given at launch that the monitor does not know
                if sid in kept:
                    continue
                if confirmed.get(sid) is conn and not conn.incarnation:
                    conn.incarnation = m.incarnation  # joined before it had registered
                    continue
                if m is not None and m.incarnation == conn.incarnation and m.status == SERVING:
                    self._follow_suspicion(conn, m.suspected)
                    if m.holdings != conn.holdings:
                        # a replica (or an adapter's experts) added or dropped
                        logger.info("sglang-eaas: expert server %s now holds experts per MoE "
                                    "layer %s", sid, m.holdings)
                        conn.holdings = m.holdings
                        self.stats["holdings_changes"] += 1
                    continue
                if m is not None:
                    why, reason = (("draining", None) if m.status != SERVING else
                                   ("registered again as a new incarnation", "replaced"))
                else:
                    departed = gone_as.get(sid)
                    why, reason = ((departed.why, departed.reason) if departed is not None
                                   else ("gone from the monitor", "gone"))
                self._drop(conn, why, reason)
        for sid, m in servers.items():
            if m.status != SERVING or sid in self._conns:
                continue
            if ((sid, m.incarnation) in self._dead
                    or time.monotonic() < self._failed_joins.get((sid, m.incarnation), 0.0)):
                continue  # failed this client: used again only as a new incarnation
            try:
                conn = self._join(sid, m.incarnation)
            except TransportError as exc:
                logger.warning("sglang-eaas: cannot join expert server %s: %s", sid, exc)
                self._failed_joins[(sid, m.incarnation)] = time.monotonic() + RETRY
                continue
            with self._lock:
                self._conns[sid] = conn
                self._failed_joins.pop((sid, m.incarnation), None)
            self.stats["joins"] += 1
            logger.info("sglang-eaas: expert server %s joined the table (experts per MoE layer "
                        "%s)", sid, conn.holdings)
        return self._build()

    def _follow_suspicion(self, conn: ServerConnection, suspected: bool) -> None:
        """Under the lock: the monitor suspects ``conn``'s server, or no longer does."""
        if suspected == conn.suspected:
            return
        conn.suspected, conn.suspected_at = suspected, time.monotonic() if suspected else 0.0
        self.stats["suspicions" if suspected else "suspicions_cleared"] += 1
        if suspected:
            self.metrics.suspected(conn.address)
            logger.warning("sglang-eaas: expert server %s is suspected (late heartbeats): its "
                           "experts go to their other holders until it heartbeats again",
                           conn.address)
        else:
            logger.info("sglang-eaas: expert server %s heartbeats again: used as before",
                        conn.address)

    def _kept_on_heartbeats(self, servers: Mapping[str, Member], snapshot: Snapshot) -> set[str]:
        """The servers the monitor lost on heartbeats alone (no new incarnation listed) that
        hold experts no other live server holds and whose connection is open: kept in use, for
        they answer exchanges (a hung one fails its next one; one that reaches the monitor
        again registers as a new incarnation, which replaces it)."""
        gone = {d.id: d for d in snapshot.departures}
        with self._lock:
            candidates = {sid: c for sid, c in self._conns.items() if sid not in servers
                          and sid in gone and gone[sid].incarnation == c.incarnation
                          and gone[sid].reason == NO_HEARTBEAT}
            if not candidates:
                return set()
            others = {sid: c for sid, c in self._conns.items() if sid not in candidates}
            kept = set()
            for sid, conn in candidates.items():
                if conn.closed_by_server() or not self._orphans_without(sid, others, conn):
                    continue
                kept.add(sid)
                others[sid] = conn
                if conn.kept_why is None:
                    conn.kept_why = gone[sid].why
                    self.stats["kept_last_holders"] += 1
                    logger.warning("sglang-eaas: the monitor lost expert server %s (%s), but it "
                                   "holds experts no other live server does and its connection "
                                   "is open: kept until it registers again or fails an exchange",
                                   sid, gone[sid].why)
            return kept

    def _orphans_without(self, sid: str, others: Mapping[str, ServerConnection],
                         conn: ServerConnection) -> bool:
        """Whether ``conn`` (server ``sid``) holds experts none of ``others`` holds."""
        return (_missing_count(self._table(0, {**others, sid: conn}))
                < _missing_count(self._table(0, others)))

    def _confirm_incarnations(self, servers: Mapping[str, Member]) -> dict[str, ServerConnection]:
        """The connections joined before their server had registered (a server given at launch
        that was still registering with the monitor) whose server reports, over that same
        connection, the incarnation the monitor now lists: they are kept, not dropped as a
        new incarnation. Asked outside the lock (a hung server must not stall the data path)."""
        unknown = [(conn, servers[sid]) for sid, conn in self.live_connections().items()
                   if not conn.incarnation and sid in servers
                   and servers[sid].status == SERVING]
        confirmed = {}
        for conn, member in unknown:
            for attempt in range(CONFIRM_TRIES):  # it answers once its registration returned
                try:
                    reported = conn.stats().incarnation
                except (TransportError, ControlError, OSError):
                    break
                if reported is not None:
                    if reported == member.incarnation:
                        confirmed[member.id] = conn
                    break
                time.sleep(CONFIRM_WAIT)
        return confirmed

    def _drop(self, conn: ServerConnection, why: str, reason: str | None) -> None:
        """Under the lock: take ``conn`` out of the live set; it is closed once adopted past.
        ``reason``: why it is lost, as counted (a ``Departure.reason``, or
        ``refused``, ``replaced``, ``gone``); None: not lost (draining)."""
        lost = reason is not None
        if self._conns.get(conn.address) is not conn:
            return
        del self._conns[conn.address]
        if lost and conn.lost_why is None:
            conn.lost_why = why
        if lost and conn.incarnation:
            self._dead.add((conn.address, conn.incarnation))
        self._retired.append((self._epoch + 1, conn))
        self.stats["drops"] += 1
        if lost:
            self.metrics.failover(conn.address)
            self.metrics.lost(conn.address, reason)
            self.stats[f"losses_{reason}"] += 1
        orphans = self._table(0, self._conns).missing
        log = logger.info if why == "draining" else logger.warning
        log("sglang-eaas: expert server %s leaves the table (%s); its experts go to their other "
            "holders%s", conn.address, why,
            f"; {_missing_of(orphans)}" if orphans else "")

    def lose(self, conn: ServerConnection, why: str, report: bool) -> View:
        """The data path saw ``conn`` fail: drop it now and return the view without it;
        ``report`` tells the monitor (a timeout the monitor may not have noticed; else it
        refused entries and no newer table came)."""
        with self._lock:
            self._drop(conn, why, "result_timeout" if report else "refused")
            view = self._build()
        self.stats["failovers"] += 1
        if report:
            self._report_soon(conn, why)
        return view

    def _report_soon(self, conn: ServerConnection, why: str) -> None:
        """Tell the monitor, on a thread of its own, that ``conn``'s incarnation failed here."""
        if self.backend is not None and conn.incarnation:
            threading.Thread(target=self._report, args=(conn, why), daemon=True).start()

    def _report(self, conn: ServerConnection, why: str) -> None:
        try:
            reporter = connect(self.settings.monitor, self._token())
            try:
                reporter.report(conn.address, conn.incarnation, f"{self.client_id}: {why}")
            finally:
                reporter.close()
        except TransportError as exc:
            logger.warning("sglang-eaas: could not report %s to the monitor: %s",
                           conn.address, exc)

    def _on_evicted(self, why: str) -> None:
        self.evicted = True

    def recover(self, stale: list[ServerConnection] | None = None) -> View | None:
        """This client was lost by the monitor (a hang, say), so its servers took its slots
        back: register again unless the presence already did, join every live server afresh
        under the new incarnation, then swap the new connections in at once (a wait on an old
        slot stops, and its tokens go to the new connections). ``stale``: the closed
        connections that called for it. None (nothing to do) if another recovery replaced
        them meanwhile, or if the loss it was called for is already handled."""
        with self._recovering:
            with self._lock:
                if stale is not None and not any(self._conns.get(c.address) is c
                                                 for c in stale):
                    return None
            self.evicted = False
            snapshot = self._checker().watch(-1, 0.0)
            registered = self._registered_as(snapshot)
            if stale is None and registered == self.presence.incarnation == self._joined_as:
                return None  # a late notice of a loss that a recovery already handled
            if not self.presence.incarnation or registered != self.presence.incarnation:
                self.presence.register_again()
            incarnation = self.presence.incarnation
            old = self.live_connections()
            targets = {m.id: m.incarnation for m in snapshot.servers(self.model.fingerprint)
                       if m.status == SERVING and (m.id, m.incarnation) not in self._dead}
            targets.update({a: c.incarnation for a, c in old.items() if a not in self._known})
            fresh = {}
            for address, server_incarnation in targets.items():
                try:
                    fresh[address] = self._join(address, server_incarnation)
                except TransportError as exc:
                    logger.warning("sglang-eaas: cannot join %s again: %s", address, exc)
                    self._failed_joins[(address, server_incarnation)] = time.monotonic() + RETRY
            with self._lock:
                for address, conn in self._conns.items():
                    conn.lost_why = "this client was lost by the monitor and joined again"
                    self._retired.append((self._epoch + 1, conn))
                self._conns = fresh
                self._joined_as = incarnation
                self.stats["recoveries"] += 1
                logger.warning("sglang-eaas: the monitor had lost this client (a hang or a stall "
                               "of this process?); registered again as %s and joined %d expert "
                               "servers again", incarnation, len(fresh))
                return self._build()

    def _needs_recovery(self) -> bool:
        """Whether this client's connections belong to an incarnation the monitor lost."""
        return self.presence is not None and (
            self.evicted or self.presence.incarnation != self._joined_as)

    def _checker(self):
        """A monitor connection of its own for one-off reads (the watcher's long-polls)."""
        if self._check_backend is None:
            self._check_backend = connect(self.settings.monitor, self._token())
        return self._check_backend

    def _registered_as(self, snapshot: Snapshot | None = None) -> str:
        """This client's incarnation as the monitor has it (in ``snapshot``, else now; "" if
        it has none)."""
        if snapshot is None:
            snapshot = self._checker().watch(-1, 0.0)
        return next((m.incarnation for m in snapshot.clients() if m.id == self.client_id), "")

    def _lost_by_monitor(self, closed: list[ServerConnection]) -> bool:
        """Whether ``closed`` closed because the monitor lost the incarnation they belong to
        (servers take such slots back), rather than because their servers died."""
        try:
            current = self._registered_as()
        except TransportError:
            return False  # cannot tell: take closed connections at their word
        return any(conn.client_incarnation != current for conn in closed)

    # -- the watcher thread ----------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.is_set():
            self._close_adopted()
            busy = bool(self._retired)
            if self.backend is None:
                self._stop.wait(0.05 if busy else RETRY)
                snapshot = None
            else:
                try:
                    snapshot = self.backend.watch(self._revision, 0.05 if busy else RETRY
                                                  if self._failed_joins else WATCH)
                except TransportError as exc:
                    logger.warning("sglang-eaas: monitor watch failed: %s", exc)
                    self._stop.wait(self.settings.heartbeat)
                    continue
            if self._stop.is_set():
                break
            try:
                self._follow(snapshot)
            except Exception:  # a bug here must not end the following
                logger.exception("sglang-eaas: following the expert tier failed")

    def _follow(self, snapshot: Snapshot | None) -> None:
        if self._needs_recovery():
            view = self.recover()  # the monitor lost this client: join afresh
            if view is not None:
                self.on_view(view)
            return
        changed = snapshot is not None and snapshot.revision != self._revision
        if changed or (snapshot is not None and self._retry_due()):
            self.on_view(self._apply(snapshot))

    def _retry_due(self) -> bool:
        """Whether a server that failed to join (and is not back) may be tried again now."""
        now = time.monotonic()
        with self._lock:
            return any(at <= now and sid not in self._conns
                       for (sid, _), at in self._failed_joins.items())

    def _watch_closes(self) -> None:
        """The fastest sign of a crashed server: its kernel closes our control connection at
        once. Such a server leaves the table now (a wait on it stops), whatever the monitor
        has noticed yet."""
        import selectors

        while not self._stop.is_set():
            conns = self.live_connections()
            if not conns:
                self._stop.wait(CLOSES_POLL)
                continue
            try:
                with selectors.DefaultSelector() as selector:
                    for conn in conns.values():
                        selector.register(conn.socket(), selectors.EVENT_READ, conn)
                    ready = selector.select(CLOSES_POLL)
            except (OSError, ValueError):  # a connection closed meanwhile: look again
                continue
            closed = [key.data for key, _ in ready if key.data.closed_by_server()]
            if not closed:
                if ready:  # a reply to a call of someone else's, not read yet
                    self._stop.wait(CLOSES_POLL)
                continue
            dead = not (self.presence is not None and self._lost_by_monitor(closed))
            if not dead:
                # Not the servers' death: the monitor lost this client (a stall of this
                # process), so they took its slots back. Join them again now.
                try:
                    view = self.recover(closed)
                    if view is not None:
                        self.on_view(view)
                    continue
                except TransportError as exc:
                    logger.warning("sglang-eaas: cannot register with the monitor again: %s", exc)
            why = "its control connection closed (the server is gone)"
            with self._lock:
                for conn in closed:
                    self._drop(conn, why, "connection_closed")
                view = self._build()
            self.on_view(view)
            if dead:  # etcd lists it until its lease's TTL ends
                for conn in closed:
                    self._report_soon(conn, why)

    def _rejoin_static(self) -> None:
        """Join again, once they answer, the servers given at launch that the monitor has never
        known and that failed (on a thread of its own: a hung server makes a join wait)."""
        while not self._stop.wait(RETRY):
            with self._lock:
                missing = [a for a in self._static if a not in self._conns
                           and a not in self._known]
            for address in missing:
                try:
                    conn = self._join(address, "")
                except TransportError:
                    continue
                with self._lock:
                    self._conns[address] = conn
                    view = self._build()
                logger.info("sglang-eaas: expert server %s answers again; back in the table",
                            address)
                self.on_view(view)

    def _close_adopted(self) -> None:
        """Close the connections the data path no longer uses: dropped from a view it has
        adopted, and with no request of either micro-batch still to be collected (a wait on
        an unmapped slot would crash the process)."""
        adopted = self._adopted()
        with self._lock:
            done = [c for epoch, c in self._retired if epoch <= adopted and not c.in_flight]
            self._retired = [(e, c) for e, c in self._retired if e > adopted or c.in_flight]
        for conn in done:  # a hung server makes close() wait LEAVE_TIMEOUT: not on this thread
            threading.Thread(target=conn.close, name="eaas-close", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for thread in (self._watcher, self._closes, self._rejoins):
            if thread.is_alive():
                thread.join(timeout=WATCH + 1)
        with self._lock:
            conns = list(self._conns.values()) + [c for _, c in self._retired]
            self._conns, self._retired = {}, []
        for conn in conns:
            conn.close()
        if self.presence is not None:
            self.presence.close()
        for backend in (self.backend, self._check_backend):
            if backend is not None:
                backend.close()


def _missing_count(table: RoutingTable) -> int:
    """(MoE layer, expert) pairs ``table`` has no holder for."""
    return sum(len(experts) for experts in table.missing.values())


def _missing(table: RoutingTable) -> str:
    return _missing_of(table.missing)


def _missing_of(missing: Mapping[int, list[int]]) -> str:
    return "; ".join(f"experts {experts} of MoE layer {layer} have no live expert server"
                     for layer, experts in missing.items())
