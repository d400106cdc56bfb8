"""Make SGLang's CPU MoE path (``moe_forward_native``) correct with expert parallelism.

With ``--ep > 1`` SGLang's StandardDispatcher maps the ids of experts that live on another rank
to ``-1``. ``moe_forward_native`` is not EP-aware: it scatters ``-1`` (an index error) and
collapses duplicate ids of one token. The fix runs the stock function once per top-k slot on the
tokens whose expert in that slot is local, so each call sees one valid id per token, and sums
the weighted results; FusedMoE's all-reduce then adds the other ranks' shares.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def moe_forward_native_ep(
    moe_forward_native: Callable[..., torch.Tensor],
    layer: torch.nn.Module,
    x: torch.Tensor,
    topk_output: Any,
    moe_runner_config: Any,
) -> torch.Tensor:
    """AROUND hook of ``sglang.srt.layers.moe.fused_moe_native.moe_forward_native``.

    Args:
        x: ``[num_tokens, hidden]`` activations.
        topk_output: SGLang ``StandardTopKOutput``; ``topk_ids`` is ``[num_tokens, top_k]`` int
            holding local expert ids, ``-1`` for experts on other ranks; ``topk_weights`` is
            ``[num_tokens, top_k]`` float.
    Returns:
        ``[num_tokens, hidden]``: ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` over local experts.
    """
    topk_weights, topk_ids, logits = topk_output[:3]
    if not bool((topk_ids < 0).any()):
        return moe_forward_native(layer, x, topk_output, moe_runner_config)
    out = torch.zeros_like(x)
    for slot in range(topk_ids.shape[1]):
        rows = (topk_ids[:, slot] >= 0).nonzero(as_tuple=True)[0]
        if rows.numel() == 0:
            continue
        slot_output = topk_output._replace(
            topk_weights=topk_weights[rows, slot : slot + 1],
            topk_ids=topk_ids[rows, slot : slot + 1],
            router_logits=None if logits is None else logits[rows],
        )
        out.index_add_(0, rows, moe_forward_native(layer, x[rows], slot_output, moe_runner_config))
    return out
