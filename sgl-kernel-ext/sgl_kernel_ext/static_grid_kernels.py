"""The Triton kernels of ``static_grid`` (Algorithm 1), imported on first use (see
``group_shrink_kernel`` for why). Each program keeps its token id relative to the batch it is
in; the GPU version of the paper stages ``num_tokens`` in shared memory, here the per-batch
loads are scalar loads that stay in L1."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def visit_kernel(num_tokens_ptr, starts_ptr, out_ptr, num_batches):
    """Write (program, batch, token) of every visit to ``out[starts[batch] + token]``."""
    program = tl.program_id(0)
    token = program
    for batch in range(num_batches):
        n = tl.load(num_tokens_ptr + batch)
        start = tl.load(starts_ptr + batch)
        while token < n:
            row = (start + token).to(tl.int64) * 3
            tl.store(out_ptr + row, program)
            tl.store(out_ptr + row + 1, batch)
            tl.store(out_ptr + row + 2, token)
            token += tl.num_programs(0)
        token -= n


@triton.jit
def gather_kernel(src_ptr, src_starts_ptr, num_tokens_ptr, out_starts_ptr, out_ptr, num_batches,
                  hidden, src_stride, BLOCK_H: tl.constexpr):
    """Copy ``src[src_starts[b] + t]`` to ``out[out_starts[b] + t]`` for every visited (b, t)."""
    token = tl.program_id(0)
    for batch in range(num_batches):
        n = tl.load(num_tokens_ptr + batch)
        src_row = src_ptr + tl.load(src_starts_ptr + batch).to(tl.int64) * src_stride
        out_row = out_ptr + tl.load(out_starts_ptr + batch).to(tl.int64) * hidden
        while token < n:
            for h0 in range(0, hidden, BLOCK_H):
                cols = h0 + tl.arange(0, BLOCK_H)
                ok = cols < hidden
                values = tl.load(src_row + token.to(tl.int64) * src_stride + cols, mask=ok)
                tl.store(out_row + token.to(tl.int64) * hidden + cols, values, mask=ok)
            token += tl.num_programs(0)
        token -= n


def launch_visit(num_tokens: torch.Tensor, starts: torch.Tensor, out: torch.Tensor,
                 grid: int) -> None:
    """``num_tokens, starts int32 [B]``; ``out int32 [total, 3]``, contiguous."""
    assert grid >= 1, f"the grid needs at least one program, got {grid}"
    if num_tokens.numel():
        visit_kernel[(grid,)](num_tokens, starts, out, num_tokens.numel())


def launch_gather(src: torch.Tensor, src_starts: torch.Tensor, num_tokens: torch.Tensor,
                  out_starts: torch.Tensor, out: torch.Tensor, grid: int) -> None:
    """``src [S, H]`` (rows contiguous), ``src_starts, num_tokens, out_starts int32 [B]``,
    ``out [total, H]`` contiguous, ``src``'s dtype."""
    assert grid >= 1, f"the grid needs at least one program, got {grid}"
    if num_tokens.numel() and out.numel():
        block = min(triton.next_power_of_2(src.shape[1]), 1024)
        gather_kernel[(grid,)](src, src_starts, num_tokens, out_starts, out, num_tokens.numel(),
                               src.shape[1], src.stride(0), BLOCK_H=block)
