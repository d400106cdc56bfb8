"""``ServerTier``: an expert server's part in the live tier, when it has a monitor (``--monitor``).

* Its registration: a ``monitor.Presence`` heartbeats while the serving loop is healthy and
  registers again (a new incarnation) when the monitor lost or evicted it, so a server that
  comes back from a SIGSTOP is used again only once it has re-registered.
* Its clients: when the monitor loses a client (dead or hung), the server takes that client's
  slots back and closes its control connection at once, instead of waiting for TCP to notice.
* Draining: the server marks itself ``draining``; clients stop sending to it at their next step
  and close their connections; once none is left (or after the drain's timeout), it exits.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

from ibgda import TransportError
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.membership import connect
from sglang_eaas.membership.presence import Presence
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.monitor import CLIENT, DRAINING, SERVER, SERVING, Member
from sglang_eaas.routing_table import unroutable

if TYPE_CHECKING:
    from sglang_eaas.expert_server.server import ExpertServer

logger = logging.getLogger(__name__)
WATCH_TIMEOUT = 5.0


class ServerTier:
    def __init__(self, server: "ExpertServer"):
        config = server.config
        self.server, self.url, self.token = server, config.monitor, config.token
        self.backend = connect(config.monitor, config.token)  # watching
        member = Member(SERVER, server.address, socket.gethostname(), os.getpid(),
                        fingerprint=server.info.fingerprint(),
                        num_experts=server.info.num_experts, holdings=server.held.holdings)
        self.presence = Presence(connect(config.monitor, config.token), member,
                                 config.heartbeat, load=server.load, healthy=server.healthy)
        self.draining = False
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="eaas-server-tier",
                                         daemon=True)

    def start(self) -> "ServerTier":
        """Register (what it holds now: no change is made while the monitor checks it
        against this server), then follow the tier."""
        with self.server.replicas.frozen():
            self.presence.set_holdings(self.server.held.holdings)
            self.presence.start()
        logger.info("registered with the monitor %s as incarnation %s", self.url,
                    self.presence.incarnation)
        self._watcher.start()
        return self

    def counters(self) -> dict:
        return {"monitor": self.url, "incarnation": self.presence.incarnation,
                "status": DRAINING if self.draining else SERVING}

    def _watch(self) -> None:
        """Take back the slots of every client the monitor loses."""
        after, seen = -1, set()
        while not self._stop.is_set():
            try:
                snapshot = self.backend.watch(after, WATCH_TIMEOUT)
            except TransportError:
                self._stop.wait(self.presence.period)
                continue
            gone = {(d.id, d.incarnation) for d in snapshot.departures
                    if d.kind == CLIENT and d.revision > after and after >= 0}
            after = snapshot.revision
            gone |= seen - {(m.id, m.incarnation) for m in snapshot.clients()}
            seen = {(m.id, m.incarnation) for m in snapshot.clients()}
            if gone:
                self.server.clients_lost(gone)

    def drain(self, force: bool, timeout: float) -> None:
        """Mark the server draining (clients stop using it), then exit once no client is left
        or ``timeout`` seconds passed. ``ControlError("drain_uncovered")`` where it is the last
        live holder of an expert, unless ``force``."""
        if self.draining:
            return
        if not force:
            self.check_covered(ServerHoldings({}), "drain_uncovered", "drain with force")
        self.draining = True
        self.presence.set_status(DRAINING)
        logger.info("draining: clients stop sending here at their next step")
        threading.Thread(target=self._finish_drain, args=(timeout,), name="eaas-drain",
                         daemon=True).start()

    def check_covered(self, after: ServerHoldings, reason: str, forced: str) -> None:
        """``ControlError(reason)`` unless the live tier, with this server holding ``after``
        instead, still computes every expert it computes now (whole, or every part of it; an
        ESFT adapter expert: held by another server); ``forced`` names the way to do it
        anyway."""
        probe = connect(self.url, self.token)
        try:
            snapshot = probe.watch(-1, 0.0)
        finally:
            probe.close()
        me = self.server
        base, layers = me.info.num_experts, list(me.info.moe_layers)
        others = snapshot.holdings(me.info.fingerprint()).without(me.address)
        now = unroutable(others.with_server(me.address, me.held.holdings), layers, base)
        later = unroutable(others.with_server(me.address, after), layers, base)
        for layer in layers:
            alone = sorted(later.get(layer, set()) - now.get(layer, set()))
            held = others.holders(layer)
            alone += [e for e in me.held.holdings.get(layer, ())
                      if e >= base and e not in after.get(layer, ()) and e not in held]
            if alone:
                raise ControlError(reason, (
                    f"expert server {me.address} is the last live holder of experts {alone} in "
                    f"MoE layer {layer}; start a server that holds them first, or {forced} "
                    "(requests that need them would fail)"))

    def _finish_drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.server.client_count() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.server.client_count()
        if left:
            logger.warning("drain: %d clients still joined after %.0fs; exiting anyway", left,
                           timeout)
        else:
            logger.info("drain: every client has stopped using this server; exiting")
        self.server.stop()

    def close(self) -> None:
        self._stop.set()
        self.presence.close()
        self.backend.close()
