"""When to switch the expert tier between EP and TP (``--eaas-layout auto``; docs/switching.md,
"Policy").

Each load window (the client's counts of entries per expert and MoE layer over some steps)
gives the mean entries per expert per step; the cost model (``layout_cost.py``) predicts a
step's MoE time, summed over the layers, in EP (the placement the tier has, or would get back)
and in TP over the group. The predicted **gain** of the other layout is the share of the
current one's time it would save.

* a window **favours** the other layout when its gain is at least ``margin`` (0.1);
* ``patience`` windows in a row that favour it (2) ask for a switch, and no two switches come
  within ``dwell`` seconds (30) of each other.

The margin is the hysteresis: a load whose predicted times, +-10% noise included, stay within
``margin`` of each other never switches either way, and a switch back needs the other layout
to win by the margin again (test_switch_policy). The policy only says which way and why; the
scheduler hook (``client/layout_hooks.py``) makes the switch and logs it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sglang_eaas.balance.load import LoadWindow
from sglang_eaas.elastic.layout_cost import LayerCost
from sglang_eaas.elastic.switch import EP, TP

LAYOUT_MODES = (EP, TP, "auto")  # --eaas-layout


@dataclass(frozen=True)
class LayoutPolicy:
    margin: float = 0.1  # a switch needs a predicted gain of at least this share of the time
    patience: int = 2  # windows in a row that must favour the switch
    dwell: float = 30.0  # seconds at least between two switches

    def __post_init__(self) -> None:
        if not (0 < self.margin < 1 and self.patience >= 1 and self.dwell >= 0):
            raise ValueError(f"layout policy out of range: {self}")


@dataclass(frozen=True)
class LayoutSettings:
    """``--eaas-layout tp|auto``: the mode, and for ``auto`` the policy and the cost model."""

    mode: str  # "tp" or "auto"
    policy: LayoutPolicy = LayoutPolicy()
    cost: LayerCost | None = None


@dataclass(frozen=True)
class Prediction:
    """One window's predicted MoE time per step (microseconds, summed over the layers)."""

    tokens: float  # mean tokens per step
    ep_us: float
    tp_us: float

    def of(self, layout: str) -> float:
        return self.ep_us if layout == EP else self.tp_us


@dataclass(frozen=True)
class LayoutDecision:
    to: str  # EP or TP
    reason: str
    prediction: Prediction


class LayoutChooser:
    """The policy's state over windows: the layout it believes the tier is in, the streak of
    windows favouring the other, the time of the last switch."""

    def __init__(self, policy: LayoutPolicy, cost: LayerCost, top_k: int, parts: int,
                 placement: Sequence[Sequence[int]], layout: str = EP,
                 clock=time.monotonic):
        if layout not in (EP, TP):
            raise ValueError(f"a layout is {EP} or {TP}, not {layout!r}")
        self.policy, self.cost, self.top_k, self.parts = policy, cost, top_k, parts
        self.placement, self.layout, self.clock = placement, layout, clock
        self.streak, self.last_switch = 0, -float("inf")
        self.last: Prediction | None = None

    def predict(self, window: LoadWindow) -> Prediction:
        counts = window.array().astype(float) / window.steps  # [L, E] per step
        tokens = float(counts.sum(axis=1).mean()) / self.top_k if len(counts) else 0.0
        return Prediction(tokens, sum(self.cost.ep_us(row, self.placement) for row in counts),
                          sum(self.cost.tp_us(row, self.parts) for row in counts))

    def window(self, window: LoadWindow) -> LayoutDecision | None:
        """Judge one window; a decision when the switch is due (the caller makes it and then
        calls ``switched``)."""
        prediction = self.last = self.predict(window)
        other = TP if self.layout == EP else EP
        now, current = prediction.of(self.layout), prediction.of(other)
        gain = (now - current) / now if now > 0 else 0.0
        self.streak = self.streak + 1 if gain >= self.policy.margin else 0
        if (self.streak < self.policy.patience
                or self.clock() - self.last_switch < self.policy.dwell):
            return None
        return LayoutDecision(other, (
            f"{prediction.tokens:.1f} tokens per step: {other.upper()} predicted "
            f"{current / 1e3:.2f} ms of MoE per step against {self.layout.upper()}'s "
            f"{now / 1e3:.2f} ms ({gain:.0%} less, margin {self.policy.margin:.0%}) for "
            f"{self.streak} windows"), prediction)

    def switched(self, to: str) -> None:
        """The tier is in ``to`` now."""
        self.layout, self.streak, self.last_switch = to, 0, self.clock()


def window_of(counts: np.ndarray, steps: int = 1) -> LoadWindow:
    """A load window of ``counts [L, E]`` entries over ``steps`` steps (traces, tests)."""
    return LoadWindow.of("trace", 0, steps, 0.0, 0.0, range(len(counts)), counts)
