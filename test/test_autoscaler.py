"""The autoscaler's policy on synthetic latency traces (docs/elastic.md, "Autoscaler"): a
simulated tier whose latencies are proportional to load / servers, with +-10% noise, driven
second by second on a fake clock; every decision is applied to the simulated tier."""

from __future__ import annotations

import random

import pytest

from ibgda import TransportError
from sglang_eaas.elastic.autoscaler import (
    BOUND, BUSY_IN, BUSY_OUT, IN, OUT, Autoscaler, AutoscalePolicy, TierBusy,
)
from sglang_eaas.elastic.tier_busy import TierBusySampler
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.protocol.monitor import SERVER, Member, Snapshot

TTFT, TPOT = 1.0, 0.1
POLICY = AutoscalePolicy(ttft=TTFT, tpot=TPOT, window=10, patience=2, cooldown=60)


class Tier:
    """Latency / target = 0.5 * load / servers, times noise in [0.9, 1.1]."""

    def __init__(self, servers: int, seed: int = 0):
        self.servers, self.now = servers, 0.0
        self.rng = random.Random(seed)
        self.decisions: list[tuple[float, str]] = []

    def run(self, scaler: Autoscaler, seconds: int, load: float, per_second: int = 4):
        for _ in range(seconds):
            self.now += 1
            for _ in range(per_second):
                ratio = 0.5 * load / self.servers * self.rng.uniform(0.9, 1.1)
                scaler.finished(ratio * TTFT, ratio * TPOT)
            decision = scaler.tick()
            if decision is not None:
                self.decisions.append((self.now, decision.direction))
                self.servers += 1 if decision.direction == OUT else -1


def _scaler(tier: Tier) -> Autoscaler:
    return Autoscaler(POLICY, clock=lambda: tier.now)


# nominal latencies at 0.575x, 0.75x and 0.9x of the targets: with +-10% noise every one stays
# between half the targets (slack) and the targets (violation)
@pytest.mark.parametrize("load", [2.3, 3.0, 3.6])
def test_noise_between_the_thresholds_never_scales(load):
    tier = Tier(servers=2, seed=int(load * 10))
    tier.run(_scaler(tier), 1200, load)
    assert tier.decisions == []


def test_a_persistent_step_up_scales_out_once_and_a_step_down_in_once_after_the_cooldown():
    tier = Tier(servers=2)
    scaler = _scaler(tier)
    tier.run(scaler, 100, load=3)  # 0.75x the targets on 2 servers
    assert tier.decisions == []
    tier.run(scaler, 40, load=5)  # 1.25x on 2: violated; then 0.83x on 3: fine
    assert [d for _, d in tier.decisions] == [OUT] and tier.servers == 3
    out_at = tier.decisions[0][0]
    assert 100 + 2 * POLICY.window <= out_at <= 100 + 3 * POLICY.window  # patience, no more
    assert "attainment 0% < 90%" in scaler.last_decision.reason
    tier.run(scaler, 30, load=2.4)  # 0.4x on 3 servers: slack, but within the cooldown
    assert len(tier.decisions) == 1
    tier.run(scaler, 400, load=2.4)  # one server fewer: 0.6x on 2, no longer slack
    assert [d for _, d in tier.decisions] == [OUT, IN] and tier.servers == 2
    assert tier.decisions[1][0] - out_at >= POLICY.cooldown
    assert "p90 latencies at 0.4" in scaler.last_decision.reason


def test_a_short_spike_and_a_quiet_tier():
    tier = Tier(servers=2)
    scaler = _scaler(tier)
    tier.run(scaler, 100, load=3)
    tier.run(scaler, POLICY.window, load=8)  # one violated window: not persistent
    tier.run(scaler, 100, load=3)
    assert tier.decisions == []
    tier.run(scaler, 60, load=0, per_second=0)  # no requests at all: slack
    assert [d for _, d in tier.decisions] == [IN]
    assert scaler.last_window.requests == 0


def test_the_servers_utilisation_gates_both_ways():
    """A violation while the expert servers are nearly idle is not theirs: held (said), and
    counted on, so it scales out the moment they are busy; slack that one server fewer would
    turn into overload is held too, and scales in once the rest would stay under busy_in."""
    tier = Tier(servers=2)
    busy = [TierBusy(0.1, 2)]
    scaler = Autoscaler(POLICY, clock=lambda: tier.now, tier_busy=lambda: busy[0])
    tier.run(scaler, 60, load=5)  # violated for 6 windows, the servers 10% busy
    assert tier.decisions == [] and "not scaling out" in scaler.held
    assert scaler.held_by == BUSY_OUT
    busy[0] = TierBusy(0.5, 2)
    tier.run(scaler, POLICY.window, load=5)  # busy now: out at once (patience already spent)
    assert [d for _, d in tier.decisions] == [OUT] and tier.servers == 3
    assert "expert servers 50% busy" in scaler.last_decision.reason

    tier = Tier(servers=2)
    busy = [TierBusy(0.5, 2)]  # one server fewer: 100% busy
    scaler = Autoscaler(POLICY, clock=lambda: tier.now, tier_busy=lambda: busy[0])
    tier.run(scaler, 100, load=1)  # 0.25x the targets: slack
    assert tier.decisions == [] and "not scaling in" in scaler.held and "100%" in scaler.held
    assert scaler.held_by == BUSY_IN
    busy[0] = TierBusy(0.25, 2)  # one fewer: 50%
    tier.run(scaler, POLICY.window, load=1)
    assert [d for _, d in tier.decisions] == [IN] and scaler.held == scaler.held_by == ""


def test_a_tier_at_its_bounds_is_not_asked_past_them():
    """At the least servers, slack decides nothing (and starts no cooldown): a violation
    right after still scales out at once; at the most, a violation is held."""
    tier = Tier(servers=2)
    busy = [TierBusy(0.5, 2)]
    scaler = Autoscaler(POLICY, clock=lambda: tier.now, tier_busy=lambda: busy[0],
                        bounds=(2, 3))
    tier.run(scaler, 60, load=0, per_second=0)
    assert tier.decisions == [] and "already at 2 servers" in scaler.held
    assert scaler.held_by == BOUND
    tier.run(scaler, 2 * POLICY.window, load=5)
    assert [d for _, d in tier.decisions] == [OUT]
    busy[0] = TierBusy(0.9, 3)
    tier.run(scaler, POLICY.cooldown + 3 * POLICY.window, load=9)  # 1.5x on 3: violated
    assert [d for _, d in tier.decisions] == [OUT] and "already at 3 servers" in scaler.held


def test_the_utilisation_comes_from_the_servers_heartbeats():
    def member(address, busy_us, held=(0,)):
        return Member(SERVER, address, "h", 1, holdings=ServerHoldings({0: list(held)}),
                      load={"busy_us": busy_us})

    now = [0.0]
    snapshots = [Snapshot(1, (member("a", 0), member("b", 0), member("s", 0, held=()))),
                 Snapshot(2, (member("a", 2_000_000), member("b", 6_000_000),
                              member("s", 0, held=()))),  # s: standby, not counted
                 Snapshot(3, (member("a", 1_000), member("b", 8_000_000)))]  # a restarted
    sampler = TierBusySampler(lambda: snapshots.pop(0), clock=lambda: now[0])
    assert sampler() is None  # nothing to compare with yet
    now[0] = 10.0
    assert sampler() == TierBusy(0.4, 2)  # (0.2 + 0.6) / 2
    now[0] = 20.0
    assert sampler() == TierBusy(0.2, 2)  # only b: a's counter went back

    def unreachable():
        raise TransportError("monitor 127.0.0.1:1 is unreachable")

    assert TierBusySampler(unreachable)() is None


def test_bad_policies_are_refused():
    for bad in (dict(ttft=0), dict(attainment=1.5), dict(slack=1.0), dict(patience=0)):
        with pytest.raises(ValueError, match="out of range"):
            AutoscalePolicy(**{"ttft": 1.0, "tpot": 0.1, **bad})
