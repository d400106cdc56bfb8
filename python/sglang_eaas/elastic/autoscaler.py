"""The autoscaler's policy: SLO attainment over windows of finished requests -> scale out, in,
or hold (docs/elastic.md, "Autoscaler").

Every ``window`` seconds it judges the requests that finished in it: the **attainment** is the
share that met both targets (time to first token <= ``ttft``, time per output token <=
``tpot``), the **pressure** the larger of p90(TTFT) / ``ttft`` and p90(TPOT) / ``tpot``.

* a window **violates** when it has at least ``min_requests`` requests and its attainment is
  below ``attainment`` (ElasticMoE's trigger: persistent violation);
* a window has **slack** when its attainment is at least ``attainment`` and its pressure is at
  most ``slack`` (0.5: the p90 latencies are half the targets or less), or it had no request;
* ``patience`` windows in a row of violation ask for one more server, of slack for one fewer,
  and no two decisions come within ``cooldown`` seconds.

The expert servers' **utilisation** (the share of wall time they spent serving batches over the
window, averaged over the active servers: ``TierBusy``, from their heartbeats) gates both:

* a violation scales out only if the servers are at least ``busy_out`` busy (0.2): where they
  are idle the latency is not theirs (attention, the network, the queue), and more servers
  would not help;
* slack scales in only if the servers left would be at most ``busy_in`` busy (0.6: utilisation
  x N / (N - 1)), so that a tier that meets its targets because it is large enough stays so.

Where the utilisation is unknown (no monitor reachable, the first window) the targets alone
decide. A violation or slack held back by it is said (``held``) and counted on: it scales as
soon as the servers allow.

The gap between the two thresholds is the hysteresis: a load whose latencies, +-10% noise
included, stay between half the targets and the targets is neither (test_autoscaler).
The policy only says which way and why; the admin API turns that into a server count within
the configured bounds (launcher/admin.py), so it never needs to know the tier itself.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

OUT, IN = "out", "in"
BOUND, BUSY_OUT, BUSY_IN = "bound", "busy_out", "busy_in"  # what holds a due decision back


@dataclass(frozen=True)
class AutoscalePolicy:
    ttft: float  # seconds: target time to first token
    tpot: float  # seconds: target time per output token
    attainment: float = 0.9  # share of requests meeting both targets
    window: float = 20.0  # seconds of finished requests judged together
    patience: int = 2  # windows in a row a violation (or slack) must last
    cooldown: float = 60.0  # seconds between two decisions
    slack: float = 0.5  # scale in only with p90 latencies at most this share of the targets
    min_requests: int = 4  # a window with fewer requests cannot violate
    busy_out: float = 0.2  # scale out only with the expert servers at least this busy
    busy_in: float = 0.6  # scale in only if the servers left would be at most this busy

    def __post_init__(self) -> None:
        if not (self.ttft > 0 and self.tpot > 0 and 0 < self.attainment <= 1
                and self.window > 0 and self.patience >= 1 and self.cooldown >= 0
                and 0 < self.slack < 1 and self.min_requests >= 1
                and 0 <= self.busy_out <= 1 and 0 < self.busy_in):
            raise ValueError(f"autoscale policy out of range: {self}")


ACTS = ("resize", "publish")  # --eaas-autoscale-act


@dataclass(frozen=True)
class AutoscaleSettings:
    """``--eaas-autoscale``: the policy, the bounds of the active server count, and whether the
    admin API resizes the tier itself or only publishes the desired count."""

    policy: AutoscalePolicy
    min_servers: int = 1
    max_servers: int = 8
    act: str = "resize"  # ACTS

    def __post_init__(self) -> None:
        if not 1 <= self.min_servers <= self.max_servers or self.act not in ACTS:
            raise ValueError(f"autoscale bounds or act out of range: {self}")


@dataclass(frozen=True)
class TierBusy:
    """The active expert servers' utilisation over a window."""

    utilisation: float  # mean share of wall time serving batches
    servers: int  # active servers

    def after_one_fewer(self) -> float:
        """The utilisation with one server fewer, the same work spread over the rest."""
        return self.utilisation * self.servers / max(self.servers - 1, 1)


@dataclass(frozen=True)
class Window:
    """One judged window."""

    end: float
    requests: int
    attainment: float  # 1.0 for an empty window
    pressure: float  # max(p90 TTFT / ttft, p90 TPOT / tpot); 0.0 for an empty window
    busy: TierBusy | None = None  # the expert servers' (None: unknown)

    def violates(self, policy: AutoscalePolicy) -> bool:
        return self.requests >= policy.min_requests and self.attainment < policy.attainment

    def slack(self, policy: AutoscalePolicy) -> bool:
        return self.attainment >= policy.attainment and self.pressure <= policy.slack


@dataclass(frozen=True)
class Decision:
    at: float
    direction: str  # OUT | IN
    reason: str
    window: Window


class Autoscaler:
    """Feed it finished requests (``finished``) and call ``tick`` now and then (the two may
    come from different threads)."""

    def __init__(self, policy: AutoscalePolicy, clock: Callable[[], float] = time.monotonic,
                 tier_busy: Callable[[], TierBusy | None] = lambda: None,
                 bounds: tuple[int, int] = (1, 1 << 30)):
        """``tier_busy``: the expert servers' utilisation since its last call (None: unknown),
        asked once per window; ``bounds``: the least and most active servers (a tier known to
        be at one is not asked to pass it: that decision is held, and starts no cooldown)."""
        self.policy, self.clock, self.tier_busy = policy, clock, tier_busy
        self.bounds = bounds
        self._lock = threading.Lock()
        self._start = clock()
        self._ttft: list[float] = []
        self._tpot: list[float] = []
        self._violations = self._slack = 0
        self._last_decision_at: float | None = None
        self.last_window: Window | None = None
        self.last_decision: Decision | None = None
        self.held: str = ""  # why the last window's due decision was held back ("" if none)
        self.held_by: str = ""  # the check that held it: BOUND, BUSY_OUT, BUSY_IN ("" if none)

    def finished(self, ttft: float, tpot: float) -> None:
        """A request finished: its time to first token and time per output token (seconds)."""
        with self._lock:
            self._ttft.append(ttft)
            self._tpot.append(tpot)

    def tick(self) -> Decision | None:
        """Judge the window if it has ended; a decision when one is due."""
        now = self.clock()
        if now - self._start < self.policy.window:
            return None
        with self._lock:
            ttft, tpot = self._ttft, self._tpot
            self._start, self._ttft, self._tpot = now, [], []
        window = self._judge(now, ttft, tpot, self.tier_busy())
        self.last_window = window
        p, busy = self.policy, window.busy
        self._violations = self._violations + 1 if window.violates(p) else 0
        self._slack = self._slack + 1 if window.slack(p) else 0
        cooled = self._last_decision_at is None or now - self._last_decision_at >= p.cooldown
        decision, self.held, self.held_by = None, "", ""
        said = "" if busy is None else f"; expert servers {busy.utilisation:.0%} busy"
        if self._violations >= p.patience and cooled:
            why = (f"SLO attainment {window.attainment:.0%} < {p.attainment:.0%} for "
                   f"{self._violations} windows of {p.window:g}s (p90 at "
                   f"{window.pressure:.2f}x the targets){said}")
            if busy is not None and busy.servers >= self.bounds[1]:
                self.held_by = BOUND
                self.held = f"{why}: not scaling out, already at {self.bounds[1]} servers"
            elif busy is not None and busy.utilisation < p.busy_out:
                self.held_by = BUSY_OUT
                self.held = (f"{why}: not scaling out, the expert servers are under "
                             f"{p.busy_out:.0%} busy (the latency is not theirs)")
            else:
                decision = Decision(now, OUT, why, window)
        elif self._slack >= p.patience and cooled:
            why = (f"SLO attainment {window.attainment:.0%} with p90 latencies at "
                   f"{window.pressure:.2f}x the targets (<= {p.slack:g}x) for {self._slack} "
                   f"windows of {p.window:g}s{said}")
            if busy is not None and busy.servers <= self.bounds[0]:
                self.held_by = BOUND
                self.held = f"{why}: not scaling in, already at {self.bounds[0]} servers"
            elif busy is not None and busy.after_one_fewer() > p.busy_in:
                self.held_by = BUSY_IN
                self.held = (f"{why}: not scaling in, one server fewer would leave the others "
                             f"{busy.after_one_fewer():.0%} busy (> {p.busy_in:.0%})")
            else:
                decision = Decision(now, IN, why, window)
        if decision is not None:
            self._violations = self._slack = 0
            self._last_decision_at, self.last_decision = now, decision
        return decision

    def _judge(self, now: float, ttft: list[float], tpot: list[float],
               busy: TierBusy | None) -> Window:
        if not ttft:
            return Window(now, 0, 1.0, 0.0, busy)
        ttft, tpot = np.asarray(ttft), np.asarray(tpot)
        met = (ttft <= self.policy.ttft) & (tpot <= self.policy.tpot)
        pressure = max(float(np.percentile(ttft, 90)) / self.policy.ttft,
                       float(np.percentile(tpot, 90)) / self.policy.tpot)
        return Window(now, len(ttft), float(met.mean()), pressure, busy)
