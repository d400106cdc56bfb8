"""The etcd monitor backend (``etcd://HOST:PORT``, etcd's v3 HTTP gateway via ``etcd3gw``).

For multi-host deployments, where the monitor must outlive any one SGLang launcher. The same
``Member`` records as the embedded monitor, kept as etcd keys:

* liveness is an etcd **lease**: a member's record lives under ``/sglang-eaas/members/KIND/ID``
  with a lease of ``ceil(2 * heartbeat)`` seconds (at least 1, etcd's unit) that every heartbeat
  keeps alive; a member whose heartbeats stop loses its record when the lease expires, and its
  incarnation *is* its lease id. A client's timeout report revokes the server's lease (eviction);
* changes are an etcd **watch** on that prefix (every PUT or DELETE bumps this backend's
  revision and wakes ``watch`` callers, who then read the whole prefix);
* since anyone who reaches etcd can write keys, every record is **signed** with the shared token
  (``protocol.monitor.sign``): a record whose HMAC does not verify is ignored by every reader and
  counted (``stats().control_refused``), so a forged registration never reaches a routing
  table.
  (Guard the etcd endpoint itself with etcd's own TLS and users: the token only proves who wrote
  a record, it cannot stop a deletion.)
* a member's load goes to ``/sglang-eaas/load/KIND/ID`` every few heartbeats, outside the
  watched prefix, so load updates do not wake the watchers.

etcd grants no lease shorter than its minimum TTL (``3/2 * election timeout``, rounded up to a
second: run etcd with ``--heartbeat-interval 50 --election-timeout 250`` for 1 s) and checks for
expired leases every 500 ms, so a dead member is noticed within TTL + 0.5 s.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import math
import threading
from dataclasses import replace
from typing import Any, Callable

from ibgda import TransportError
from sglang_eaas.addresses import parse_address
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.membership.base import MemberLost, MemberSession, MonitorBackend
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.monitor import (
    Departure, Member, MonitorStats, Snapshot, sign, verify,
)

logger = logging.getLogger(__name__)
PREFIX = "/sglang-eaas/"
MEMBERS, LOADS = PREFIX + "members/", PREFIX + "load/"
CALL_TIMEOUT = 5.0
LOAD_EVERY = 10  # heartbeats between load updates
DEPARTURES_KEPT = 64


# etcd's raft timing for the tier: its minimum lease TTL is then 1 s (see the module docstring)
RAFT_TIMING = ("--heartbeat-interval", "50", "--election-timeout", "250")


def single_node_command(binary: str, data_dir: str, host: str, client_port: int,
                        peer_port: int) -> list[str]:
    """The command line of a one-member etcd cluster serving the tier's members at
    ``host:client_port`` (the tests', the benchmarks' and ``python -m sglang_eaas.deploy``'s)."""
    client, peer = f"http://{host}:{client_port}", f"http://{host}:{peer_port}"
    return [binary, "--name", "eaas", "--data-dir", data_dir,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"eaas={peer}", *RAFT_TIMING]


def _key(root: str, member: Member) -> str:
    return f"{root}{member.kind}/{member.id}"


class EtcdMonitor(MonitorBackend):
    def __init__(self, address: str, token: str):
        from etcd3gw.client import Etcd3Client

        self.address, self.token = "etcd://" + address, token
        host, port = parse_address(address)
        self.client = Etcd3Client(host, port, timeout=CALL_TIMEOUT)
        self._call(self.client.status)  # reachable, or TransportError now
        self._cond = threading.Condition()
        self._revision = 0
        self._departures: collections.deque[Departure] = collections.deque(maxlen=DEPARTURES_KEPT)
        self._cancel: Callable[[], None] | None = None
        self._refused: dict[str, str] = {}  # etcd key -> why its record was refused

    def _call(self, fn: Callable, *args, **kwargs) -> Any:
        """``fn(...)``; any failure to reach etcd becomes ``TransportError``."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # etcd3gw raises requests' and its own exception types
            raise TransportError(f"etcd {self.address}: {type(exc).__name__}: {exc}") from exc

    # -- watching --------------------------------------------------------------------------
    def _ensure_watch(self) -> None:
        if self._cancel is not None:
            return
        events, self._cancel = self._call(self.client.watch_prefix, MEMBERS, prev_kv=True)
        threading.Thread(target=self._consume, args=(events,), name="eaas-etcd-watch",
                         daemon=True).start()

    def _consume(self, events) -> None:
        try:
            for event in events:
                with self._cond:
                    if event.get("type") == "DELETE":
                        self._departed(event.get("prev_kv") or {})
                    self._revision += 1
                    self._cond.notify_all()
        except Exception as exc:  # the stream broke (etcd restarted, say): watch again later
            logger.warning("etcd watch of %s ended: %s", self.address, exc)
        with self._cond:
            self._cancel = None
            self._revision += 1  # wake the watchers: they read the prefix afresh
            self._cond.notify_all()

    def _departed(self, prev: dict) -> None:
        try:
            member = verify(base64.b64decode(prev.get("value", "")), self.token)
        except (ControlError, ValueError):
            return
        self._departures.append(Departure(member.kind, member.id, member.incarnation,
                                          "lost: its etcd lease ended (no heartbeat, evicted "
                                          "or left)", self._revision + 1))

    def watch(self, after: int, timeout: float) -> Snapshot:
        self._ensure_watch()
        with self._cond:
            self._cond.wait_for(lambda: self._revision > after, timeout)
            revision, departures = self._revision, tuple(self._departures)
        return Snapshot(revision, tuple(self._members()), departures)

    def _members(self) -> list[Member]:
        loads = {meta["key"].decode()[len(LOADS):]: value for value, meta in
                 self._call(self.client.get_prefix, LOADS)}
        members = []
        for value, meta in self._call(self.client.get_prefix, MEMBERS):
            try:
                member = verify(value, self.token)
            except ControlError as exc:
                self._refused[meta["key"].decode()] = exc.reason
                logger.warning("ignored the etcd record %s: %s", meta["key"].decode(), exc)
                continue
            load = loads.get(f"{member.kind}/{member.id}")
            if load is not None:
                try:
                    member = replace(member, load=json.loads(load))
                except ValueError:
                    pass
            members.append(member)
        return members

    def report(self, server: str, incarnation: str, why: str) -> bool:
        """Evict ``server`` by revoking its lease, if it is still that incarnation."""
        for member in self._members():
            if member.kind == "server" and member.id == server:
                if member.incarnation != incarnation:
                    return False
                self._call(self.client.post, self.client.get_url("/kv/lease/revoke"),
                           json={"ID": int(incarnation)})
                logger.warning("evicted expert server %s (lease %s): %s", server, incarnation,
                               why)
                return True
        return False

    def stats(self) -> MonitorStats:
        """What this reader counts: the records it refused (each once, however often read),
        by reason, and the tier now."""
        snapshot = self.watch(-1, 0.0)
        refused = collections.Counter(self._refused.values())
        return MonitorStats(snapshot.revision, len(snapshot.servers()), len(snapshot.clients()),
                            dict(refused), 0, {})

    def session(self) -> "EtcdSession":
        return EtcdSession(self)

    def close(self) -> None:
        cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel()


class EtcdSession(MemberSession):
    def __init__(self, monitor: EtcdMonitor):
        self.monitor, self.client = monitor, monitor.client
        self._lease = None
        self._member: Member | None = None
        self._beats = 0

    def register(self, member: Member, heartbeat: float) -> Member:
        from etcd3gw.lease import Lease

        ttl = max(1, math.ceil(2 * heartbeat))
        granted = self.monitor._call(self.client.post, self.client.get_url("/lease/grant"),
                                     json={"TTL": ttl, "ID": 0})
        self._lease = Lease(int(granted["ID"]), self.client)
        self._member = replace(member, incarnation=str(self._lease.id))
        self._put(self._member)
        return self._member

    def _put(self, member: Member) -> None:
        try:
            self.monitor._call(self.client.put, _key(MEMBERS, member),
                               sign(member, self.monitor.token), lease=self._lease)
        except TransportError as exc:  # a put under an ended lease: the member is gone
            if "lease not found" in str(getattr(exc.__cause__, "detail_text", "") or ""):
                raise MemberLost(f"etcd {self.monitor.address}: lease of {member.id} "
                                 "ended") from exc
            raise

    def heartbeat(self, load: dict) -> None:
        if self._lease is None or self.monitor._call(self._lease.refresh) <= 0:
            raise MemberLost(f"etcd {self.monitor.address}: lease of {self._member.id} ended")
        self._beats += 1
        if self._beats % LOAD_EVERY == 1:
            self.monitor._call(self.client.put, _key(LOADS, self._member), json.dumps(load),
                               lease=self._lease)

    def set_status(self, status: str) -> None:
        self._member = self._member.with_status(status)
        self._put(self._member)

    def set_holdings(self, holdings: ServerHoldings) -> None:
        self._member = self._member.with_holdings(holdings)
        self._put(self._member)

    def leave(self) -> None:
        if self._lease is not None:
            self.monitor._call(self._lease.revoke)
            self._lease = None

    def close(self) -> None:
        pass
