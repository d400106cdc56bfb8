"""The expert MLP over packed groups: gate/up GEMM, SiLU(gate) * up, down GEMM (§4.1).

The rows arrive sorted by expert; ``group_shrink`` has packed the active experts' (id, offset,
count) to the front, so the kernels walk ``active`` groups only and never read an inactive
expert's metadata. Work is split into tiles of (group, row tile, column tile), walked by a
static grid of programs the way Algorithm 1 walks (batch, token) pairs (``static_grid``): one
launch shape whatever the load, and programs balanced across groups of different sizes.

Weights are laid out as SGLang's FusedMoE stores them: ``w13 [E, 2I, H]`` (gate rows, then up
rows) and ``w2 [E, H, I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .group_shrink import Groups


def grouped_expert_reference(x_sorted: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                             groups: Groups) -> torch.Tensor:
    """A loop over the active groups calling ``F.linear`` in float32.

    ``x_sorted float [N, H]`` (float32 or bfloat16): rows sorted by expert, group ``g``'s rows
    ``x_sorted[offset[g] : offset[g] + count[g]]``; ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (float32
    or bfloat16); ``groups``: ``int32 [E]`` fields on any device. Returns ``out_sorted [N, H]``
    in ``x_sorted``'s dtype (rows in no active group are zero).
    """
    out = torch.zeros(x_sorted.shape, dtype=torch.float32, device=x_sorted.device)
    inter = w2.shape[2]
    for g in range(groups.active):
        e, start, n = (int(f[g]) for f in (groups.expert, groups.offset, groups.count))
        x = x_sorted[start:start + n].float()
        gate_up = F.linear(x, w13[e].float())
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        out[start:start + n] = F.linear(F.silu(gate) * up, w2[e].float())
    return out.to(x_sorted.dtype)


def grouped_expert_triton(x_sorted: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          groups: Groups, grid: int | None = None) -> torch.Tensor:
    """The Triton kernels (same arguments and result as ``grouped_expert_reference``; tensors
    on the kernels' device). Accumulation is float32; the GEMM operands are in the weights'
    dtype (bfloat16 weights: activations are rounded to bfloat16 before each GEMM, as SGLang's
    fused MoE does). ``grid``: programs per launch (default: the GPU's SM count, 4 on CPU).
    """
    from .grouped_gemm_kernels import launch_down, launch_gate_up

    num_experts, two_inter, hidden = w13.shape
    assert x_sorted.dim() == 2 and x_sorted.shape[1] == hidden, (
        f"x_sorted must be [N, {hidden}], got {tuple(x_sorted.shape)}")
    assert w2.shape == (num_experts, hidden, two_inter // 2), (
        f"w2 must be [{num_experts}, {hidden}, {two_inter // 2}], got {tuple(w2.shape)}")
    if grid is None:
        grid = (torch.cuda.get_device_properties(x_sorted.device).multi_processor_count
                if x_sorted.is_cuda else 4)
    x_sorted, w13, w2 = x_sorted.contiguous(), w13.contiguous(), w2.contiguous()
    h = torch.zeros((x_sorted.shape[0], two_inter // 2), dtype=torch.float32,
                    device=x_sorted.device)
    out = torch.zeros_like(x_sorted)
    if groups.active:
        launch_gate_up(x_sorted, w13, h, groups, grid)
        launch_down(h, w2, out, groups, grid)
    return out
