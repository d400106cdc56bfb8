"""``HeldExperts``: everything an expert server holds, owned in one place.

* ``layers``: the weights the serving loop computes with, one ``LayerExperts`` per MoE layer,
  each version in a region of the weight fabric (``store``) or in plain memory.
  A change is staged (``swap_layer``) and applied by the serving loop between two batches
  (``apply_swaps``), so a request is always computed with the rows it was checked against.
* ``part_layers``: the parts of experts it holds for tensor parallelism, one ``LayerExperts``
  of parts per MoE layer with any (``holdings.parts``; in ``part_store``'s fabric regions, so
  peers read them as they read whole rows), apart from ``layers`` and changed the same way: a
  request's header says which of the two it was routed to (``served``).
* ``holdings``: what the server says it holds (to joining clients, in ``stats``, to the
  monitor through ``announce``); it lists an expert only while its rows are in ``layers``.
* ``digests``: the model experts' weight digests it knows (held, or read for a replica).
* ``adapter_paths``: each ESFT adapter's directory (a peer copying its experts reads it).
* ``retiring``: experts dropped but still computed until no request used them for a while.

Each is replaced, never mutated in place, where another thread reads it; the changes come from
``replicas.py`` (one at a time, under its lock), the reads from the serving loop, the control
endpoint and the tier.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Mapping

import torch

from sglang_eaas.checkpoint import expert_digests
from sglang_eaas.expert_server.experts import (
    LayerExperts, load_experts, load_parts, weight_bytes,
)
from sglang_eaas.slices import Part
from sglang_eaas.expert_server.weight_store import WeightStore
from sglang_eaas.holdings import AdapterExpert, ServerHoldings
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.lines import ControlError

SWAP_TIMEOUT = 30.0  # seconds a change waits for the serving loop to take a layer's weights


class HeldExperts:
    def __init__(self, model_path: str, info: MoeModelInfo, holdings: ServerHoldings,
                 store: WeightStore,
                 announce: Callable[[ServerHoldings], None] = lambda held: None):
        """Load ``holdings``' weights from ``model_path`` into ``store`` (its dtype); ``announce``
        is told every change of what the server says it holds."""
        self.model_path, self.info, self._announce = model_path, info, announce
        self.store, self.dtype = store, store.dtype
        self.holdings = holdings
        self.digests: Mapping[int, str] = expert_digests(model_path, info,
                                                         list(holdings.experts()))
        self.adapter_paths: Mapping[str, str] = {}
        self.layers: Mapping[int, LayerExperts] = load_experts(model_path, info, dict(holdings),
                                                               self.dtype, store)
        self._part_stores: dict[int, WeightStore] = {}
        cuts = {h.parts for h in holdings.parts.values()}
        self.part_layers: Mapping[int, LayerExperts] = load_parts(
            model_path, info, holdings.parts, self.dtype,
            self.part_store(cuts.pop()) if len(cuts) == 1 else None)
        self.counters: collections.Counter[str] = collections.Counter()
        # applied by the loop between batches: (layer, False whole experts | True parts) -> rows
        self._swaps: dict[tuple[int, bool], LayerExperts | None] = {}
        self._swapped = threading.Condition()
        self._looping = False  # a serving loop applies the swaps (else a swap applies at once)
        self._retiring_lock = threading.Lock()
        self.retiring: dict[int, dict[int, float]] = {}  # layer -> expert -> last request at
        self.retiring_parts: dict[int, float] = {}  # layer -> last request of its parts at
        # (layer, expert; None: its parts) -> the grace of the drop that retired it
        self._graces: dict[tuple[int, int | None], float] = {}

    def weight_bytes(self) -> int:
        return weight_bytes(self.layers) + weight_bytes(self.part_layers)

    def part_store(self, parts: int) -> WeightStore:
        """Where layers of ``parts``-part slices live: the weight fabric's regions (peers read
        them one-sidedly, as whole experts' rows), of a part's shape."""
        store = self._part_stores.get(parts)
        if store is None:
            store = self._part_stores[parts] = WeightStore(
                self.store.transport, Part(0, parts).info(self.info), self.dtype)
        return store

    def served(self, layer: int, parts: int) -> LayerExperts | None:
        """The rows a request of ``layer`` routed in ``parts`` parts (a header's ``parts``)
        computes with: the whole experts (``parts`` <= 1), or the layer's parts when they are
        cut into that many; None where this server holds neither."""
        if parts <= 1:
            return self.layers.get(layer)
        held = self.part_layers.get(layer)
        return held if held is not None and held.parts == parts else None

    def count(self, counter: str, n: int = 1) -> None:
        """Count ``n`` more of ``counter`` (in ``stats``: replicas added, fetch fallbacks...)."""
        self.counters[counter] += n

    # -- weights: staged by a change, applied by the serving loop -----------------------------
    def swap_layer(self, layer: int, experts: LayerExperts | None, parts: bool = False) -> None:
        """Serve ``layer`` with ``experts`` (None: no rows left) from the serving loop's next
        pass on, between two batches (``parts``: its parts, ``part_layers``). Returns once
        swapped."""
        key = (layer, parts)
        with self._swapped:
            self._swaps[key] = experts
            if not self._looping:
                self._apply()
            elif not self._swapped.wait_for(lambda: key not in self._swaps,
                                            timeout=SWAP_TIMEOUT):
                raise ControlError("busy", f"the serving loop did not take MoE layer {layer}'s "
                                   f"new experts within {SWAP_TIMEOUT:.0f}s")

    def apply_swaps(self) -> None:
        """The serving loop, between batches: the staged layers replace the served ones."""
        if self._swaps:
            with self._swapped:
                self._apply()

    def serving(self, looping: bool) -> None:
        """The serving loop starts (True) or ends (False: what is staged applies now)."""
        with self._swapped:
            self._looping = looping
            if not looping:
                self._apply()

    def _apply(self) -> None:
        """Under ``_swapped``: the staged layers replace the served ones (a new dict)."""
        layers, part_layers = dict(self.layers), dict(self.part_layers)
        for (layer, parts), experts in self._swaps.items():
            into = part_layers if parts else layers
            if experts is None:
                into.pop(layer, None)
            else:
                into[layer] = experts
        self.layers, self.part_layers, self._swaps = layers, part_layers, {}
        self._swapped.notify_all()

    # -- what the server says it holds ---------------------------------------------------------
    def say_held(self, layer: int, experts: list[int],
                 adapters: Mapping[int, AdapterExpert] | None = None) -> None:
        """Say that the server holds ``experts`` in ``layer`` (of which ``adapters`` are ESFT
        adapter experts, added to those described): to joining clients, in ``stats``, and to
        the monitor (whose clients then change their tables)."""
        self.holdings = self.holdings.with_layer(layer, experts, adapters)
        self._announce(self.holdings)

    def say_parts(self, layer: int, parts: int, ids: list[int]) -> None:
        """Say that the server holds the parts ``ids`` of ``parts``-part slices in ``layer``
        (none: no parts there), as ``say_held`` says its experts."""
        self.holdings = self.holdings.with_parts(layer, parts, ids)
        self._announce(self.holdings)

    def learn_digests(self, digests: Mapping[int, str]) -> None:
        """The digests of model experts it now holds too."""
        self.digests = {**self.digests, **digests}

    def digests_of(self, experts: list[int]) -> dict[int, str]:
        """The digests of ``experts`` (from the checkpoint for those it has none of)."""
        missing = [e for e in experts if e not in self.digests]
        known = {**self.digests, **(expert_digests(self.model_path, self.info, missing)
                                    if missing else {})}
        return {e: known[e] for e in experts}

    def adapter_from(self, adapter: str, path: str) -> None:
        """``adapter``'s experts it holds are read from the directory ``path``."""
        self.adapter_paths = {**self.adapter_paths, adapter: path}

    # -- retiring: dropped, still computed until quiet ---------------------------------------
    def retire(self, layer: int, experts: list[int], grace: float) -> None:
        """``experts`` of ``layer`` were dropped: still computed until no request used them for
        ``grace`` seconds (each drop's own grace: ``quiet``)."""
        now = time.monotonic()
        with self._retiring_lock:
            self.retiring.setdefault(layer, {}).update({e: now for e in experts})
            self._graces.update({(layer, e): grace for e in experts})

    def keep(self, layer: int, experts: list[int]) -> list[int]:
        """Those of ``experts`` still retiring in ``layer``, no longer retiring (their rows are
        still loaded)."""
        with self._retiring_lock:
            back = [e for e in experts if e in self.retiring.get(layer, {})]
            for e in back:
                del self.retiring[layer][e]
                self._graces.pop((layer, e), None)
        return back

    def retire_parts(self, layer: int, grace: float) -> None:
        """``layer``'s parts were dropped: still computed until no request used them for
        ``grace`` seconds (``quiet_parts``)."""
        with self._retiring_lock:
            self.retiring_parts[layer] = time.monotonic()
            self._graces[layer, None] = grace

    def keep_parts(self, layer: int) -> bool:
        """Whether ``layer``'s parts were retiring (their rows still loaded): not any more."""
        with self._retiring_lock:
            self._graces.pop((layer, None), None)
            return self.retiring_parts.pop(layer, None) is not None

    def used(self, layer: int, ids: torch.Tensor, parts: int = 1) -> None:
        """The serving loop saw a request of ``layer`` with ``ids`` (routed in ``parts``
        parts): a retiring expert among them, or the layer's retiring parts, is not quiet
        yet."""
        if parts > 1:
            if layer in self.retiring_parts:
                with self._retiring_lock:
                    if layer in self.retiring_parts:
                        self.retiring_parts[layer] = time.monotonic()
            return
        retiring = self.retiring.get(layer)
        if retiring:
            present = set(torch.unique(ids).tolist())
            now = time.monotonic()
            with self._retiring_lock:
                for e in list(retiring):
                    if e in present:
                        retiring[e] = now

    def quiet(self) -> tuple[dict[int, list[int]], bool]:
        """The retiring experts no request used for their drop's grace, per layer, no longer
        retiring (their rows are the caller's to free); and whether none is left retiring."""
        with self._retiring_lock:
            now = time.monotonic()
            quiet = {layer: [e for e, at in experts.items()
                             if now - at >= self._graces.get((layer, e), 0.0)]
                     for layer, experts in self.retiring.items()}
            quiet = {layer: ids for layer, ids in quiet.items() if ids}
            for layer, ids in quiet.items():
                for e in ids:
                    del self.retiring[layer][e]
                    self._graces.pop((layer, e), None)
            self.retiring = {k: v for k, v in self.retiring.items() if v}
            return quiet, not self.retiring

    def retiring_count(self) -> int:
        """Dropped experts, and layers of parts, whose rows are still held."""
        with self._retiring_lock:
            return sum(map(len, self.retiring.values())) + len(self.retiring_parts)

    def quiet_parts(self) -> tuple[list[int], bool]:
        """The layers whose retiring parts no request used for their drop's grace, no longer
        retiring (their rows are the caller's to free); and whether none is left retiring."""
        with self._retiring_lock:
            now = time.monotonic()
            quiet = [layer for layer, at in self.retiring_parts.items()
                     if now - at >= self._graces.get((layer, None), 0.0)]
            for layer in quiet:
                del self.retiring_parts[layer]
                self._graces.pop((layer, None), None)
            return quiet, not self.retiring_parts
