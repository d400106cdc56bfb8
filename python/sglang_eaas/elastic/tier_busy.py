"""The active expert servers' utilisation, from their heartbeats to the monitor (the
autoscaler's ``tier_busy``: docs/elastic.md, "Autoscaler").

Each server's heartbeat carries ``busy_us``, the microseconds it has spent serving batches
since it started; between two looks at the monitor's membership, a server's utilisation is the
growth of that counter over the time between them. The tier's is the mean over the servers
active at both looks (holding experts and serving; a server that restarted, whose counter went
back, is left out of that window).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ibgda import TransportError
from sglang_eaas.elastic.autoscaler import TierBusy
from sglang_eaas.protocol.monitor import Snapshot

logger = logging.getLogger(__name__)


class TierBusySampler:
    """Call it once per window: the utilisation since the previous call (None the first time,
    or where the monitor cannot be read)."""

    def __init__(self, snapshot: Callable[[], Snapshot], fingerprint: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.snapshot, self.fingerprint, self.clock = snapshot, fingerprint, clock
        self._busy: dict[str, int] = {}
        self._at: float | None = None

    def __call__(self) -> TierBusy | None:
        try:
            snapshot = self.snapshot()
        except (TransportError, OSError, ValueError) as exc:
            logger.debug("the expert servers' utilisation is unknown: %s", exc)
            return None
        now = self.clock()
        active = set(snapshot.active_and_standby(self.fingerprint)[0])
        busy = {m.id: int(m.load.get("busy_us", 0)) for m in snapshot.servers(self.fingerprint)
                if m.id in active}
        before, at = self._busy, self._at
        self._busy, self._at = busy, now
        if at is None or now <= at:
            return None
        shares = [(busy[s] - before[s]) / 1e6 / (now - at) for s in busy
                  if s in before and busy[s] >= before[s]]
        if not shares:
            return None
        return TierBusy(min(1.0, sum(shares) / len(shares)), len(active))
