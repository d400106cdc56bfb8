"""The ESFT rerouting Triton kernel (``esft_reroute.reroute_triton`` is its wrapper), imported on
first use (see ``group_shrink_kernel`` for why).

One launch over blocks of tokens: each program loads its tokens' adapter ids once, then the
``[BLOCK_T, K]`` tile of expert ids, and gathers the adapter's map entry for every entry that is
routed (id >= 0) and belongs to an adapter token (aid >= 0); the other entries are copied. Every
input is read through its strides (no copy of a sliced or transposed ``ids``), and an entry is
read and written at the same position, so ``out`` may be ``ids`` itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ENTRIES = 1024  # (token, k) entries per program: BLOCK_T = BLOCK_ENTRIES // next_pow2(K)


@triton.jit
def reroute_kernel(ids_ptr, aid_ptr, pi_ptr, out_ptr, num_tokens, top_k,
                   ids_s0, ids_s1, aid_s0, pi_s0, pi_s1, out_s0, out_s1,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[t, k] = pi[aid[t], ids[t, k]]`` where ``aid[t] >= 0`` and ``ids[t, k] >= 0``, else
    ``ids[t, k]``, for the ``BLOCK_T`` tokens of this program."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < num_tokens
    ok = row_ok[:, None] & (cols < top_k)[None, :]
    adapter = tl.load(aid_ptr + rows * aid_s0, mask=row_ok, other=-1).to(tl.int64)
    ids = tl.load(ids_ptr + rows[:, None] * ids_s0 + cols[None, :] * ids_s1, mask=ok, other=-1)
    remap = ok & (adapter[:, None] >= 0) & (ids >= 0)
    physical = tl.load(pi_ptr + adapter[:, None] * pi_s0 + ids.to(tl.int64) * pi_s1, mask=remap,
                       other=0)
    out = tl.where(remap, physical.to(ids.dtype), ids)
    tl.store(out_ptr + rows[:, None] * out_s0 + cols[None, :] * out_s1, out, mask=ok)


def launch_reroute(ids: torch.Tensor, aid: torch.Tensor, pi: torch.Tensor,
                   out: torch.Tensor) -> None:
    """``ids [T, K]`` int32/int64, ``aid int32 [T]``, ``pi int32 [A, E]``, ``out [T, K]`` in
    ids' dtype, any strides, on one device (checked by the caller)."""
    num_tokens, top_k = ids.shape
    if num_tokens == 0 or top_k == 0:
        return
    block_k = triton.next_power_of_2(top_k)
    block_t = max(1, BLOCK_ENTRIES // block_k)
    grid = (triton.cdiv(num_tokens, block_t),)
    reroute_kernel[grid](ids, aid, pi, out, num_tokens, top_k, ids.stride(0), ids.stride(1),
                         aid.stride(0), pi.stride(0), pi.stride(1), out.stride(0), out.stride(1),
                         BLOCK_T=block_t, BLOCK_K=block_k)
