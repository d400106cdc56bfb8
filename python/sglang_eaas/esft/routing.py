"""``AdapterRouting``: an attention rank's ESFT rerouting state, read by every MoE layer.

ESFT adapters replace a few routed experts per layer; their experts live on the expert servers
under *physical* ids past the model's own (``[E, E + slots)`` per layer, see
``esft/registrar.py``). The router still picks base-model ids, so before dispatch each token's
ids are rewritten by its request's adapter (ExpertWeave's batched rerouting):

    ids' = where(aid < 0, ids, Pi[layer][aid, ids])

* ``Pi[layer]``: ``[rows, E]`` int32, one row per loaded adapter (the row it was given at load),
  ``Pi[l][a, e]`` the physical id of adapter ``a``'s version of expert ``e`` (``e`` itself where
  the adapter keeps the base expert). Changed only between steps (load and unload run there).
* ``aid``: ``[T]`` int32, the adapter row of each token of the step (-1: the base model), set
  from SGLang's batch by ``EsftManager.prepare_lora_batch`` before the model runs.

Router weights are untouched. The rewrite is ``sgl_kernel_ext.esft_reroute.reroute``: a fused
Triton kernel on a GPU, one C++ pass on the CPU.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

AdapterMap = Mapping[int, Mapping[int, int]]  # MoE layer -> base expert -> physical id


class AdapterRouting:
    def __init__(self, moe_layers: Iterable[int], num_experts: int):
        self.num_experts = num_experts
        self.layers = tuple(moe_layers)
        self._identity = torch.arange(num_experts, dtype=torch.int32)
        self.maps: dict[int, torch.Tensor] = {
            layer: torch.empty(0, num_experts, dtype=torch.int32) for layer in self.layers}
        self.rows = 0  # adapter rows allocated (some may be free)
        self.aid: torch.Tensor | None = None  # this step's adapter row per token; None: base

    def set_adapter(self, row: int, mapping: AdapterMap) -> None:
        """Adapter row ``row`` reroutes as ``mapping`` (layers it does not name: not at all)."""
        if row >= self.rows:
            grow = row + 1 - self.rows
            for layer in self.layers:
                self.maps[layer] = torch.cat(
                    [self.maps[layer], self._identity.expand(grow, -1)])
            self.rows = row + 1
        for layer in self.layers:
            pi = self._identity.clone()
            for base, physical in mapping.get(layer, {}).items():
                pi[base] = physical
            self.maps[layer][row] = pi

    def clear_adapter(self, row: int) -> None:
        """Row ``row`` is free: identity (a token still tagged with it would get base experts,
        so the manager frees a row only once no request uses it)."""
        if row < self.rows:
            for layer in self.layers:
                self.maps[layer][row] = self._identity

    def set_batch(self, aid: torch.Tensor | None) -> None:
        """This step's adapter row per token (None, or every entry -1: all base)."""
        self.aid = None if aid is None or not bool((aid >= 0).any()) else aid.to(torch.int32)

    def reroute(self, layer: int, topk_ids: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
        """``topk_ids [T, K]`` of the step's rows ``row_offset ..`` rewritten by their
        adapters (the same tensor when the step has no adapter token)."""
        aid = self.aid
        if aid is None:
            return topk_ids
        tokens = topk_ids.shape[0]
        rows = aid[row_offset:row_offset + tokens]
        if rows.numel() < tokens:  # rows past the batch's tokens (padding): base
            rows = torch.cat([rows, rows.new_full((tokens - rows.numel(),), -1)])
        from sgl_kernel_ext.esft_reroute import reroute

        pi = self.maps[layer]
        if pi.device != topk_ids.device:
            pi = self.maps[layer] = pi.to(topk_ids.device)
        return reroute(topk_ids, rows.to(topk_ids.device), pi, check_aid=False)
