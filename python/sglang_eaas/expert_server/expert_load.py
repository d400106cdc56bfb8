"""``ExpertLoad``: what an expert server computed for each (MoE layer, expert) since it started:
tokens (top-k entries routed to the expert) and compute time in nanoseconds.

The kernel adds each layer call's entries and times straight into a ``[2, E_local]`` tensor of
the layer's current experts (``of``: ``compute.weighted_expert_sum``'s ``expert_load``), so
recording costs the serving loop no Python work per call. When the layer's experts change
(added or dropped while serving) that tensor is folded into totals by global expert id and a
new one begins. ``stats`` shows the totals per expert (``per_expert``), the heartbeat per layer
(``summary``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Iterable, NamedTuple

import numpy as np
import torch

from sglang_eaas.expert_server.experts import LayerExperts, row_experts


class _Current(NamedTuple):
    layer: weakref.ref  # the LayerExperts counted (weak: a dropped layer's weights go)
    ids: np.ndarray  # its rows' global expert ids (-1: a row no id maps to; a part: its expert)
    load: torch.Tensor  # [2, E_local] int64: entries, ns


class ExpertLoad:
    def __init__(self, moe_layers: Iterable[int], num_experts: int):
        self.num_experts = num_experts
        self._lock = threading.Lock()  # a fold against a read: nothing counted twice
        self._folded = {layer: np.zeros((2, num_experts), dtype=np.int64)
                        for layer in moe_layers}
        # (MoE layer, parts: 1 whole experts, P a layer of parts) -> the rows counted now
        self._current: dict[tuple[int, int], _Current] = {}

    def of(self, layer_id: int, layer: LayerExperts) -> torch.Tensor:
        """The ``[2, E_local]`` int64 tensor ``layer``'s calls add their load to (the serving
        loop's thread). A part's entries count for its expert (each server of a TP group
        computes its part of the same entries)."""
        key = (layer_id, layer.parts)
        current = self._current.get(key)
        if current is not None and current.layer() is layer:
            return current.load
        rows = row_experts(layer)
        fresh = _Current(weakref.ref(layer), np.where(rows >= 0, rows // layer.parts, -1),
                         torch.zeros(2, layer.w13.shape[0], dtype=torch.int64))
        with self._lock:
            if current is not None:
                self._fold(self._folded, layer_id, current)
            self._grow(layer_id, fresh.ids)
            self._current[key] = fresh
        return fresh.load

    def _fold(self, into: dict[int, np.ndarray], layer_id: int, current: _Current) -> None:
        """Under the lock: add ``current``'s load to ``into[layer_id]`` by global id (its ids
        were made room for when it began)."""
        used = current.ids >= 0
        into[layer_id][:, current.ids[used]] += current.load.numpy()[:, used]

    def _grow(self, layer_id: int, ids: np.ndarray) -> None:
        """Under the lock: room for ``ids`` (ESFT adapter experts' physical ids pass the
        model's expert count)."""
        folded = self._folded[layer_id]
        if ids.size and ids.max() >= folded.shape[1]:
            grown = np.zeros((2, int(ids.max()) + 1), dtype=np.int64)
            grown[:, :folded.shape[1]] = folded
            self._folded[layer_id] = grown

    def _totals(self) -> dict[int, np.ndarray]:
        """``{layer: [2, num_experts]}`` (entries, ns) by global expert id, now."""
        with self._lock:
            totals = {layer: folded.copy() for layer, folded in self._folded.items()}
            for (layer, _), current in self._current.items():
                self._fold(totals, layer, current)
        return totals

    def per_expert(self) -> dict[int, dict[int, tuple[int, int]]]:
        """``{layer: {expert: (tokens, ns)}}``, experts with any."""
        out = {}
        for layer, totals in self._totals().items():
            experts = np.flatnonzero(totals.any(axis=0)).tolist()
            if experts:
                out[layer] = {e: (int(totals[0, e]), int(totals[1, e])) for e in experts}
        return out

    def summary(self) -> dict[str, list[int]]:
        """``{layer: [tokens, ns, busiest expert, its ns]}`` (busiest: the most ns), layers
        with any."""
        out = {}
        for layer, totals in self._totals().items():
            if totals[0].any():
                busiest = int(totals[1].argmax())
                out[str(layer)] = [int(totals[0].sum()), int(totals[1].sum()), busiest,
                                   int(totals[1, busiest])]
        return out
