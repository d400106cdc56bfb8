"""The expert server's computation: weighted sums over its local experts, per token."""

from __future__ import annotations

import torch

from sglang_eaas.expert_server.experts import LayerExperts


def local_experts(layer: LayerExperts, expert_ids: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` global ids -> flat ``[T * K]`` local rows, -1 where the id is -1.

    Raises ``ValueError`` naming the ids this server does not hold (or that do not exist).
    """
    flat = expert_ids.reshape(-1).long()
    table = layer.local_index
    held = table[flat.clamp(0, table.numel() - 1)]
    known = (flat >= 0) & (flat < table.numel()) & (held >= 0)
    local = torch.where(flat == -1, -1, torch.where(known, held, -2))
    if bool((local == -2).any()):
        raise ValueError(f"experts {sorted(set(flat[local == -2].tolist()))}")
    return local


def weighted_expert_sum(layer: LayerExperts, hidden: torch.Tensor, flat_local: torch.Tensor,
                        router_weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` over entries held here.

    Args:
        hidden: ``[T, H]`` activations, in the weights' dtype.
        flat_local: ``[T * K]`` local expert rows from ``local_experts``; -1 is skipped.
        router_weights: ``[T, K]`` float32.
    Returns:
        ``[T, H]`` in ``hidden.dtype``. The sum over k runs in k order with zeros for skipped
        entries, as SGLang's ``moe_forward_native`` does, so that partial sums from several
        servers add up to the monolithic result.
    """
    tokens, top_k = router_weights.shape
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
