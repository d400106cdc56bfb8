"""The thread that keeps a driver's operation lease alive (docs/elastic.md, "The tier
controller"), and loses its ``Fence`` (``protocol/operations.py``: the epoch the driver's
changes carry) when it cannot.

``LeaseKeeper`` renews every quarter of the lease's ttl. A renewal refused or unanswered is
followed by a reclaim (the monitor restarted and lost the lease, or it lapsed with nobody
taking it since): granted, the work goes on (under a new epoch over etcd); refused, or the
monitor unreachable for ``patience(ttl)``, the lease is lost and the fence says so.

The patience is ``UNREACHABLE`` ttls but never under ``PATIENCE_FLOOR``: a standalone monitor
that restarts is away for as long as a process start takes, which on a loaded host (or a pod
rescheduled) is many seconds whatever the ttl. Waiting longer is safe: a reclaim is granted
only where no lease was granted since, and servers refuse changes of an older epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ibgda import TransportError
from sglang_eaas.membership.base import MonitorBackend
from sglang_eaas.protocol.lines import Refused
from sglang_eaas.protocol.operations import Fence, OperationRecord

logger = logging.getLogger(__name__)
UNREACHABLE = 3  # ttls without reaching the monitor before the lease counts as lost...
PATIENCE_FLOOR = 30.0  # ...but never fewer seconds than this


def patience(ttl: float) -> float:
    """Seconds without reaching the monitor before a holder's lease counts as lost."""
    return max(UNREACHABLE * ttl, PATIENCE_FLOOR)


class LeaseKeeper:
    """Renews the lease of ``fence`` on ``backend`` (the connection that took it)."""

    def __init__(self, backend: MonitorBackend, fence: Fence, ttl: float,
                 record: Callable[[], OperationRecord]):
        """``record()``: the operation as it stands (sent again when reclaiming)."""
        self.backend, self.fence, self.ttl, self._record = backend, fence, ttl, record
        self._stop = threading.Event()
        self._lock = threading.Lock()  # a renewal and the holder's own calls, one at a time
        self._thread = threading.Thread(target=self._run, name="eaas-operation-lease",
                                        daemon=True)

    def start(self) -> "LeaseKeeper":
        self._thread.start()
        return self

    def call(self, fn: Callable, *args):
        """``fn(*args)`` on the backend, between renewals."""
        with self._lock:
            return fn(*args)

    def _run(self) -> None:
        reached = time.monotonic()
        while not self._stop.wait(self.ttl / 4):
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self.backend.renew(self.fence.epoch)
                reached = time.monotonic()
                continue
            except Refused as exc:
                why = str(exc)
            except TransportError as exc:
                why = str(exc)
            if self._reclaim(why):
                reached = time.monotonic()
            elif self.fence.lost or time.monotonic() - reached > patience(self.ttl):
                self.fence.lose(self.fence.lost or f"the monitor was unreachable for "
                                f"{patience(self.ttl):.0f}s: {why}")
                logger.warning("operation lease lost: %s", self.fence.lost)
                return

    def _reclaim(self, why: str) -> bool:
        """Take the lease again; whether it was granted (a refusal loses it for good)."""
        try:
            with self._lock:
                if self._stop.is_set():
                    return True
                got = self.backend.acquire(self._record(), self.ttl, self.fence.epoch)
        except TransportError:  # the monitor is still away: try again next period
            return False
        if got.epoch:
            logger.info("operation lease reclaimed (epoch %d) after: %s", got.epoch, why)
            self.fence.epoch = got.epoch
            return True
        self.fence.lose(f"{why}; and it could not be reclaimed: {got.busy}")
        return False

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.ttl)
