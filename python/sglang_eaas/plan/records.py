"""The simulator's records at its boundary: what it is given (``SimSettings``, ``Failure``s,
``Controller``s: ``policies.py``'s loops) and what it returns (``Result``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from sglang_eaas.plan.deployment import Deployment

if TYPE_CHECKING:
    from sglang_eaas.plan.sim import Simulator


@dataclass(frozen=True)
class Failure:
    """At ``at`` seconds: ``servers`` expert servers lost (the first ones of the tier; with
    ``node``, every server on the first server's node), or with ``monitor`` > 0 the monitor
    out for that many seconds (no change of holdings can happen; serving goes on)."""

    at: float
    servers: int = 1
    node: bool = False
    monitor: float = 0.0


@dataclass(frozen=True)
class SimSettings:
    join_s: float = 30.0  # a standby server filled from its peers, in service after this
    cold_s: float = 120.0  # a new device (no standby left) in service after this
    move_s: float = 5.0  # a re-placement's moves take this long
    switch_s: float = 10.0  # an EP <-> TP switch takes this long
    timeout_s: float = 60.0  # a request stalled this long after the stall began fails
    until: float | None = None  # stop at this time (default: when every request is done)
    bucket: float = 0.01  # step costs are cached per token count rounded to this share (0: exact)


class Controller(Protocol):
    period: float

    def attach(self, sim: "Simulator") -> None: ...
    def act(self, sim: "Simulator") -> None: ...
    def finished(self, ttft: float, tpot: float) -> None: ...


@dataclass
class Result:
    deployment: Deployment
    ttft: np.ndarray  # [N] seconds (nan: not served)
    tpot: np.ndarray  # [N] seconds (nan: not served; 0 for one output token)
    failed: int
    gpu_seconds: float
    end: float
    steps: int
    log: list[str] = field(default_factory=list)
    paid: list[tuple[float, int]] = field(default_factory=list)  # (from, devices) changes
    done_at: np.ndarray | None = None  # [N] when each request finished (nan: it did not)

    @property
    def last_done(self) -> float:
        """When the last request that finished did (0 for none)."""
        done = self.done_at[np.isfinite(self.done_at)] if self.done_at is not None else []
        return float(done.max()) if len(done) else 0.0

    def attainment(self, ttft: float, tpot: float) -> float:
        """Share of all requests served within both targets (failed and unserved: missed)."""
        if not len(self.ttft):
            return 1.0
        with np.errstate(invalid="ignore"):
            met = (self.ttft <= ttft) & (self.tpot <= tpot)
        return float(met.mean())

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600

    def gpu_hours_until(self, t: float) -> float:
        """Device-hours paid from the start until ``t``."""
        ends = [at for at, _ in self.paid[1:]] + [max(t, self.end)]
        return sum(n * max(min(end, t) - at, 0.0)
                   for (at, n), end in zip(self.paid, ends)) / 3600
