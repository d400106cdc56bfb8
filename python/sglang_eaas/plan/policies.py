"""The tier's own policies in the simulator's loop, unchanged: the autoscaler
(``elastic/autoscaler.py``), the balancer's policy (``balance/policy.py``) and the EP <-> TP
chooser (``elastic/layout_policy.py``). Each loop builds the live object with the simulator's
clock, feeds it what the live hook feeds it, acts on its decisions through the simulator's
changes of holdings, and records every call's inputs and outcome (``calls``) so that a test can
replay them into a fresh object and compare."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_eaas.balance.live import fullest
from sglang_eaas.balance.policy import BalancePolicy, BalanceSettings
from sglang_eaas.elastic.autoscaler import OUT, Autoscaler, AutoscalePolicy
from sglang_eaas.elastic.layout_cost import LayerCost
from sglang_eaas.elastic.layout_policy import LayoutChooser, LayoutPolicy, window_of
from sglang_eaas.placement import even_placement
from sglang_eaas.plan.deployment import EP
from sglang_eaas.plan.model import ModelSpec
from sglang_eaas.plan.profile import HardwareProfile
from sglang_eaas.slices import Part


@dataclass
class Call:
    """One call of a policy: when, what it was given, what it answered."""

    at: float
    kind: str  # "finished", "tick", "look", "window", "acted", "switched"
    inputs: Any
    outcome: Any = None


@dataclass
class AutoscaleLoop:
    """The autoscaler judging the simulated requests; a decision resizes the tier by one
    server within ``bounds``."""

    policy: AutoscalePolicy
    bounds: tuple[int, int]
    calls: list[Call] = field(default_factory=list)

    @property
    def period(self) -> float:
        return self.policy.window

    def attach(self, sim) -> None:
        self.sim = sim
        self.autoscaler = Autoscaler(self.policy, clock=lambda: sim.now,
                                     tier_busy=self._busy, bounds=self.bounds)

    def _busy(self):
        busy = self.sim.tier_busy()
        self.calls.append(Call(self.sim.now, "tier_busy", None, busy))
        return busy

    def finished(self, ttft: float, tpot: float) -> None:
        self.calls.append(Call(self.sim.now, "finished", (ttft, tpot)))
        self.autoscaler.finished(ttft, tpot)

    def act(self, sim) -> None:
        decision = self.autoscaler.tick()
        self.calls.append(Call(sim.now, "tick", None,
                               None if decision is None else decision.direction))
        if decision is None:
            return
        now = len(sim.tier.holdings)
        count = min(now + 1, self.bounds[1]) if decision.direction == OUT else max(
            now - 1, self.bounds[0])
        if count != now and sim.resize(count):
            sim.log.append(f"{sim.now:.1f}s: autoscaler: {decision.direction} to {count} "
                           f"servers ({decision.reason})")


@dataclass
class BalanceLoop:
    """The balancer's policy looking at the load of the last ``horizon`` seconds (the
    counters' estimate, ``reactive``); a plan is applied as one change of holdings."""

    settings: BalanceSettings
    calls: list[Call] = field(default_factory=list)

    @property
    def period(self) -> float:
        return self.settings.period

    def attach(self, sim) -> None:
        self.sim = sim
        self.policy = BalancePolicy(self.settings, sim.load.layers)

    def finished(self, ttft: float, tpot: float) -> None:
        pass

    def act(self, sim) -> None:
        if sim.tier.layout != EP or not sim.tier.covered():
            return  # a TP tier, or experts with no holder: nothing the placer can start from
        tokens, _ = sim.tokens_since(sim.now - self.settings.horizon)
        estimate = np.rint(sim.load.counts(tokens * sim.model.info.top_k)).astype(np.int64)
        current = sim.tier.holdings
        slots = self.settings.slots or max(1, fullest(current))
        look, plan = self.policy.look(sim.now, estimate, current, slots)
        self.calls.append(Call(sim.now, "look", (estimate, current, slots), look.act))
        if plan is None:
            return
        self._acted()  # as client/balance_hooks.py: acted when it decides, and again at the end
        if sim.change(plan.target, sim.settings.move_s, done=self._acted):
            sim.log.append(f"{sim.now:.1f}s: balancer: {look.why}")

    def _acted(self) -> None:
        self.calls.append(Call(self.sim.now, "acted", None))
        self.policy.acted(self.sim.now)


def profile_layer_cost(model: ModelSpec, profile: HardwareProfile, servers: int) -> LayerCost:
    """``layout_cost.LayerCost``'s constants from a profile instead of a fit: an active
    expert's weights streamed (``expert_us``), an entry's products (``width_entry_us``) and its
    hidden state over the inter-node link both ways (``entry_us``), a message's fixed cost both
    ways (``message_us``); every server a device of its own (``parallel``)."""
    dev, link = profile.device, profile.inter_node
    entry_bytes = model.info.hidden_size * model.activation_bytes
    return LayerCost(
        client_us=0.0, message_us=2e6 * link.message_s,
        entry_us=2e6 * entry_bytes / link.bandwidth,
        width_entry_us=1e6 * model.expert_flops_per_entry / dev.peak(model.info.dtype),
        expert_us=1e6 * model.expert_bytes / dev.memory_bandwidth, parallel=float(servers),
        fitted_by={"from": f"profile {profile.name}"})


@dataclass
class LayoutLoop:
    """The EP <-> TP chooser judging each window of the simulated load, kept as
    ``client/layout_hooks.py`` keeps it: a new chooser whenever the tier's servers change (the
    dwell carried over), none under 2 servers or where they cannot hold one part each; a
    decision switches the tier (EP: the planner's placement over the same servers; TP: every
    server a part of every expert)."""

    policy: LayoutPolicy
    period: float = 10.0
    calls: list[Call] = field(default_factory=list)

    def attach(self, sim) -> None:
        self.sim = sim
        self.chooser: LayoutChooser | None = None
        self._group: tuple[str, ...] = ()
        self._attempted = -float("inf")

    def finished(self, ttft: float, tpot: float) -> None:
        pass

    def _chooser(self) -> LayoutChooser | None:
        tier, info = self.sim.tier, self.sim.model.info
        group = tuple(tier.holdings)
        try:
            Part(0, len(group)).check(info.moe_intermediate_size)
        except ValueError:
            return None
        if len(group) < 2:
            return None
        if self.chooser is None or group != self._group:
            first = self.sim.load.layers[0]
            placement = ([list(tier.holdings[s].get(first, ())) for s in group]
                         if tier.layout == EP else even_placement(info.num_experts, len(group)))
            cost = profile_layer_cost(self.sim.model, self.sim.profile, len(group))
            self.chooser = LayoutChooser(self.policy, cost, info.top_k, len(group), placement,
                                         tier.layout, clock=lambda: self.sim.now)
            self.chooser.last_switch = self._attempted  # the dwell outlives a new chooser
            self._group = group
            self.calls.append(Call(self.sim.now, "chooser", (cost, len(group), placement,
                                                             tier.layout, self._attempted)))
        return self.chooser

    def act(self, sim) -> None:
        tokens, steps = sim.tokens_since(sim.now - self.period)
        chooser = self._chooser()
        if not steps or chooser is None:
            return
        counts = np.rint(sim.load.counts(tokens * sim.model.info.top_k)).astype(np.int64)
        window = window_of(counts, steps)
        decision = chooser.window(window)
        self.calls.append(Call(sim.now, "window", window,
                               None if decision is None else decision.to))
        if decision is None:
            return
        to = decision.to
        target = sim.tier.placement_as(list(sim.tier.holdings), to)
        if sim.change(target, sim.settings.switch_s, layout=to,
                      done=lambda: self._switched(to)):
            self._attempted = sim.now
            sim.log.append(f"{sim.now:.1f}s: layout: {decision.reason}")

    def _switched(self, to: str) -> None:
        self.calls.append(Call(self.sim.now, "switched", to))
        if self.chooser is not None:
            self.chooser.switched(to)
