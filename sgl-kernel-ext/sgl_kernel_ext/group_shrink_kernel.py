"""The group-shrink Triton kernel (``group_shrink.group_shrink_triton`` is its wrapper).

Imported on first use only: Triton decides when a kernel is defined whether it runs interpreted
(``TRITON_INTERPRET=1``, the CPU twin the tests drive), and a CPU install need not import Triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 4096  # one block holds all E counts: a single program scans them


# The kernels here use only core ``tl`` builtins and jit functions of their own: ``tl.cumsum``,
# ``tl.sum`` and friends are jit functions of triton.language, fixed at its import as compiled
# or interpreted, so under TRITON_INTERPRET=1 set after Triton was first imported (the tests,
# in a process that imported SGLang) they would refuse to run.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def group_shrink_kernel(counts_ptr, expert_ptr, offset_ptr, count_ptr, active_ptr, num_experts,
                        BLOCK: tl.constexpr):
    """Two scans over the E counts: the inclusive scan of the counts gives every expert's row
    offset, the exclusive scan of the active flags its packed position."""
    idx = tl.arange(0, BLOCK)
    counts = tl.load(counts_ptr + idx, mask=idx < num_experts, other=0)
    live = (counts > 0).to(tl.int32)
    ends = tl.associative_scan(counts, 0, _add)
    slot = tl.associative_scan(live, 0, _add) - live
    keep = live > 0
    tl.store(expert_ptr + slot, idx, mask=keep)
    tl.store(offset_ptr + slot, ends - counts, mask=keep)
    tl.store(count_ptr + slot, counts, mask=keep)
    tl.store(active_ptr, tl.reduce(live, 0, _add))


def launch_group_shrink(counts: torch.Tensor, expert: torch.Tensor, offset: torch.Tensor,
                        count: torch.Tensor, active: torch.Tensor) -> None:
    """``counts int32 [E]`` (>= 0, contiguous); writes ``expert, offset, count int32 [E]`` (zeroed
    by the caller: only the first ``active`` entries are stored) and ``active int32 [1]``."""
    num = counts.numel()
    assert num <= MAX_EXPERTS, f"group shrink takes at most {MAX_EXPERTS} experts, got {num}"
    if num == 0:
        return
    block = triton.next_power_of_2(num)
    group_shrink_kernel[(1,)](counts, expert, offset, count, active, num, BLOCK=block)
