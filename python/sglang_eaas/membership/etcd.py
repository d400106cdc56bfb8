"""The etcd monitor backend (``etcd://HOST:PORT``, etcd's v3 HTTP gateway via ``etcd3gw``).

For multi-host deployments, where the monitor must outlive any one SGLang launcher. The same
``Member`` records as the embedded monitor, kept as etcd keys:

* liveness is an etcd **lease**: a member's record lives under ``/sglang-eaas/members/KIND/ID``
  with a lease of the loss timeout (``SGLANG_EAAS_ETCD_LOSS_TIMEOUT``, else ``LOSS_TIMEOUT``;
  at least four heartbeat periods; whole seconds, etcd's unit) that every heartbeat keeps
  alive; a member whose heartbeats stop loses its record when the lease expires, and its
  incarnation *is* its lease id. A client's timeout
  report revokes the server's lease (eviction); a report or a leave first writes why under
  ``/sglang-eaas/departed/INCARNATION`` (a minute's lease), so watchers tell a heartbeat loss
  from the others (``Departure.reason``);
* suspicion (docs/fault-tolerance.md, "Suspected, then lost"): every heartbeat also writes
  ``/sglang-eaas/beats/KIND/ID`` (with its period), which each watcher follows on a watch of its
  own and times on its own clock: a member it has seen no beat of for the suspect timeout
  (``SGLANG_EAAS_ETCD_SUSPECT_TIMEOUT``, else ``SUSPECT_TIMEOUT``; at least two of its
  periods) is ``suspected`` in its snapshots, and its next beat clears it;
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
expired leases every 500 ms, so a silent member is lost within TTL + 0.5 s (a dead server sooner:
its clients see their connections to it close and report it, which revokes its lease).
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import math
import threading
import time
from dataclasses import replace
from typing import Any, Callable

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.addresses import parse_address
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.membership.base import MemberLost, MemberSession, MonitorBackend
from sglang_eaas.membership.timing import LOSS_TIMEOUT, SUSPECT_TIMEOUT
from sglang_eaas.protocol.lines import ControlError, Refused
from sglang_eaas.protocol.monitor import (
    LEFT, NO_HEARTBEAT, RESULT_TIMEOUT, Departure, Member, MonitorStats, Snapshot, sign, sign_json,
    verify, verify_json,
)
from sglang_eaas.protocol.operations import (
    PENDING, Acquired, OperationList, OperationRecord, newest_first,
)

logger = logging.getLogger(__name__)
PREFIX = "/sglang-eaas/"
MEMBERS, LOADS = PREFIX + "members/", PREFIX + "load/"
BEATS, DEPARTED = PREFIX + "beats/", PREFIX + "departed/"
DEPARTED_TTL = 60  # seconds a departure's reason is kept for the watchers
SUSPECT_TICK = 0.1  # seconds between a watcher's looks at whose beats are late
# the tier controller (protocol/operations.py): the lease's key, whose create revision is the
# lease's epoch, and one key per operation (no etcd lease: they outlive their drivers)
OPERATION_LEASE, OPERATIONS = PREFIX + "controller/lease", PREFIX + "operations/"
OPERATIONS_KEPT = 64
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


def timeouts() -> tuple[float, float]:
    """The suspect and loss timeouts over etcd (``envs.ETCD_*_TIMEOUT``, else the defaults);
    ``ValueError`` in one sentence for a bad value."""
    values = []
    for var, default in ((envs.ETCD_SUSPECT_TIMEOUT, SUSPECT_TIMEOUT),
                         (envs.ETCD_LOSS_TIMEOUT, LOSS_TIMEOUT)):
        text = var.get().strip()
        try:
            value = float(text) if text else default
        except ValueError:
            value = -1.0
        if not 0 < value <= 3600:
            raise ValueError(f"{var.name}={text!r}: seconds, more than 0 and at most 3600")
        values.append(value)
    suspect, loss = values
    if suspect > loss:
        raise ValueError(f"{envs.ETCD_SUSPECT_TIMEOUT.name} ({suspect}s) must be at most "
                         f"{envs.ETCD_LOSS_TIMEOUT.name} ({loss}s)")
    return suspect, loss


def _key(root: str, member: Member) -> str:
    return f"{root}{member.kind}/{member.id}"


class EtcdMonitor(MonitorBackend):
    def __init__(self, address: str, token: str):
        from etcd3gw.client import Etcd3Client

        self.address, self.token = "etcd://" + address, token
        host, port = parse_address(address)
        self.client = Etcd3Client(host, port, timeout=CALL_TIMEOUT)
        self.suspect_timeout, self.loss_timeout = timeouts()
        self._call(self.client.status)  # reachable, or TransportError now
        self._cond = threading.Condition()
        self._revision = 0
        self._departures: collections.deque[Departure] = collections.deque(maxlen=DEPARTURES_KEPT)
        self._cancel: Callable[[], None] | None = None
        self._refused: dict[str, str] = {}  # etcd key -> why its record was refused
        self._held = None  # (etcd Lease, epoch, operation id) of the operation lease held
        # suspicion, on this watcher's clock: "KIND/ID" -> (its last beat seen, suspected
        # after this many seconds without one); those suspected now
        self._beats: dict[str, tuple[float, float]] = {}
        self._suspected: set[str] = set()
        self._listed: dict[str, Member] = {}  # "KIND/ID" -> its record in the last snapshot
        self._beats_cancel: Callable[[], None] | None = None
        self._closed = threading.Event()
        self._ticker: threading.Thread | None = None

    def _call(self, fn: Callable, *args, **kwargs) -> Any:
        """``fn(...)``; any failure to reach etcd becomes ``TransportError``."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # etcd3gw raises requests' and its own exception types
            raise TransportError(f"etcd {self.address}: {type(exc).__name__}: {exc}") from exc

    # -- watching --------------------------------------------------------------------------
    def _ensure_watch(self) -> None:
        if self._beats_cancel is None:
            beats, self._beats_cancel = self._call(self.client.watch_prefix, BEATS)
            threading.Thread(target=self._consume_beats, args=(beats,),
                             name="eaas-etcd-beats", daemon=True).start()
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="eaas-etcd-suspicion",
                                            daemon=True)
            self._ticker.start()
        if self._cancel is not None:
            return
        events, self._cancel = self._call(self.client.watch_prefix, MEMBERS, prev_kv=True)
        threading.Thread(target=self._consume, args=(events,), name="eaas-etcd-watch",
                         daemon=True).start()

    def _consume(self, events) -> None:
        try:
            for event in events:
                departure = None
                if event.get("type") == "DELETE":
                    departure = self._departed(event.get("prev_kv") or {})
                with self._cond:
                    if departure is not None:
                        self._record_departure(replace(departure, revision=self._revision + 1))
                    self._revision += 1
                    self._cond.notify_all()
        except Exception as exc:  # the stream broke (etcd restarted, say): watch again later
            logger.warning("etcd watch of %s ended: %s", self.address, exc)
        with self._cond:
            self._cancel = None
            self._revision += 1  # wake the watchers: they read the prefix afresh
            self._cond.notify_all()

    def _record_departure(self, departure: Departure) -> Departure:
        """Under the lock: ``departure`` kept for the snapshots, once per incarnation (a watch
        event and ``_vanished`` may both find it), and its member no longer timed. Returns the
        one kept (the first found)."""
        for kept in self._departures:
            if kept.id == departure.id and kept.incarnation == departure.incarnation:
                return kept
        self._departures.append(departure)
        name = f"{departure.kind}/{departure.id}"
        self._beats.pop(name, None)
        self._suspected.discard(name)
        return departure

    def _departed(self, prev: dict) -> Departure | None:
        """The departure of the member whose record ``prev`` was (a DELETE event's)."""
        try:
            member = verify(base64.b64decode(prev.get("value", "")), self.token)
        except (ControlError, ValueError):
            return None
        return self._departure_of(member)

    def _departure_of(self, member: Member) -> Departure:
        """Why ``member`` departed: what a report or a leave wrote under its incarnation, else
        its lease ended: no heartbeat."""
        why, reason = "lost: no heartbeat for its etcd lease's TTL", NO_HEARTBEAT
        try:
            rows = self._call(self.client.get, DEPARTED + member.incarnation)
            if rows:
                said = verify_json(rows[0], self.token)
                why = str(said.get("why", why))
                reason = str(said.get("reason", ""))  # "": a marker older than the field
        except (TransportError, ControlError, AttributeError):
            pass
        try:
            return Departure(member.kind, member.id, member.incarnation, why, 0, reason)
        except ControlError:  # a reason this version does not know: read from the words
            return Departure(member.kind, member.id, member.incarnation, why, 0)

    def _say_departure(self, incarnation: str, why: str, reason: str) -> None:
        """Write why ``incarnation`` is about to depart, for the watchers (a minute's lease)."""
        self._call(self.client.put, DEPARTED + incarnation,
                   sign_json({"why": why, "reason": reason}, self.token),
                   lease=self._grant(DEPARTED_TTL))

    # -- suspicion, on this watcher's clock ------------------------------------------------
    def _consume_beats(self, events) -> None:
        try:
            for event in events:
                if event.get("type") == "DELETE":
                    continue
                kv = event.get("kv") or {}  # etcd3gw decodes an event's kv (not prev_kv)
                try:
                    name = kv["key"].decode()[len(BEATS):]
                    beat = verify_json(kv["value"], self.token)
                    after = max(self.suspect_timeout, 2 * float(beat.get("period", 0)))
                except (ControlError, ValueError, TypeError, AttributeError, KeyError):
                    continue
                with self._cond:
                    self._beats[name] = (time.monotonic(), after)
                    if name in self._suspected:
                        self._suspected.discard(name)
                        self._revision += 1
                        self._cond.notify_all()
        except Exception as exc:
            logger.warning("etcd watch of %s's heartbeats ended: %s", self.address, exc)
        with self._cond:  # no beats seen meanwhile: nobody suspected for it
            self._beats_cancel = None
            self._beats = {name: (time.monotonic(), after)
                           for name, (_, after) in self._beats.items()}
            if self._suspected:
                self._suspected.clear()
                self._revision += 1
                self._cond.notify_all()

    def _tick(self) -> None:
        while not self._closed.wait(SUSPECT_TICK):
            now = time.monotonic()
            with self._cond:
                if self._beats_cancel is None:
                    continue
                late = {name: now - seen for name, (seen, after) in self._beats.items()
                        if now - seen > after and name not in self._suspected}
                if late:
                    self._suspected |= set(late)
                    self._revision += 1
                    self._cond.notify_all()
            for name, age in sorted(late.items()):
                logger.warning("%s suspected: no heartbeat seen for %.2fs",
                               name.replace("/", " ", 1), age)

    def watch(self, after: int, timeout: float) -> Snapshot:
        self._ensure_watch()
        with self._cond:
            self._cond.wait_for(lambda: self._revision > after, timeout)
            revision, departures = self._revision, tuple(self._departures)
        members = self._members()
        return Snapshot(revision, tuple(members),
                        departures + self._vanished(members, departures, revision))

    def _vanished(self, members: list[Member], departures: tuple[Departure, ...],
                  revision: int) -> tuple[Departure, ...]:
        """The departures of the members this watcher listed last time and whose records are
        gone now, where ``departures`` (what the watch stream had told before the members were
        read) does not say why: the stream may lag the read (a loaded host), have missed the
        DELETE (it broke and was opened again), or have told it between the two reads, and a
        snapshot that lacks a member must say why it left (a client keeps the last holder of
        an expert lost on heartbeats alone, and tells a leave from a loss). Each is stamped
        ``revision``, this snapshot's, where kept too, so that the next snapshot does not
        count it as new."""
        present = {f"{m.kind}/{m.id}" for m in members}
        shown = {(d.id, d.incarnation) for d in departures}
        with self._cond:
            listed, self._listed = self._listed, {f"{m.kind}/{m.id}": m for m in members}
        gone = [m for name, m in listed.items()
                if name not in present and (m.id, m.incarnation) not in shown]
        with self._cond:
            told = {(d.id, d.incarnation) for d in self._departures}
        why = {(m.id, m.incarnation): self._departure_of(m) for m in gone
               if (m.id, m.incarnation) not in told}  # etcd reads, outside the lock
        found = []
        with self._cond:
            for member in gone:
                key = (member.id, member.incarnation)
                departure = (self._record_departure(replace(why[key], revision=revision))
                             if key in why else next((d for d in self._departures
                                                      if (d.id, d.incarnation) == key), None))
                if departure is None:  # told, and since pushed out of the kept ones
                    continue
                if departure.revision > revision:  # told by the stream since ``departures``
                    self._departures.remove(departure)
                    departure = replace(departure, revision=revision)
                    self._departures.append(departure)
                found.append(departure)
        return tuple(found)

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
            name, now = f"{member.kind}/{member.id}", time.monotonic()
            with self._cond:  # one this watcher has seen no beat of yet: timed from now
                seen, _ = self._beats.setdefault(name, (now, self.suspect_timeout))
                suspected = name in self._suspected
            members.append(replace(member, suspected=suspected,
                                   beat_age=round(max(0.0, now - seen), 3)))
        return members

    def report(self, server: str, incarnation: str, why: str) -> bool:
        """Evict ``server`` by revoking its lease, if it is still that incarnation."""
        for member in self._members():
            if member.kind == "server" and member.id == server:
                if member.incarnation != incarnation:
                    return False
                self._say_departure(incarnation, f"evicted: {why}", RESULT_TIMEOUT)
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

    # -- the tier controller's lease and records ------------------------------------------
    # A transaction compares the lease key's create revision: 0 (nobody holds it) to take it,
    # the holder's epoch to record under it, so a holder whose etcd lease expired can write
    # nothing more; its operation's key stays, unfinished, for the next holder to recover.
    def _b64(self, text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    def _txn(self, compare: list, success: list, failure: list = ()) -> dict:
        return self._call(self.client.transaction, {"compare": compare, "success": success,
                                                    "failure": list(failure)})

    def _compare_lease(self, epoch: int) -> dict:
        return {"key": self._b64(OPERATION_LEASE), "result": "EQUAL", "target": "CREATE",
                "create_revision": epoch}

    def _put(self, key: str, value: bytes, lease: int | None = None) -> dict:
        put = {"key": self._b64(key), "value": base64.b64encode(value).decode()}
        if lease is not None:
            put["lease"] = lease
        return {"request_put": put}

    def _put_record(self, record: OperationRecord, lease: int | None = None) -> dict:
        return self._put(OPERATIONS + record.id, sign_json(record.to_message(), self.token),
                         lease)

    def _records(self, op_id: str = "") -> dict[str, tuple[OperationRecord, int]]:
        """Operations (by id) with their keys' mod revisions; forged or malformed keys left
        out (and counted by ``stats``)."""
        if op_id:
            rows = self._call(self.client.get, OPERATIONS + op_id, metadata=True)
        else:
            rows = self._call(self.client.get_prefix, OPERATIONS)
        out = {}
        for value, meta in rows:
            try:
                record = OperationRecord.from_message(verify_json(value, self.token))
            except ControlError as exc:
                self._refused[meta["key"].decode()] = exc.reason
                continue
            out[record.id] = (record, int(meta.get("mod_revision", 0)))
        return out

    def _lease_holder(self) -> tuple[str, int]:
        """The id of the operation holding the lease ("" when none) and the lease's epoch."""
        rows = self._call(self.client.get, OPERATION_LEASE, metadata=True)
        if not rows:
            return "", 0
        value, meta = rows[0]
        try:
            held = verify_json(value, self.token)
        except ControlError:
            return "", int(meta.get("create_revision", 0))
        return str(held.get("id", "")), int(meta.get("create_revision", 0))

    def acquire(self, operation: OperationRecord, ttl: float, reclaim: int = 0) -> Acquired:
        records = self._records()
        known = records.get(operation.id)
        if reclaim:
            return self._reclaim(operation, ttl, reclaim, known)
        if known is not None:
            if not known[0].same_request(operation):
                raise Refused(f"operation id {operation.id} was used for "
                              f"{known[0].describe()}; pick another id", "operation_id_taken")
            return Acquired(known=known[0])
        lease = self._grant(ttl)
        record = replace(operation, state=PENDING, epoch=0, started_at=time.time())
        done = self._txn([self._compare_lease(0),
                          {"key": self._b64(OPERATIONS + operation.id), "result": "EQUAL",
                           "target": "CREATE", "create_revision": 0}],
                         [self._put(OPERATION_LEASE, sign_json({"id": operation.id},
                                                               self.token), lease.id),
                          self._put_record(record)])
        if not done.get("succeeded"):
            self._call(lease.revoke)
            holder, _ = self._lease_holder()
            found = self._records(holder).get(holder) if holder else None
            if found is None:
                return Acquired(busy="another operation holds the tier's lease")
            return Acquired(busy=f"another operation holds the tier: {found[0].describe()}",
                            holder=found[0])
        epoch = int(done["header"]["revision"])
        self._held = (lease, epoch, operation.id)
        self.record(epoch, replace(record, epoch=epoch))
        unfinished = sorted((r for r, _ in records.values() if not r.final),
                            key=lambda r: (r.started_at, r.epoch))
        return Acquired(epoch=epoch, lapsed=unfinished[0] if unfinished else None)

    def _grant(self, ttl: float):
        from etcd3gw.lease import Lease

        granted = self._call(self.client.post, self.client.get_url("/lease/grant"),
                             json={"TTL": max(1, math.ceil(ttl)), "ID": 0})
        return Lease(int(granted["ID"]), self.client)

    def _reclaim(self, operation: OperationRecord, ttl: float, reclaim: int,
                 known: tuple[OperationRecord, int] | None) -> Acquired:
        """A holder whose etcd lease expired takes it again, under a new epoch, if nobody
        took it since and its operation's key is as it left it."""
        if known is None or known[0].final or known[0].epoch != reclaim:
            why = (f"operation {operation.id} was ended meanwhile: {known[0].result}"
                   if known is not None and known[0].final else "another lease was granted since")
            return Acquired(busy=f"lease of epoch {reclaim} cannot be reclaimed: {why}")
        lease = self._grant(ttl)
        done = self._txn([self._compare_lease(0),
                          {"key": self._b64(OPERATIONS + operation.id), "result": "EQUAL",
                           "target": "MOD", "mod_revision": known[1]}],
                         [self._put(OPERATION_LEASE, sign_json({"id": operation.id},
                                                               self.token), lease.id)])
        if not done.get("succeeded"):
            self._call(lease.revoke)
            return Acquired(busy=f"lease of epoch {reclaim} cannot be reclaimed: another "
                            "operation took the tier's lease")
        epoch = int(done["header"]["revision"])
        self._held = (lease, epoch, operation.id)
        self.record(epoch, replace(known[0], epoch=epoch))
        return Acquired(epoch=epoch)

    def _lost(self, epoch: int) -> Refused:
        return Refused(f"etcd {self.address}: the operation lease of epoch {epoch} is not held "
                       "(it lapsed, or another operation holds the tier)", "lease_lost")

    def renew(self, epoch: int) -> None:
        held = self._held
        if held is None or held[1] != epoch or self._call(held[0].refresh) <= 0:
            raise self._lost(epoch)

    def record(self, epoch: int, operation: OperationRecord) -> None:
        held = self._held
        release = (held is not None and held[1] == epoch and operation.id == held[2]
                   and operation.final)
        success = [self._put_record(operation)]
        if release:
            success.append({"request_delete_range": {"key": self._b64(OPERATION_LEASE)}})
        if not self._txn([self._compare_lease(epoch)], success).get("succeeded"):
            raise self._lost(epoch)
        if release:
            self._held = None
            self._call(held[0].revoke)
            self._prune()

    def _prune(self) -> None:
        """Forget the oldest ended operations past ``OPERATIONS_KEPT``."""
        ended = sorted((r for r, _ in self._records().values() if r.final),
                       key=lambda r: (r.started_at, r.epoch))
        for record in ended[:max(0, len(ended) - OPERATIONS_KEPT)]:
            self._call(self.client.delete, OPERATIONS + record.id)

    def operations(self, op_id: str = "", limit: int = 16) -> OperationList:
        holder, epoch = self._lease_holder()
        records = [r for r, _ in self._records(op_id).values()]
        return OperationList(newest_first(records, limit), holder, epoch)

    def close(self) -> None:
        self._closed.set()
        for name in ("_cancel", "_beats_cancel"):
            cancel = getattr(self, name)
            setattr(self, name, None)
            if cancel is not None:
                cancel()


class EtcdSession(MemberSession):
    def __init__(self, monitor: EtcdMonitor):
        self.monitor, self.client = monitor, monitor.client
        self._lease = None
        self._member: Member | None = None
        self._beats = 0
        self._period = 0.0  # the heartbeat period it registered with

    def register(self, member: Member, heartbeat: float) -> Member:
        self._period = heartbeat
        self._lease = self.monitor._grant(max(self.monitor.loss_timeout, 4 * heartbeat))
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
        self.monitor._call(self.client.put, _key(BEATS, self._member),
                           sign_json({"period": self._period}, self.monitor.token),
                           lease=self._lease)
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
            self.monitor._say_departure(self._member.incarnation, "left", LEFT)
            self.monitor._call(self._lease.revoke)
            self._lease = None

    def close(self) -> None:
        pass
