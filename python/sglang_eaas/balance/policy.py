"""When the balancer in the serving stack re-places experts, and how much at once.

Every ``period`` seconds it looks at a load estimate ``[L, E]``: ``predictive``, the forecast of
the next window from the running requests' routing (``balance/forecast.py``); ``reactive``, the
entries the expert servers computed over the last window (their counters, as
``tools.rebalance`` reads them). Both go through ``BalancePolicy.look``, so the two differ in the
estimate alone:

- too few entries in some MoE layer (``min_entries``): nothing, the estimate is noise;
- within ``cooldown`` seconds of the last re-placement: nothing, unless the mix shifted: the
  estimate's overlap with the load that re-placement planned on (``load_overlap``, the mean
  over MoE layers) is below ``shift``. The cooldown keeps one mix's noise from being chased;
  a new mix is what a re-placement is for, and one that waits out the cooldown serves the
  new mix on the old mix's placement meanwhile. Offline, one mix's requests overlap others of
  the same mix by 0.88-0.94 and of another mix by 0.45-0.75 (``scripts/bench_forecast_bound``);
  live, a forecast of a few running requests drifts to 0.71-0.77 within one mix as they turn
  over, so the threshold also ends some cooldowns on noise (docs/balancing.md);
- the estimate's busiest server over the mean (``balance/live.layer_ratios``) on the current
  placement is at most ``trigger`` in every layer: nothing, and the streak ends;
- above it: a plan (``balance/live.plan``, the scaler and placer warm from the current
  placement, the same slots per server), which must lower the worst layer by at least ``gain``.
  It is acted on only after ``settle`` more looks above the trigger, each with such a plan, and
  when the plan made ``settle`` looks earlier still holds on the newest estimate (at most
  ``trigger`` in every layer): a target that moves from look to look (a mix still changing, or
  noise) is not chased, so one shift of the traffic costs one re-placement, made once the
  estimate has settled on the new mix;
- the kept plan is cut to ``budget`` added replicas, layers with the largest gain first.

The decision is the policy's; acting on it (through the tier controller, one operation at a
time) is the caller's, which reports back with ``acted``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sglang_eaas.balance.forecast import load_overlap
from sglang_eaas.balance.live import Plan, layer_ratios, plan
from sglang_eaas.balance.placer import moves
from sglang_eaas.holdings import Holdings

MODES = ("off", "reactive", "predictive")


@dataclass(frozen=True)
class BalanceSettings:
    """``--eaas-balance*``."""

    mode: str = "off"
    period: float = 1.0  # seconds between looks
    horizon: float = 5.0  # seconds the estimate covers: ahead (forecast) or behind (counters)
    trigger: float = 1.15  # busiest server over the mean above which a layer is imbalanced
    gain: float = 0.05  # the least a plan must lower the worst layer's ratio by
    cooldown: float = 15.0  # seconds after a re-placement before the next
    shift: float = 0.8  # within the cooldown, an overlap with the last plan's load below this
    budget: int = 64  # replicas one re-placement adds at most
    min_entries: int = 256  # entries an estimate needs in every MoE layer
    settle: int = 2  # looks a plan must keep holding before it is acted on
    slots: int | None = None  # experts of one layer per server; None: as many as held now

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"the balance mode must be one of {', '.join(MODES)}, got "
                             f"{self.mode!r}")
        if min(self.period, self.horizon) <= 0 or self.trigger < 1 or self.gain < 0 \
                or self.cooldown < 0 or not 0 <= self.shift <= 1 \
                or min(self.budget, self.min_entries, self.settle) < 1 \
                or (self.slots is not None and self.slots < 1):
            raise ValueError("the balancer needs period and horizon > 0, trigger >= 1, gain "
                             ">= 0, cooldown >= 0, shift within 0-1, and budget, min_entries, "
                             "settle and slots >= 1")


@dataclass(frozen=True)
class Look:
    """One look: the worst layer's busiest/mean on the current placement and under the plan
    (None: no plan made), what was decided and why."""

    at: float
    worst: float | None
    planned: float | None
    act: bool
    why: str
    adds: int = 0


@dataclass
class BalancePolicy:
    settings: BalanceSettings
    layers: tuple[int, ...]
    last_act: float = float("-inf")
    planned_on: np.ndarray | None = field(default=None, repr=False)  # the last act's load
    _chosen: np.ndarray | None = field(default=None, repr=False)  # the plan just returned's
    _pending: list[Plan] = field(default_factory=list, repr=False)  # the streak's plans
    looks: list[Look] = field(default_factory=list, repr=False)  # the last few, for metrics

    def look(self, now: float, estimate: np.ndarray, current: Holdings, slots: int
             ) -> tuple[Look, Plan | None]:
        """The decision on ``estimate`` (``[L, E]`` entries, rows in ``layers``' order) with
        the tier holding ``current`` (the model's experts, ``live.tier_holdings``): the plan to
        apply now, or None."""
        s = self.settings
        estimate = np.asarray(estimate, dtype=np.float64)
        least = float(estimate.sum(axis=1).min()) if estimate.size else 0.0
        if least < s.min_entries:
            return self._record(Look(now, None, None, False, f"too little load ({least:.0f} "
                                     f"entries in a MoE layer, fewer than {s.min_entries})"))
        worst = max(layer_ratios(current, estimate, self.layers))
        shifted, overlap = "", self.overlap_with_last_plan(estimate)
        if now - self.last_act < s.cooldown:
            if overlap is None or overlap >= s.shift:
                return self._record(Look(now, worst, None, False, "cooldown" + (
                    "" if overlap is None else f" (overlap {overlap:.2f} with the last "
                    "re-placement's load)")))
            shifted = f"; the mix shifted (overlap {overlap:.2f} with the last plan's load)"
        if worst <= s.trigger:
            self._pending = []
            return self._record(Look(now, worst, None, False, f"balanced ({worst:.2f}x)"))
        made = plan(current, estimate, self.layers, slots)
        planned = max(made.after)
        if worst - planned < s.gain:
            self._pending = []
            return self._record(Look(now, worst, planned, False, f"no plan gains {s.gain:.2f} "
                                     f"({worst:.2f}x -> {planned:.2f}x)"))
        streak = [p for p in self._pending if p.current == current]
        self._pending = (streak + [made])[-(s.settle + 1):]
        if len(streak) < s.settle:
            return self._record(Look(now, worst, planned, False, f"imbalanced ({worst:.2f}x); "
                                     f"settling ({len(streak) + 1} of {s.settle + 1} looks)"))
        held = max(layer_ratios(self._pending[0].target, estimate, self.layers))
        if held > s.trigger:
            return self._record(Look(now, worst, planned, False, f"the plan of {s.settle} "
                                     f"looks ago gives {held:.2f}x now: the load is still "
                                     "moving"))
        chosen = within_budget(made, s.budget)
        if worst - max(chosen.after) < s.gain:  # no layer that gains fits the budget
            return self._record(Look(now, worst, max(chosen.after), False, "no plan within "
                                     f"the budget of {s.budget} added replicas gains "
                                     f"{s.gain:.2f} ({worst:.2f}x -> {planned:.2f}x needs more)"))
        adds = sum(len(m.adds) for m in chosen.moves)
        look, _ = self._record(Look(now, worst, max(chosen.after), True,
                                    f"{worst:.2f}x -> {max(chosen.after):.2f}x{shifted}", adds))
        self._chosen = estimate
        return look, chosen

    def acted(self, now: float) -> None:
        """The caller applied (or tried to apply) the plan: the cooldown starts, and the
        load it was planned on is what a shift is measured from."""
        self.last_act, self._pending = now, []
        if self._chosen is not None:
            self.planned_on, self._chosen = self._chosen, None

    def overlap_with_last_plan(self, estimate: np.ndarray) -> float | None:
        """The mean over MoE layers of ``estimate``'s overlap with the load the last
        re-placement was planned on (None before one)."""
        if self.planned_on is None:
            return None
        overlap = load_overlap(self.planned_on, estimate)
        return None if np.isnan(overlap).all() else float(np.nanmean(overlap))

    def _record(self, look: Look) -> tuple[Look, None]:
        self.looks = (self.looks + [look])[-64:]
        return look, None


def within_budget(made: Plan, budget: int) -> Plan:
    """``made`` cut to at most ``budget`` added replicas: whole layers, the largest gain
    (busiest/mean before minus after) first; the other layers keep their placement."""
    adds = {layer: sum(len(m.adds) for m in made.moves if m.layer == layer)
            for layer in made.layers}
    if sum(adds.values()) <= budget:
        return made
    gains = sorted(range(len(made.layers)), key=lambda i: made.after[i] - made.before[i])
    taken, used = set(), 0
    for i in gains:
        layer = made.layers[i]
        if made.after[i] < made.before[i] and used + adds[layer] <= budget:
            taken.add(layer)
            used += adds[layer]
    target = Holdings({server: {layer: (made.target[server][layer] if layer in taken
                                        else made.current[server].get(layer, ()))
                                for layer in set(made.current[server]) | set(
                                    made.target.get(server, {}))}
                       for server in made.current})
    after = tuple(a if layer in taken else b
                  for layer, a, b in zip(made.layers, made.after, made.before))
    return Plan(made.current, target, moves(made.current, target), made.load, made.layers,
                made.before, after)
