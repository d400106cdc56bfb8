"""What a placement does to one MoE layer's load: tokens per server, max/mean, straggler time.

Tokens of an expert are split over its holders as ``ExpertRouting`` splits them: evenly over a
window of many steps, or (``whole_tokens``, one exchange's integer counts) dealt by load exactly
as the client deals them (``dealing.deal_counts``). ``copies`` models a server that holds
several physical copies of one expert (SGLang's EPLB may put two on one GPU): that server gets
that many shares of the expert's tokens and streams that many weight sets. docs/balancing.md,
"Evaluation", gives the time model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from sglang_eaas.dealing import NO_HOLDER, deal_counts, exchange_offset

LayerCopies = Mapping[str, Mapping[int, int]]  # server -> expert -> physical copies there (>= 1)


@dataclass(frozen=True)
class LayerLoad:
    """One layer under one placement: ``tokens[i]`` and ``active[i]`` (weight sets with tokens
    to stream) of server ``servers[i]``."""

    servers: tuple[str, ...]
    tokens: np.ndarray  # [S] float64
    active: np.ndarray  # [S] int64

    @property
    def max_over_mean(self) -> float:
        """Busiest server's tokens over the mean (1.0 is perfect; 1.0 when there are none)."""
        mean = float(self.tokens.mean())
        return float(self.tokens.max()) / mean if mean > 0 else 1.0

    def time(self, a: float, b: float) -> float:
        """The layer's straggler time: max over servers of ``a * tokens + b * active``."""
        return float((a * self.tokens + b * self.active).max())


def layer_load(placement: Mapping[str, Sequence[int]], load: np.ndarray,
               copies: LayerCopies | None = None, whole_tokens: bool = False) -> LayerLoad:
    """Per-server tokens of ``load`` (``[E]`` tokens per expert) under ``placement``
    (``{server: experts}``, every expert with load held somewhere).

    ``whole_tokens``: ``load`` is one exchange's integer counts (one step's, when a step is one
    exchange), dealt by load as the client deals them (``dealing``), copies as holders; a
    holder with no token streams no weights. Otherwise shares are fractional (a window of many
    steps: an expert's tokens split evenly over its copies).
    """
    load = np.asarray(load, dtype=np.float64)
    servers = tuple(placement)
    count = np.zeros((len(servers), len(load)), dtype=np.int64)  # physical copies
    for i, s in enumerate(servers):
        for e in placement[s]:
            count[i, e] = copies[s].get(e, 1) if copies and s in copies else 1
    holders = count.sum(axis=0)
    unheld = np.flatnonzero((holders == 0) & (load > 0))
    if unheld.size:
        raise ValueError(f"experts {unheld.tolist()} have load but no holder")
    if whole_tokens:
        shares, count = _dealt(count, load.astype(np.int64))
    else:
        shares = count * np.divide(load, holders, out=np.zeros_like(load), where=holders > 0)
    active = np.where(shares > 0, count, 0).sum(axis=1)
    return LayerLoad(servers, shares.sum(axis=1), active.astype(np.int64))


def _dealt(count: np.ndarray, load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``count [S, E]`` copies, ``load [E]`` one exchange's entries -> (``[S, E]`` entries each
    server takes as the client deals them, ``[S, E]`` its copies that take any)."""
    servers, experts = count.shape
    per_expert = [np.repeat(np.arange(servers), count[:, e]) for e in range(experts)]
    width = max(1, max(len(h) for h in per_expert))
    table = np.full((experts, width), NO_HOLDER, dtype=np.int64)
    for e, h in enumerate(per_expert):
        if h.size:
            table[e] = np.concatenate([h, np.full(width - h.size, h[0])])
    replicas = np.maximum(1, count.sum(axis=0))
    shares = np.zeros(count.shape, dtype=np.float64)
    used = np.zeros(count.shape, dtype=np.int64)
    single = (replicas == 1) & (load > 0)
    shares[table[single, 0], np.flatnonzero(single)] = load[single]
    used[table[single, 0], np.flatnonzero(single)] = 1
    for e, columns in deal_counts(load, table, replicas, servers,
                                  exchange_offset(load)).items():
        np.add.at(shares[:, e], table[e, columns], 1)
        took = np.unique(columns)  # the copies that take any
        np.add.at(used[:, e], table[e, took], 1)
    return shares, used


def replica_counts(placement: Mapping[str, Sequence[int]], num_experts: int) -> np.ndarray:
    """``[E]`` int64: how many servers of ``placement`` hold each expert."""
    counts = np.zeros(num_experts, dtype=np.int64)
    for experts in placement.values():
        counts[list(experts)] += 1
    return counts
