"""bench_balance's placement policies, window by window, and what each does to a trace's load.

Every policy has the same memory: ``servers`` x ``slots`` expert slots per MoE layer. The
placement for window ``t`` is decided before window ``t`` from what the policy may know then:

* ``none``: each expert once, round-robin (expert ``e`` on server ``e % N``); never changes.
* ``eplb-sglang``: SGLang's EPLB (``balance.eplb``, its own code) as SGLang runs it by default:
  a rebalance every ``eplb_period`` steps (``--eplb-rebalance-num-iterations``, default 1000) on
  the load of the steps since the last one (its recorder's buffer is that long by default),
  taking effect from the next window. Before its first rebalance it holds EPLB's placement of
  the first half's load: SGLang in steady state on the first mix, which favours it (it knows
  the first half's statistics in advance). Two physical copies of one expert on one server stay
  two, as SGLang runs them.
* ``eplb``: SGLang's EPLB on window ``t-1``'s measured load: EPLB given fresh statistics every
  window, far more often than SGLang rebalances (the strongest EPLB here).
* ``moeless``: the scaler and placer (``balance_model``, warm from window ``t-1``'s placement)
  on the same measured load as EPLB: the algorithm, not the information, differs.
* ``predicted``: the scaler and placer on the predictors' load for window ``t`` (each step's
  layer ``t`` predicted from its layer ``t-1`` router inputs: the paper's premise that a
  replica can be ready a layer ahead). Recorded traces only.
* ``oracle``: the scaler and placer on window ``t``'s actual load: the bound.

Window 0 has no past: ``eplb`` and ``moeless`` use the even placement there, and the means
leave window 0 out for every policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from sglang_eaas.balance.eplb import eplb_placement
from sglang_eaas.balance.evaluate import layer_load
from sglang_eaas.balance.placer import balance_model, moves
from sglang_eaas.holdings import Holdings

POLICIES = ("none", "eplb-sglang", "eplb", "moeless", "predicted", "oracle")
LABELS = {
    "none": "none (even)",
    "eplb-sglang": "SGLang EPLB, SGLang's cadence (every --eplb-period steps)",
    "eplb": "SGLang EPLB, window t-1",
    "moeless": "MoEless, window t-1",
    "predicted": "MoEless, predicted window t",
    "oracle": "oracle: MoEless, actual window t",
}


@dataclass(frozen=True)
class Placed:
    """One window's placement: distinct experts per (server, MoE layer), and for EPLB the
    physical copies per (server, layer, expert) where that is more than one."""

    holdings: Holdings
    copies: Optional[dict[str, dict[int, dict[int, int]]]] = None

    def layer(self, layer: int) -> tuple[dict[str, tuple[int, ...]], Optional[dict]]:
        """``evaluate.layer_load``'s ``placement`` and ``copies`` for one MoE layer."""
        held = self.holdings.layer(layer)
        copies = ({s: dict(per_layer[layer]) for s, per_layer in self.copies.items()}
                  if self.copies else None)
        return held, copies

    def physical(self, server: str, layer: int) -> list[list[int]]:
        """The server's weight sets in ``layer`` as planes: plane ``j`` holds the experts with
        more than ``j`` copies there (one plane without EPLB's doubles)."""
        held = self.holdings[server][layer]
        count = self.copies[server][layer] if self.copies else {}
        planes = [list(held)]
        while True:
            more = [e for e in held if count.get(e, 1) > len(planes)]
            if not more:
                return planes
            planes.append(more)

    def replicas(self) -> float:
        """Weight sets per MoE layer (physical copies), averaged over layers."""
        return float(np.mean([sum(len(plane) for s in self.holdings
                                  for plane in self.physical(s, layer))
                              for layer in self.holdings.layers()]))


def even(servers: Sequence[str], layers: Sequence[int], num_experts: int) -> Placed:
    return Placed(Holdings.uniform({s: [e for e in range(num_experts) if e % len(servers) == i]
                                    for i, s in enumerate(servers)}, layers))


def _eplb(load: np.ndarray, layers: Sequence[int], servers: Sequence[str],
          slots: int) -> Placed:
    found = eplb_placement(load, layers, servers, slots)
    copies = {s: {layer: {e: c for e, c in per.items() if c > 1}
                  for layer, per in by_layer.items()}
              for s, by_layer in found.copies.items()}
    return Placed(found.holdings, copies)


def eplb_every(step_loads: np.ndarray, shift: int, period: int, window: int,
               layers: Sequence[int], servers: Sequence[str], slots: int) -> list[Placed]:
    """``eplb-sglang``: a placement per window of ``window`` steps; ``step_loads [S, L, E]``.
    The rebalance at step ``k * period`` plans on steps ``(k-1) * period .. k * period`` and holds
    from the first window that starts at or after it; before step ``period``, EPLB's placement
    of steps ``0 .. shift`` (the first half)."""
    windows = len(step_loads) // window
    plans = {0: _eplb(step_loads[:shift].sum(axis=0), layers, servers, slots)}
    out: list[Placed] = []
    for t in range(windows):
        k = (t * window) // period
        if k not in plans:
            plans[k] = _eplb(step_loads[(k - 1) * period:k * period].sum(axis=0), layers,
                             servers, slots)
        out.append(plans[k])
    return out


def schedule(policy: str, actual: np.ndarray, predicted: Optional[np.ndarray],
             layers: Sequence[int], servers: Sequence[str], slots: int,
             cv_target: float) -> list[Placed]:
    """The policy's placement for each window; ``actual``/``predicted``: ``[windows, L, E]``.
    (``eplb-sglang`` needs the step loads: ``eplb_every``.)"""
    start = even(servers, layers, actual.shape[2])
    out: list[Placed] = []
    for t in range(len(actual)):
        previous = out[-1] if out else start
        if policy == "none" or (policy in ("eplb", "moeless") and t == 0):
            out.append(start)
            continue
        if policy == "eplb":
            out.append(_eplb(actual[t - 1], layers, servers, slots))
            continue
        load = {"moeless": lambda: actual[t - 1], "predicted": lambda: predicted[t],
                "oracle": lambda: actual[t]}[policy]()
        out.append(Placed(balance_model(load, layers, servers, slots,
                                        previous=previous.holdings, cv_target=cv_target)))
    return out


@dataclass
class Outcome:
    """One policy on one trace. ``ratio [windows, L]``: busiest server's tokens over the mean
    per window; ``tokens``/``active`` ``[S, L, N]``: per step the entries each server computes
    and its weight sets with entries (one step dealt by load, as the client deals it); ``adds
    [windows]``: replicas loaded to get from window ``t-1``'s placement to window ``t``'s."""

    policy: str
    placed: list[Placed]
    ratio: np.ndarray
    tokens: np.ndarray
    active: np.ndarray
    adds: np.ndarray

    def step_ratio(self) -> np.ndarray:
        """``[S, L]``: per step, the busiest server's entries over the mean."""
        mean = self.tokens.mean(axis=2)
        return np.divide(self.tokens.max(axis=2), mean, out=np.ones_like(mean), where=mean > 0)

    def modelled(self, c: float, a: float, b: float) -> np.ndarray:
        """``[S, L]``: per step and MoE layer, ``c`` + the max over servers of ``a * entries +
        b * active`` (``evaluate.LayerLoad.time`` plus a per-call constant)."""
        return c + (a * self.tokens + b * self.active).max(axis=2)


def outcome(policy: str, placed: list[Placed], actual: np.ndarray, step_loads: np.ndarray,
            layers: Sequence[int], window: int) -> Outcome:
    """``placed`` (one per window) under a trace's window loads ``actual [windows, L, E]``
    and its step loads ``step_loads [S, L, E]``."""
    n = len(placed)
    servers = list(placed[0].holdings)
    ratio = np.zeros((n, len(layers)))
    tokens = np.zeros((n * window, len(layers), len(servers)))
    active = np.zeros_like(tokens)
    adds = np.zeros(n)
    for t, p in enumerate(placed):
        for i, layer in enumerate(layers):
            held, copies = p.layer(layer)
            ratio[t, i] = layer_load(held, actual[t, i], copies).max_over_mean
            for s in range(t * window, (t + 1) * window):
                got = layer_load(held, step_loads[s, i], copies, whole_tokens=True)
                tokens[s, i], active[s, i] = got.tokens, got.active
        if t:
            adds[t] = sum(len(m.adds) for m in moves(placed[t - 1].holdings, p.holdings))
    return Outcome(policy, placed, ratio, tokens, active, adds)


def place_trace(trace, servers: Sequence[str], slots: int, window: int, eplb_period: int,
                cv_target: float, policies: Sequence[str] = POLICIES) -> dict[str, Outcome]:
    """Every policy of ``policies`` over a ``StepTrace`` (``predicted`` only where the trace has
    predictor load), in ``policies``' order."""
    actual = trace.windows(window)
    predicted = trace.windows(window, True) if trace.predicted is not None else None
    out = {}
    for policy in policies:
        if policy == "predicted" and predicted is None:
            continue
        placed = (eplb_every(trace.loads, trace.shift, eplb_period, window, trace.layers,
                             servers, slots) if policy == "eplb-sglang" else
                  schedule(policy, actual, predicted, trace.layers, servers, slots, cv_target))
        out[policy] = outcome(policy, placed, actual, trace.loads, trace.layers, window)
    return out
