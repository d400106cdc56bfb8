"""``OperationLog``: the TCP monitor's side of the tier controller (``protocol/operations.py``).

One lease at a time, bound to the monitor connection that took it: it lapses when that
connection closes (the driver died) or when ``renew`` stops for its ``ttl``. Its epoch is one
more than the newest this monitor knows of: the newest it granted, or, after the monitor
restarted, the newest a server registers with (``Member.epoch``) or a holder reclaims. The
operations are kept in memory, the latest ``KEPT`` of them; a restarted monitor learns the
running one again from its holder, whose keeper reclaims the lease with the record.

While a monitor that restarted waits for that (the servers' epochs say a lease was granted
before it started, and nobody reclaimed it yet), a new lease is refused for ``grace`` seconds
from its start, so a driver that comes first cannot act behind a holder that is reconnecting.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, replace

from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.operations import (
    PENDING, Acquired, OperationList, OperationRecord, newest_first,
)

logger = logging.getLogger(__name__)
KEPT = 64  # operations remembered (the running one always)


@dataclass
class _Lease:
    id: str  # the operation holding it
    epoch: int
    ttl: float
    session: object  # the monitor connection that holds it
    deadline: float


class OperationLog:
    def __init__(self, grace: float):
        self.grace, self.started = grace, time.monotonic()
        self._lock = threading.Lock()
        self.epoch = 0  # the newest granted or learned
        self._granted = 0  # the newest this monitor granted itself
        self.lease: _Lease | None = None
        self.records: collections.OrderedDict[str, OperationRecord] = collections.OrderedDict()

    # -- the lease ----------------------------------------------------------------------------
    def acquire(self, operation: OperationRecord, ttl: float, reclaim: int,
                session: object) -> Acquired:
        with self._lock:
            self._expire(time.monotonic())
            known = self.records.get(operation.id)
            if reclaim:
                return self._reclaim(operation, ttl, reclaim, session, known)
            if known is not None:
                if not known.same_request(operation):
                    raise ControlError("operation_id_taken", (
                        f"operation id {operation.id} was used for {known.describe()}; pick "
                        "another id"))
                return Acquired(known=known)
            if self.lease is not None:
                holder = self.records[self.lease.id]
                return Acquired(busy=f"another operation holds the tier: {holder.describe()}",
                                holder=holder)
            waiting = self.grace - (time.monotonic() - self.started)
            if self.epoch > self._granted and waiting > 0:
                return Acquired(busy=(
                    f"the monitor restarted {time.monotonic() - self.started:.1f}s ago and the "
                    f"servers have obeyed operation epoch {self.epoch}: it waits "
                    f"{waiting:.1f}s more for that operation's driver to reclaim its lease"))
            lapsed = next((r for r in self.records.values() if not r.final), None)
            epoch = self.epoch = self._granted = self.epoch + 1
            record = replace(operation, state=PENDING, epoch=epoch, started_at=time.time())
            self._keep(record)
            self.lease = _Lease(record.id, epoch, ttl, session, time.monotonic() + ttl)
            logger.info("operation %s: %s: the lease is its, epoch %d", record.id,
                        record.requester, epoch)
            return Acquired(epoch=epoch, lapsed=lapsed)

    def _reclaim(self, operation: OperationRecord, ttl: float, reclaim: int, session: object,
                 known: OperationRecord | None) -> Acquired:
        """Under the lock: the holder of ``reclaim`` takes its lease again, if nobody was
        granted one since and its operation has not been ended by another."""
        if self.lease is not None and self.lease.epoch != reclaim:
            holder = self.records[self.lease.id]
            return Acquired(busy=f"the lease was taken by {holder.describe()}", holder=holder)
        if reclaim < self.epoch or (known is not None and (known.final or known.epoch != reclaim)):
            why = (f"operation {known.id} was ended meanwhile: {known.result}" if known is not
                   None and known.final else f"a lease of epoch {self.epoch} was granted since")
            return Acquired(busy=f"lease of epoch {reclaim} cannot be reclaimed: {why}")
        self.epoch = self._granted = reclaim
        record = known if known is not None else operation
        self._keep(record)
        self.lease = _Lease(record.id, reclaim, ttl, session, time.monotonic() + ttl)
        logger.info("operation %s: %s reclaimed its lease (epoch %d)", record.id,
                    record.requester, reclaim)
        return Acquired(epoch=reclaim)

    def renew(self, epoch: int, session: object) -> None:
        with self._lock:
            lease = self._held(epoch, session)
            lease.deadline = time.monotonic() + lease.ttl

    def _held(self, epoch: int, session: object) -> _Lease:
        """Under the lock: the lease, if ``session`` holds it under ``epoch``."""
        self._expire(time.monotonic())
        lease = self.lease
        if lease is None or lease.epoch != epoch or lease.session is not session:
            raise ControlError("lease_lost", f"the operation lease of epoch {epoch} is not held "
                               "(it lapsed, or another operation holds the tier)")
        return lease

    def record(self, epoch: int, operation: OperationRecord, session: object) -> None:
        """The holder's progress or end, or the end of a lapsed operation it recovered."""
        with self._lock:
            lease = self._held(epoch, session)
            own = operation.id == lease.id
            known = self.records.get(operation.id)
            if not own and (known is None or known.final):
                raise ControlError("bad_field", f"operation {operation.id} is neither this "
                                   "lease's nor one left unfinished by a lapsed lease")
            if own and operation.epoch != epoch:
                raise ControlError("bad_field", f"operation {operation.id} runs under epoch "
                                   f"{epoch}, not {operation.epoch}")
            self._keep(operation)
            if own and operation.final:
                self.lease = None
                logger.info("operation %s %s: %s", operation.id, operation.state,
                            operation.result)

    def learn_epoch(self, epoch: int) -> None:
        """A server registered having obeyed ``epoch``: no lease older than it is granted."""
        with self._lock:
            if epoch > self.epoch:
                self.epoch = epoch

    def session_closed(self, session: object) -> None:
        with self._lock:
            if self.lease is not None and self.lease.session is session:
                self._lapse("its driver's monitor connection closed")

    def expire(self) -> None:
        with self._lock:
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        if self.lease is not None and now > self.lease.deadline:
            self._lapse(f"not renewed for {self.lease.ttl:.1f}s")

    def _lapse(self, why: str) -> None:
        lease, self.lease = self.lease, None
        logger.warning("operation %s: its lease (epoch %d) lapsed: %s; the next operation "
                       "finishes or rolls it back", lease.id, lease.epoch, why)

    # -- records ------------------------------------------------------------------------------
    def _keep(self, record: OperationRecord) -> None:
        self.records.pop(record.id, None)
        self.records[record.id] = record
        running = self.lease.id if self.lease is not None else record.id
        for old in [k for k, r in self.records.items() if r.final and k != running]:
            if len(self.records) <= KEPT:
                break
            del self.records[old]

    def list(self, op_id: str, limit: int) -> OperationList:
        with self._lock:
            self._expire(time.monotonic())
            holder = self.lease.id if self.lease is not None else ""
            if op_id:
                found = self.records.get(op_id)
                records = (found,) if found is not None else ()
            else:
                records = newest_first(self.records.values(), limit)
            return OperationList(records, holder, self.epoch)

