"""The cost model of one MoE layer's step under expert and tensor parallelism
(docs/switching.md, "Cost model").

An expert server answering one layer call with ``n`` entries (token, expert) over ``a`` active
experts, its rows ``w`` of an expert wide (1 whole, 1/P a part), works for

    entry_us * n + w * (width_entry_us * n + expert_us * a)

``entry_us`` is what an entry costs whatever the width (reading its token, scattering its sum);
``width_entry_us`` and ``expert_us`` scale with the width (the products; an active expert's
weights streamed once). A layer call costs the client ``client_us``, plus ``message_us`` per
server it sends to, plus the servers' work: the slowest server's, or, where the servers share
fewer cores than there are of them, their total over ``parallel`` (the servers that compute at
once on this machine):

    layer_us = client_us + message_us * m + max(max_s work_s, sum_s work_s / parallel)

EP: each server the entries of the experts it holds. TP over P servers: every server every
entry, at width 1/P. So TP wins where EP has a straggler (few tokens, a hot expert on one
server), EP where TP's per-entry cost, paid P times, dominates (many tokens). The constants are
fitted to measured layer times by ``scripts/bench_switch.py`` (``fit``), which writes them as
JSON with the command, commit and date that made them; ``DEFAULT_COST`` is that file, as
committed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

DEFAULT_COST = Path(__file__).with_name("layout_cost.json")


@dataclass(frozen=True)
class LayerCost:
    """The fitted constants (microseconds) and where they came from."""

    client_us: float
    message_us: float
    entry_us: float
    width_entry_us: float
    expert_us: float
    parallel: float = 1.0
    fitted_by: dict = field(default_factory=dict)  # command, commit, date, error of the fit

    def work_us(self, entries: float, active: float, width: float) -> float:
        """One server's work on ``entries`` over ``active`` experts at ``width``."""
        return (self.entry_us * entries
                + width * (self.width_entry_us * entries + self.expert_us * active))

    def layer_us(self, servers: Sequence[tuple[float, float]], width: float) -> float:
        """A layer call whose servers get ``(entries, active experts)`` each, rows ``width``
        wide (servers with no entry are not sent to)."""
        work = [self.work_us(n, a, width) for n, a in servers if n > 0]
        if not work:
            return self.client_us
        return (self.client_us + self.message_us * len(work)
                + max(max(work), sum(work) / self.parallel))

    def ep_us(self, counts: np.ndarray, placement: Sequence[Sequence[int]]) -> float:
        """EP: ``counts[e]`` entries of expert ``e`` in the step (fractional: a mean over
        steps), the experts held by each server in ``placement`` (an expert on several
        servers: its entries shared evenly)."""
        holders = np.zeros(len(counts))
        for experts in placement:
            holders[list(experts)] += 1
        share = np.where(holders > 0, counts / np.maximum(holders, 1), 0.0)
        return self.layer_us([(float(share[list(e)].sum()), float(_active(share[list(e)])))
                              for e in placement], 1.0)

    def tp_us(self, counts: np.ndarray, parts: int) -> float:
        """TP over ``parts`` servers: each gets every entry, at width 1/``parts``."""
        served = (float(counts.sum()), float(_active(counts)))
        return self.layer_us([served] * parts, 1.0 / parts)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_COST) -> "LayerCost":
        """From a file ``to_json`` wrote; ``ValueError`` in one sentence for anything else."""
        try:
            data = json.loads(Path(path).read_text())
            return cls(**data)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not a layer cost model written by "
                             f"scripts/bench_switch.py ({exc})") from None


def _active(counts: np.ndarray) -> float:
    """Expected active experts in a step where expert ``e`` has ``counts[e]`` entries on
    average (Poisson: active with probability 1 - exp(-count))."""
    return float(np.sum(1.0 - np.exp(-np.asarray(counts, dtype=float))))


@dataclass(frozen=True)
class Sample:
    """One measured layer call: what each server got, the width, the time."""

    servers: tuple[tuple[float, float], ...]  # (entries, active experts) per server sent to
    width: float
    measured_us: float


def fit(samples: Sequence[Sample], cores: float, fitted_by: dict | None = None) -> LayerCost:
    """The constants that best explain ``samples`` (least squares on the relative error, every
    constant >= 0, ``parallel`` in [1, ``cores``]); the fit's mean and worst relative error go
    into ``fitted_by``."""
    from scipy.optimize import least_squares  # the bench's, not the server's, dependency

    measured = np.array([s.measured_us for s in samples])

    def model(x: np.ndarray) -> np.ndarray:
        cost = LayerCost(*x)
        return np.array([cost.layer_us(s.servers, s.width) for s in samples])

    start = np.array([measured.min() / 2, 10.0, 1.0, 1.0, 10.0, min(cores, 1.5)])
    upper = [np.inf] * 5 + [max(cores, 1.0 + 1e-9)]
    found = least_squares(lambda x: (model(x) - measured) / measured, start,
                          bounds=([0.0] * 5 + [1.0], upper))
    error = np.abs(model(found.x) - measured) / measured
    return LayerCost(*[float(v) for v in found.x], fitted_by={
        **(fitted_by or {}), "samples": len(samples),
        "mean_relative_error": round(float(error.mean()), 4),
        "worst_relative_error": round(float(error.max()), 4)})


def crossover_tokens(cost: LayerCost, top_k: int, num_experts: int, parts: int,
                     placement: Sequence[Sequence[int]], skew: float = 0.0,
                     most: int = 4096) -> int | None:
    """The fewest tokens per step from which EP is predicted at least as fast as TP over
    ``parts`` (routing ``zipf_counts(skew)``); None if TP stays faster up to ``most``."""
    for tokens in (int(2 ** (i / 4)) for i in range(int(4 * math.log2(most)) + 1)):
        counts = zipf_counts(tokens * top_k, num_experts, skew)
        if cost.ep_us(counts, placement) <= cost.tp_us(counts, parts):
            return tokens
    return None


def zipf_counts(entries: float, num_experts: int, skew: float) -> np.ndarray:
    """``entries`` spread over experts with Zipf exponent ``skew`` (0: evenly), the hottest
    first."""
    weights = 1.0 / np.arange(1, num_experts + 1) ** skew
    return entries * weights / weights.sum()
