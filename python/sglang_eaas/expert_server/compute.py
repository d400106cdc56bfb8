"""The expert server's computation: weighted sums over its local experts, per token."""

from __future__ import annotations

import torch

from sglang_eaas.expert_server.experts import LayerExperts


def foreign_experts(layer: LayerExperts, expert_ids: torch.Tensor) -> list[int]:
    """Global ids in ``expert_ids`` (ignoring -1) that this server does not hold."""
    valid = expert_ids[expert_ids >= 0].long()
    if valid.numel() and bool((valid >= layer.local_index.numel()).any()):
        return sorted(set(valid[valid >= layer.local_index.numel()].tolist()))
    return sorted(set(valid[layer.local_index[valid] < 0].tolist()))


def weighted_expert_sum(layer: LayerExperts, hidden: torch.Tensor, expert_ids: torch.Tensor,
                        router_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` over entries held here.

    Args:
        hidden: ``[T, H]`` activations, in the weights' dtype.
        expert_ids: ``[T, K]`` int32 global ids; -1 (or a foreign id, checked before) is skipped.
        router_weights: ``[T, K]`` float32.
    Returns:
        ``[T, H]`` in ``hidden.dtype``. The sum over k runs in k order with zeros for skipped
        entries, as SGLang's ``moe_forward_native`` does, so that partial sums from several
        servers add up to the monolithic result.
    """
    tokens, top_k = expert_ids.shape
    flat_local = torch.where(expert_ids >= 0, layer.local_index[expert_ids.clamp_min(0).long()],
                             -1).view(-1)
    per_entry = hidden.new_zeros(tokens * top_k, hidden.shape[1])
    order = torch.argsort(flat_local, stable=True)
    counts = torch.bincount(flat_local[flat_local >= 0], minlength=layer.w13.shape[0]).tolist()
    start = int((flat_local < 0).sum())
    for local_expert, count in enumerate(counts):
        if count:
            entries = order[start : start + count]
            per_entry[entries] = layer.run(local_expert, hidden[entries // top_k])
            start += count
    return (
        per_entry.view(tokens, top_k, -1).type(router_weights.dtype)
        .mul_(router_weights.unsqueeze(-1)).sum(dim=1).type(hidden.dtype)
    )
