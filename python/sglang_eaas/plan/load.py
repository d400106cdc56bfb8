"""Per-expert load: for every simulated MoE layer, the share of its entries each expert gets,
from a load dump (``--eaas-load-dump``: ``balance/load.py``'s JSON lines of ``LoadWindow``) or a
Zipf law of exponent ``s`` with the ranks shuffled per layer (seeded)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sglang_eaas.balance.load import read_dump, total
from sglang_eaas.plan.errors import PlanInputError


@dataclass(frozen=True)
class ExpertLoad:
    """``shares[i, e]``: the share of layer ``layers[i]``'s entries that expert ``e`` gets
    (rows sum to 1)."""

    layers: tuple[int, ...]
    shares: np.ndarray  # [L, E] float64
    source: str

    @property
    def num_experts(self) -> int:
        return self.shares.shape[1]

    def subset(self, count: int) -> "ExpertLoad":
        """``count`` of the layers, spread evenly (the ones a simulation steps through)."""
        keep = pick_layers(self.layers, count)
        rows = [self.layers.index(layer) for layer in keep]
        return ExpertLoad(keep, self.shares[rows], self.source)

    def row(self, layer: int) -> np.ndarray:
        """The shares of ``layer``; the mean of the rows for a layer the source lacks."""
        if layer in self.layers:
            return self.shares[self.layers.index(layer)]
        return self.shares.mean(axis=0)

    def counts(self, entries: float) -> np.ndarray:
        """``[L, E]`` expected entries per expert when a layer has ``entries`` in all."""
        return self.shares * entries


def zipf_load(num_experts: int, layers: tuple[int, ...], s: float, seed: int = 0) -> ExpertLoad:
    """Zipf exponent ``s`` (0: uniform); the hottest expert is a different one in each layer."""
    if s < 0:
        raise PlanInputError(f"--zipf must be >= 0, got {s:g}")
    weights = 1.0 / np.arange(1, num_experts + 1) ** s
    weights /= weights.sum()
    rng = np.random.default_rng(seed)
    shares = np.stack([weights[rng.permutation(num_experts)] for _ in layers])
    return ExpertLoad(layers, shares, f"Zipf s={s:g}")


def dump_load(path: str | Path, num_experts: int, moe_layers: tuple[int, ...]) -> ExpertLoad:
    """The summed windows of a load dump; its layers must be the model's and its width the
    model's experts."""
    try:
        counts = total(read_dump(path))
        windows = next(read_dump(path))
    except OSError as exc:
        raise PlanInputError(f"--load: cannot read {path} ({exc.strerror})") from None
    except (ValueError, StopIteration) as exc:
        raise PlanInputError(f"--load: {path} holds no load window ({exc})"
                             if str(exc) else f"--load: {path} holds no load window") from None
    if counts.shape[1] != num_experts or not set(windows.layers) <= set(moe_layers):
        raise PlanInputError(f"--load: {path} counts {counts.shape[1]} experts in layers "
                             f"{windows.layers}, the model has {num_experts} in MoE layers "
                             f"{list(moe_layers)[:8]}...")
    sums = counts.sum(axis=1, keepdims=True).astype(float)
    if (sums == 0).any():
        raise PlanInputError(f"--load: {path} has a layer with no entry")
    return ExpertLoad(tuple(windows.layers), counts / sums, f"dump {Path(path).name}")


def fit_zipf(shares: np.ndarray) -> float:
    """The Zipf exponent that best fits one layer's shares (least squares of log share
    against log rank over the experts with any load)."""
    ranked = np.sort(np.asarray(shares, dtype=float))[::-1]
    ranked = ranked[ranked > 0]
    if len(ranked) < 2:
        return 0.0
    slope = np.polyfit(np.log(np.arange(1, len(ranked) + 1)), np.log(ranked), 1)[0]
    return max(0.0, float(-slope))


def pick_layers(moe_layers: tuple[int, ...], count: int) -> tuple[int, ...]:
    """``count`` MoE layers spread evenly over the model's (the simulated ones)."""
    count = max(1, min(count, len(moe_layers)))
    idx = np.linspace(0, len(moe_layers) - 1, count).round().astype(int)
    return tuple(moe_layers[i] for i in sorted(set(idx)))
