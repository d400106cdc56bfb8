"""The live balancer's one pass: the clients' load windows from the monitor, a placement from
the scaler and placer (or SGLang's EPLB), and the moves to get there.

Every attention client sends its last closed ``LoadWindow`` with its heartbeats
(``Member.load``); ``LoadHistory`` keeps each client's latest windows (a window is counted once,
by ``(source, first_step)``), and their sum is the load a placement is made for.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sglang_eaas.balance.eplb import eplb_placement
from sglang_eaas.balance.evaluate import layer_load
from sglang_eaas.balance.load import LoadWindow, latest_windows
from sglang_eaas.balance.placer import Move, balance_model, moves
from sglang_eaas.holdings import Holdings
from sglang_eaas.protocol.monitor import Snapshot

POLICIES = ("moeless", "eplb")


class LoadHistory:
    """The last ``keep`` windows of each client, summed on demand."""

    def __init__(self, keep: int):
        self.keep = keep
        self._windows: dict[str, collections.deque[LoadWindow]] = {}

    def take(self, snapshot: Snapshot) -> int:
        """Add the windows the snapshot's clients carry that are new; how many were."""
        new = 0
        for window in latest_windows(snapshot.clients()).values():
            seen = self._windows.setdefault(window.source, collections.deque(maxlen=self.keep))
            if not any(w.first_step == window.first_step for w in seen):
                seen.append(window)
                new += 1
        return new

    def total(self, layers: Sequence[int], num_experts: int) -> np.ndarray:
        """``[len(layers), num_experts]`` tokens over every kept window (zeros where none)."""
        out = np.zeros((len(layers), num_experts), dtype=np.int64)
        row = {layer: i for i, layer in enumerate(layers)}
        for windows in self._windows.values():
            for w in windows:
                counts = w.array()
                for i, layer in enumerate(w.layers):
                    if layer in row and counts.shape[1] == num_experts:
                        out[row[layer]] += counts[i]
        return out


@dataclass(frozen=True)
class Plan:
    """One pass's decision: the current and target placements, the moves between them, and
    each layer's busiest-server load over the mean before and after (under ``load``)."""

    current: Holdings
    target: Holdings
    moves: list[Move]
    load: np.ndarray  # [L, E]
    layers: tuple[int, ...]
    before: tuple[float, ...]
    after: tuple[float, ...]


def tier_holdings(snapshot: Snapshot) -> tuple[Holdings, int]:
    """What the serving servers hold of the model (ESFT adapter experts are not the
    balancer's), and the model's experts per layer; ``ValueError`` if the tier serves several
    models (balance one at a time) or none."""
    serving = snapshot.holdings()
    models = {(m.fingerprint, m.num_experts) for m in snapshot.servers() if m.id in serving}
    if len(models) != 1:
        raise ValueError(f"the tier must serve one model to balance, it serves {len(models)}")
    num_experts = models.pop()[1]
    return serving.model_experts(num_experts), num_experts


def plan(current: Holdings, load: np.ndarray, layers: Sequence[int], slots: int,
         policy: str = "moeless", **options) -> Plan:
    """The placement for ``load`` on the servers of ``current`` (``tier_holdings``), warm
    from it."""
    servers = sorted(current)
    if policy == "eplb":
        target = eplb_placement(load, layers, servers, slots).holdings
    else:
        target = balance_model(load, layers, servers, slots, previous=current, **options)

    return Plan(current, target, moves(current, target), load, tuple(layers),
                layer_ratios(current, load, layers, servers),
                layer_ratios(target, load, layers, servers))


def layer_ratios(holdings: Holdings, load: np.ndarray, layers: Sequence[int],
                 servers: Sequence[str] | None = None) -> tuple[float, ...]:
    """Per MoE layer (rows of ``load``), the busiest of ``servers`` (default: every server of
    ``holdings``) over the mean under ``holdings``, each expert's load split evenly over its
    holders."""
    servers = sorted(holdings) if servers is None else servers
    return tuple(layer_load(holdings.only(servers).layer(layer), load[i]).max_over_mean
                 for i, layer in enumerate(layers))


def fullest(holdings: Holdings) -> int:
    """The most experts any server holds in any MoE layer (0 for none)."""
    return max((len(ids) for layers in holdings.values() for ids in layers.values()),
               default=0)
