"""``TierController``: every change of what the expert tier holds is one operation, serialised
by the tier's operation lease in the monitor, recorded there from start to end (docs/elastic.md,
"The tier controller"; the records and the monitor's side: ``protocol/operations.py``).

A driver (the admin API, a tool, the autoscaler, the layout policy, the ESFT registrar, the
deploy command) runs its change as ``run(kind, target, body)`` (or ``start`` in the
background):

1. **acquire**: the lease is taken (``Busy`` names the operation that holds it; with ``wait``
   the call waits for it to end). An operation id given twice returns the first operation
   (``Known``) instead of starting another, so an orchestrator may retry freely.
2. **recover**: an operation whose driver died holding the lease (its lease lapsed before it
   ended) is finished or rolled back first, from what the holdings say was done
   (``controller/recovery.py``), and recorded as such.
3. **body**: the change itself, under the lease's ``Fence`` (every holdings change carries its
   epoch). It returns ``Ended`` (its result and the end state it read back from the monitor)
   or raises (``RolledBack``, anything else: failed). ``Held.progress`` records its steps.
4. **end**: the record's final state, which gives the lease back.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable

from ibgda import TransportError
from sglang_eaas.controller.end_state import read_end_state
from sglang_eaas.controller.lease import LeaseKeeper
from sglang_eaas.membership import connect
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.operations import (
    DONE, FAILED, ROLLED_BACK, RUNNING, Fence, LeaseLost, OperationList, OperationRecord,
    lease_ttl,
)

logger = logging.getLogger(__name__)
WAIT_POLL = 0.25  # seconds between tries while waiting for the lease


class Busy(RuntimeError):
    """Another operation holds the tier (``holder``, where the monitor said which)."""

    def __init__(self, sentence: str, holder: OperationRecord | None = None):
        super().__init__(sentence)
        self.holder = holder


class Known(RuntimeError):
    """The operation id names an operation asked for before (``record``): nothing started."""

    def __init__(self, record: OperationRecord):
        super().__init__(f"operation {record.id} was asked for already: {record.state}")
        self.record = record


class RolledBack(RuntimeError):
    """The operation could not reach its target and undid what it did (its message says
    what, and why); ``end``: the state it left, read back."""

    def __init__(self, sentence: str, end: dict | None = None):
        super().__init__(sentence)
        self.end = end or {}


@dataclass
class Ended:
    """What a body did, and the tier's end state as it read it back from the monitor."""

    result: str
    end: dict = field(default_factory=dict)


Body = Callable[["Held"], Ended]


def requester_name(role: str) -> str:
    """``role on HOST (pid N)``: who asks, as records and refusals name it."""
    return f"{role} on {socket.gethostname()} (pid {os.getpid()})"


class Held:
    """An operation holding the lease: its record, fence and keeper."""

    def __init__(self, controller: "TierController", backend, record: OperationRecord,
                 lapsed: list[OperationRecord]):
        self.controller, self.backend = controller, backend
        self.record, self.lapsed = record, lapsed
        self.fence = Fence(record.epoch)
        self.keeper = LeaseKeeper(backend, self.fence, controller.ttl,
                                  lambda: replace(self.record, epoch=self.fence.epoch)).start()
        self._last_progress = 0.0

    @property
    def id(self) -> str:
        return self.record.id

    def _record(self, record: OperationRecord) -> None:
        self.keeper.call(self.backend.record, self.fence.epoch, record)

    def progress(self, line: str) -> None:
        """Say ``line`` and record it as the operation's latest step (at most twice a second
        to the monitor; a failure to record it is no failure of the operation)."""
        self.controller.say(line)
        self.record = replace(self.record, state=RUNNING, progress=line[:2048],
                              epoch=self.fence.epoch)
        now = time.monotonic()
        if now - self._last_progress < 0.5:
            return
        self._last_progress = now
        try:
            self._record(self.record)
        except (TransportError, ControlError):
            pass

    def note(self, **planned) -> None:
        """Add what the operation planned to its target (keys ``_before``, ``_target``, ...:
        what recovery needs if its driver dies), recorded before the first change; raises if
        it cannot be recorded (then nothing is changed)."""
        self.record = replace(self.record, target={**self.record.target, **planned},
                              state=RUNNING, epoch=self.fence.epoch)
        self._record(self.record)

    def recover_lapsed(self) -> None:
        """Finish or roll back the operations left unfinished by lapsed leases (oldest first),
        recording each; they are the holdings' state now, whatever their drivers meant."""
        from sglang_eaas.controller.recovery import recover

        for lapsed in self.lapsed:
            self.controller.say(f"operation {lapsed.id} ({lapsed.describe()}) was left "
                                "unfinished: its driver's lease lapsed; finishing or rolling "
                                "it back first")
            try:
                state, result, end = recover(lapsed, self.controller.monitor,
                                             self.controller.token, self.fence,
                                             self.controller.say)
            except Exception as exc:  # noqa: BLE001 - recorded, never raised
                state, result, end = FAILED, f"could not be finished or rolled back: {exc}", {}
            result = (f"{result} (after its driver's lease lapsed, by operation {self.id} of "
                      f"{self.record.requester})")
            self._record(lapsed.ended(state, result, end, time.time()))
            self.controller.say(f"operation {lapsed.id}: {state}: {result}")

    def finish(self, state: str, result: str, end: dict | None = None) -> OperationRecord:
        """Record the end (which gives the lease back), with the tier's end state as the
        monitor shows it where the driver did not read it back (a failure)."""
        self.keeper.stop()
        if not end:
            try:
                end = read_end_state(self.controller.monitor, self.controller.token,
                                     self.record.target.get("fingerprint"))
            except (TransportError, ControlError, ValueError):
                end = {}
        record = self.record.ended(state, result, end, time.time())
        record = replace(record, epoch=self.fence.epoch)
        try:
            self.keeper.call(self.backend.record, self.fence.epoch, record)
        except (TransportError, ControlError) as exc:
            logger.warning("operation %s: its end could not be recorded (%s); its lease lapses "
                           "and the next operation reads the holdings", record.id, exc)
        self.record = record
        self.backend.close()
        return record

    def run(self, body: Body) -> OperationRecord:
        """Recover what lapsed, run ``body``, record the end; the final record."""
        try:
            self.recover_lapsed()
            self.record = replace(self.record, state=RUNNING, epoch=self.fence.epoch)
            self._record(self.record)
            ended = body(self)
            self.fence.check()
            state, result, end = DONE, ended.result, ended.end
        except RolledBack as exc:
            state, result, end = ROLLED_BACK, str(exc), exc.end
        except LeaseLost as exc:
            state, result, end = FAILED, f"its lease was lost: {exc}", {}
        except Exception as exc:  # noqa: BLE001 - the operation's failure, recorded
            logger.debug("operation %s failed", self.id, exc_info=True)
            state, result, end = FAILED, str(exc) or type(exc).__name__, {}
        return self.finish(state, result, end)


class TierController:
    """The tier controller's client: one per driver (its ``requester`` name)."""

    def __init__(self, monitor: str, token: str, requester: str, ttl: float | None = None,
                 say: Callable[[str], None] = logger.info):
        self.monitor, self.token, self.requester = monitor, token, requester
        self.ttl, self.say = lease_ttl() if ttl is None else ttl, say

    # -- reading ------------------------------------------------------------------------------
    def _read(self, fn: Callable[..., object], *args):
        backend = connect(self.monitor, self.token)
        try:
            return fn(backend, *args)
        finally:
            backend.close()

    def operations(self, limit: int = 16) -> OperationList:
        return self._read(lambda b: b.operations("", limit))

    def get(self, op_id: str) -> OperationRecord | None:
        found = self._read(lambda b: b.operations(op_id, 1)).operations
        return found[0] if found else None

    # -- changing -----------------------------------------------------------------------------
    def acquire(self, kind: str, target: dict, op_id: str = "", wait: float = 0.0) -> Held:
        """The lease for a new operation; ``Busy`` (after ``wait`` seconds of waiting for it),
        ``Known`` (the id was asked for before), ``TransportError`` (no monitor),
        ``Refused`` (the id names another request)."""
        record = OperationRecord(op_id or uuid.uuid4().hex[:12], kind, self.requester[:2048],
                                 dict(target))
        record.validate()
        deadline, said = time.monotonic() + wait, False
        backend = connect(self.monitor, self.token)
        try:
            while True:
                got = backend.acquire(record, self.ttl)
                if got.known is not None:
                    raise Known(got.known)
                if got.epoch:
                    break
                if time.monotonic() >= deadline:
                    hint = "" if wait else " (wait for it with --wait)"
                    raise Busy(f"{got.busy}{hint}", got.holder)
                if not said:
                    self.say(f"waiting for the tier: {got.busy}")
                    said = True
                time.sleep(WAIT_POLL)
            listed = backend.operations("", 256).operations
        except BaseException:
            backend.close()
            raise
        record = replace(record, epoch=got.epoch, started_at=time.time())
        lapsed = sorted((r for r in listed if not r.final and r.id != record.id),
                        key=lambda r: (r.started_at, r.epoch))
        return Held(self, backend, record, lapsed)

    def run(self, kind: str, target: dict, body: Body, op_id: str = "",
            wait: float = 0.0) -> OperationRecord:
        """Acquire, recover, ``body``, end: the final record (``Busy``, ``Known`` and
        ``TransportError`` from ``acquire`` propagate; nothing changed then)."""
        return self.acquire(kind, target, op_id, wait).run(body)

    def start(self, kind: str, target: dict, body: Body, op_id: str = "",
              wait: float = 0.0) -> OperationRecord:
        """``run`` with the lease taken now and the rest on a thread of its own: the pending
        record (``Busy``, ``Known`` as ``acquire``)."""
        held = self.acquire(kind, target, op_id, wait)
        threading.Thread(target=held.run, args=(body,), name=f"eaas-op-{held.id}",
                         daemon=True).start()
        return held.record

    def wait(self, op_id: str, timeout: float) -> OperationRecord | None:
        """The operation once it ended (or as it is after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.get(op_id)
            if record is None or record.final or time.monotonic() > deadline:
                return record
            time.sleep(WAIT_POLL)


