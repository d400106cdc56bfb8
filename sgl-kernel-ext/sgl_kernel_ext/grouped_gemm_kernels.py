"""The Triton kernels of ``grouped_gemm``, imported on first use (see ``group_shrink_kernel``).

Both kernels run a static grid: program ``p`` takes tiles ``p, p + grid, ...`` of the
concatenated per-group tile lists, carrying its tile id from one group into the next
(Algorithm 1, ``static_grid``), and stops after the ``active`` packed groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .group_shrink import Groups

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32
IEEE, NATIVE, WIDEN = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # how ``_mm`` multiplies


@triton.jit
def _mm(acc, a, b, DOT: tl.constexpr):
    """``acc += a @ b`` with float32 accumulation. ``DOT``: ``IEEE`` (float32 operands, no TF32),
    ``NATIVE`` (bfloat16 operands on the tensor cores) or ``WIDEN`` (bfloat16 operands widened to
    float32 first, which is exact: Triton's interpreter multiplies bfloat16 bit patterns)."""
    if DOT == WIDEN:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif DOT == IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tile(expert_ptr, offset_ptr, count_ptr, g, tile, col_tiles, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr):
    """The expert, the rows (and their mask) and the column tile of tile ``tile`` of group g."""
    start = tl.load(offset_ptr + g)
    rows = start + (tile // col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < start + tl.load(count_ptr + g)
    cols = (tile % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(expert_ptr + g).to(tl.int64), rows.to(tl.int64), row_ok, cols


@triton.jit
def gate_up_kernel(x_ptr, w13_ptr, h_ptr, expert_ptr, offset_ptr, count_ptr, active, hidden,
                   inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT: tl.constexpr):
    """``h[rows, cols] = silu(x @ gate.T) * (x @ up.T)`` for each tile of each active group."""
    col_tiles = (inter + BLOCK_N - 1) // BLOCK_N  # core builtins only: see group_shrink_kernel
    tile = tl.program_id(0)
    for g in range(active):
        tiles = (tl.load(count_ptr + g) + BLOCK_M - 1) // BLOCK_M * col_tiles
        while tile < tiles:
            e, rows, row_ok, cols = _tile(expert_ptr, offset_ptr, count_ptr, g, tile, col_tiles,
                                          BLOCK_M, BLOCK_N)
            col_ok = cols < inter
            gate_ptr = w13_ptr + e * 2 * inter * hidden + cols[None, :] * hidden
            acc_gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < hidden
                w_ok = k_ok[:, None] & col_ok[None, :]
                gate = tl.load(gate_ptr + ks[:, None], mask=w_ok, other=0.0)
                up = tl.load(gate_ptr + inter * hidden + ks[:, None], mask=w_ok, other=0.0)
                a = tl.load(x_ptr + rows[:, None] * hidden + ks[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(gate.dtype)
                acc_gate = _mm(acc_gate, a, gate, DOT)
                acc_up = _mm(acc_up, a, up, DOT)
            h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # SiLU(gate) * up
            tl.store(h_ptr + rows[:, None] * inter + cols[None, :], h,
                     mask=row_ok[:, None] & col_ok[None, :])
            tile += tl.num_programs(0)
        tile -= tiles


@triton.jit
def down_kernel(h_ptr, w2_ptr, out_ptr, expert_ptr, offset_ptr, count_ptr, active, hidden, inter,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT: tl.constexpr):
    """``out[rows, cols] = h @ down.T`` for each tile of each active group."""
    col_tiles = (hidden + BLOCK_N - 1) // BLOCK_N
    tile = tl.program_id(0)
    for g in range(active):
        tiles = (tl.load(count_ptr + g) + BLOCK_M - 1) // BLOCK_M * col_tiles
        while tile < tiles:
            e, rows, row_ok, cols = _tile(expert_ptr, offset_ptr, count_ptr, g, tile, col_tiles,
                                          BLOCK_M, BLOCK_N)
            col_ok = cols < hidden
            down_ptr = w2_ptr + e * hidden * inter + cols[None, :] * inter
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < inter
                down = tl.load(down_ptr + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                               other=0.0)
                a = tl.load(h_ptr + rows[:, None] * inter + ks[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(down.dtype)
                acc = _mm(acc, a, down, DOT)
            tl.store(out_ptr + rows[:, None] * hidden + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            tile += tl.num_programs(0)
        tile -= tiles


def _dot(weight: torch.Tensor) -> int:
    """How the kernels multiply tiles of ``weight``'s dtype on ``weight``'s device (a CPU tensor
    means the interpreter)."""
    assert weight.dtype in (torch.float32, torch.bfloat16), (
        f"grouped expert weights must be float32 or bfloat16, got {weight.dtype}")
    if weight.dtype == torch.float32:
        return IEEE.value
    return NATIVE.value if weight.is_cuda else WIDEN.value


def launch_gate_up(x: torch.Tensor, w13: torch.Tensor, h: torch.Tensor, groups: Groups,
                   grid: int) -> None:
    """``x [N, H]``, ``w13 [E, 2I, H]``, ``h float32 [N, I]`` (written), all contiguous."""
    gate_up_kernel[(grid,)](x, w13, h, groups.expert, groups.offset, groups.count, groups.active,
                            x.shape[1], h.shape[1], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                            BLOCK_K=BLOCK_K, DOT=_dot(w13))


def launch_down(h: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, groups: Groups,
                grid: int) -> None:
    """``h float32 [N, I]``, ``w2 [E, H, I]``, ``out [N, H]`` (written), all contiguous."""
    down_kernel[(grid,)](h, w2, out, groups.expert, groups.offset, groups.count, groups.active,
                         out.shape[1], h.shape[1], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                         BLOCK_K=BLOCK_K, DOT=_dot(w2))
