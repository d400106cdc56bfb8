"""The planner's search: deployments simulated on the traffic, the cheapest that meets the SLO.

For every shape of the tier (layout, two-batch overlap, hot replicas, standby servers, devices
per attention instance) and every expert-server count, the fewest attention instances that meet
the SLO: galloping up the list from the fewest until one meets, then bisection between it and
the last that failed (attainment taken to grow with attention instances there; it need not
beyond: more instances run more requests at once, which can lengthen every step); every
deployment simulated on the way is a candidate of the table and the cost curve.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from sglang_eaas.plan.deployment import EP, TP, Deployment
from sglang_eaas.plan.errors import PlanInputError
from sglang_eaas.plan.load import ExpertLoad
from sglang_eaas.plan.model import ModelSpec
from sglang_eaas.plan.profile import HardwareProfile
from sglang_eaas.plan.sim import Failure, SimSettings, Simulator
from sglang_eaas.plan.traffic import Traffic


@dataclass(frozen=True)
class SLO:
    ttft: float  # seconds
    tpot: float  # seconds
    attainment: float = 0.9  # share of requests within both


def parse_slo(text: str, attainment: float) -> SLO:
    """``ttft=S,tpot=S`` (seconds; ``ms`` suffix for milliseconds)."""
    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            number = float(value[:-2]) / 1e3 if value.endswith("ms") else float(value)
        except ValueError:
            number = -1.0
        if key.strip() not in ("ttft", "tpot") or not number > 0:
            raise PlanInputError(f"--slo must be ttft=SECONDS,tpot=SECONDS (both > 0), got "
                                 f"{text!r}")
        fields[key.strip()] = number
    if set(fields) != {"ttft", "tpot"}:
        raise PlanInputError(f"--slo needs both ttft and tpot, got {text!r}")
    if not 0 < attainment <= 1:
        raise PlanInputError(f"--attainment must be in (0, 1], got {attainment:g}")
    return SLO(fields["ttft"], fields["tpot"], attainment)


@dataclass(frozen=True)
class Space:
    """What the search tries."""

    attention: tuple[int, ...]
    expert_servers: tuple[int, ...]
    hot_replicas: tuple[int, ...] = (0,)
    layouts: tuple[str, ...] = (EP,)
    standby: tuple[int, ...] = (0,)
    overlap: tuple[bool, ...] = (False, True)
    attention_gpus: tuple[int, ...] = (1,)
    max_running: int = 256


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    attainment: float
    cost_per_hour: float
    p90_ttft: float
    p90_tpot: float
    failed: int
    gpu_hours: float
    fits: bool  # its weights and KV fit the devices' memory

    def meets(self, slo: SLO) -> bool:
        return self.fits and self.attainment >= slo.attainment


def evaluate(dep: Deployment, model: ModelSpec, profile: HardwareProfile, load: ExpertLoad,
             traffic: Traffic, slo: SLO, settings: SimSettings,
             failures: tuple[Failure, ...] = ()) -> Candidate:
    sim = Simulator(dep, model, profile, load, traffic, settings, failures)
    cost = dep.gpus * profile.price_per_gpu_hour
    if sim.capacity < dep.attention or not sim.tier.memory_ok():
        return Candidate(dep, 0.0, cost, float("nan"), float("nan"), 0, 0.0, False)
    r = sim.run()
    with np.errstate(all="ignore"):
        p90 = [float(np.nanpercentile(x, 90)) if np.isfinite(x).any() else float("inf")
               for x in (r.ttft, r.tpot)]
    return Candidate(dep, r.attainment(slo.ttft, slo.tpot), cost, p90[0], p90[1], r.failed,
                     r.gpu_hours, True)


def shapes(space: Space, num_experts: int) -> list[dict]:
    """Every tier shape worth simulating (TP has no hot replicas)."""
    out = []
    for layout, overlap, hot, standby, gpus in itertools.product(
            space.layouts, space.overlap, space.hot_replicas, space.standby,
            space.attention_gpus):
        if layout == TP and hot:  # TP holds a part of every expert already
            continue
        out.append(dict(layout=layout, overlap=overlap, hot_replicas=min(hot, num_experts),
                        standby=standby, attention_gpus=gpus, max_running=space.max_running))
    return out


def search(space: Space, model: ModelSpec, profile: HardwareProfile, load: ExpertLoad,
           traffic: Traffic, slo: SLO, settings: SimSettings = SimSettings(),
           failures: tuple[Failure, ...] = (), progress: Callable[[str], None] | None = None
           ) -> list[Candidate]:
    """Every candidate simulated, in the order simulated."""
    seen: dict[Deployment, Candidate] = {}
    attention = sorted(set(space.attention))
    servers = sorted(set(space.expert_servers))
    tiers = shapes(space, model.info.num_experts)
    total = len(tiers) * len(servers)

    def run(dep: Deployment) -> Candidate:
        if dep not in seen:
            seen[dep] = evaluate(dep, model, profile, load, traffic, slo, settings, failures)
        return seen[dep]

    done = 0
    for shape in tiers:
        for s in servers:
            make = lambda a: Deployment(a, s, **shape)  # noqa: E731
            # galloping up from the fewest: attention[0], [1], [3], [7], ... until one meets
            # (more instances are not always better: each runs up to max_running requests, so
            # more of them can lengthen every step), then bisection below it
            last = len(attention) - 1
            lo, hi, step = -1, 0, 1
            while not run(make(attention[hi])).meets(slo):
                if hi == last:
                    hi = None  # none meets
                    break
                lo, hi, step = hi, min(hi + step, last), step * 2
            if hi is not None:
                while hi - lo > 1:  # attention[lo] fails (or lo = -1), attention[hi] meets
                    mid = (lo + hi) // 2
                    if run(make(attention[mid])).meets(slo):
                        hi = mid
                    else:
                        lo = mid
            done += 1
            if progress:
                best = min((c.cost_per_hour for c in seen.values() if c.meets(slo)),
                           default=None)
                progress(f"{done} of {total} tier shapes x server counts searched, "
                         f"{len(seen)} deployments simulated; the cheapest meeting the SLO so "
                         "far: " + (f"{best:.2f}/h" if best is not None else "none"))
    return list(seen.values())


def cheapest(candidates: list[Candidate], slo: SLO) -> Candidate | None:
    meeting = [c for c in candidates if c.meets(slo)]
    return min(meeting, key=lambda c: (c.cost_per_hour, -c.attainment,
                                       c.deployment.label()), default=None)


def cost_curve(candidates: list[Candidate]) -> list[tuple[float, float]]:
    """(cost per hour, the best attainment any candidate of at most that cost reaches), one
    point per cost seen."""
    points, best = [], 0.0
    for cost in sorted({c.cost_per_hour for c in candidates}):
        best = max([best] + [c.attainment for c in candidates
                             if c.cost_per_hour == cost and c.fits])
        points.append((cost, best))
    return points
