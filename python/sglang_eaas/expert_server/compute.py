"""The expert server's computation: weighted sums over its local experts, per token.

Two kernels (``--kernel``):

* ``fast`` (default): one call of the C++ kernel (``sgl_kernel_ext.cpu_ops.expert_sum``): the
  entries sorted by local expert, the active experts packed into groups as ``group_shrink``
  packs them, each active expert's weights streamed once with float32 sums, then the weighted
  sum over top-k in k order in float32. ``shrink=False`` (``--disable-shrink``) hands the
  kernel all of the layer's experts, empty ones included, for the ablation.
* ``reference``: SGLang's ``moe_forward_native`` op for op (a Python loop over the experts
  calling ``F.linear``), bit for bit, for exact-equality tests against monolithic SGLang.

Both can record each local expert's load (``expert_load``: entries and nanoseconds): the fast
kernel times each thread's share of each expert inside the call, the reference each expert's
``run``.
"""

from __future__ import annotations

import time

import torch

from sgl_kernel_ext import cpu_ops
from sglang_eaas.expert_server.experts import LayerExperts

KERNELS = ("fast", "reference")


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
                        router_weights: torch.Tensor, kernel: str = "fast",
                        shrink: bool = True, expert_load: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` over entries held here.

    Args:
        hidden: ``[T, H]`` activations, in the weights' dtype.
        flat_local: ``[T * K]`` local expert rows from ``local_experts``; -1 is skipped.
        router_weights: ``[T, K]`` float32.
        kernel: ``fast`` or ``reference`` (module docstring); ``shrink``: with ``fast``, walk
            only the active experts (``False``: all of them).
        expert_load: ``[2, E_local]`` int64, or None; added to: row 0 the entries each local
            expert computed, row 1 its compute time in nanoseconds (``fast``: thread time in
            the grouped products, summed over the kernel's threads; ``reference``: wall time
            of the expert's ops). Only experts with entries get time.
    Returns:
        ``[T, H]`` in ``hidden.dtype``. The sum over k runs in k order with zeros for skipped
        entries, as SGLang's ``moe_forward_native`` does, so that partial sums from several
        servers add up to the monolithic result.
    """
    if kernel == "fast":
        return cpu_ops.expert_sum(hidden, layer.w13, layer.w2, flat_local, router_weights, shrink,
                                  expert_load=expert_load)
    if kernel != "reference":
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    tokens, top_k = router_weights.shape
    per_entry = hidden.new_zeros(tokens * top_k, hidden.shape[1])
    order = torch.argsort(flat_local, stable=True)
    counts = torch.bincount(flat_local[flat_local >= 0], minlength=layer.w13.shape[0]).tolist()
    start = int((flat_local < 0).sum())
    for local_expert, count in enumerate(counts):
        if count:
            began = time.perf_counter_ns()
            entries = order[start : start + count]
            per_entry[entries] = layer.run(local_expert, hidden[entries // top_k])
            start += count
            if expert_load is not None:
                expert_load[0, local_expert] += count
                expert_load[1, local_expert] += time.perf_counter_ns() - began
    return (
        per_entry.view(tokens, top_k, -1).type(router_weights.dtype)
        .mul_(router_weights.unsqueeze(-1)).sum(dim=1).type(hidden.dtype)
    )

