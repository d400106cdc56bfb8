"""Group shrink: pack the active experts' (id, offset, count) to the front.

An expert server holds E experts per layer; a batch activates a few. A grouped GEMM scheduler
that walks all E groups pays for the inactive ones (the paper's §4.1: one global read per group,
most empty). A prefix scan over the per-expert counts gives every active expert its place in
the packed list and its rows' offset in the expert-sorted token order; the GEMM then walks
``active`` groups and stops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Groups:
    """The packed active groups of one layer's batch.

    ``expert``, ``offset``, ``count``: ``int32 [E]``, valid in their first ``active`` entries
    (in increasing expert order; the rest is zero). ``offset[g]`` is where group ``g``'s rows
    start in the expert-sorted entries, ``count[g]`` how many rows it has (> 0).
    """

    expert: torch.Tensor
    offset: torch.Tensor
    count: torch.Tensor
    active: int


def group_shrink(counts: torch.Tensor) -> Groups:
    """The CPU implementation (what the expert server runs): ``counts int32/int64 [E]``."""
    counts = counts.to(torch.int32)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    live = torch.nonzero(counts > 0).flatten()
    active = int(live.numel())
    expert = torch.zeros_like(counts)
    offset = torch.zeros_like(counts)
    count = torch.zeros_like(counts)
    expert[:active] = live.to(torch.int32)
    count[:active] = counts[live]
    offset[:active] = ends[live] - counts[live]
    return Groups(expert, offset, count, active)


def group_shrink_reference(counts: torch.Tensor) -> Groups:
    """The plain reference, a loop over experts: ``counts int32/int64 [E]`` (>= 0)."""
    num = counts.numel()
    expert, offset, count = [0] * num, [0] * num, [0] * num
    active = start = 0
    for e, c in enumerate(counts.tolist()):
        if c > 0:
            expert[active], offset[active], count[active] = e, start, c
            active += 1
        start += c

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=counts.device)

    return Groups(column(expert), column(offset), column(count), active)


def group_shrink_triton(counts: torch.Tensor) -> Groups:
    """The Triton kernel (one program, one block of E experts): ``counts int32/int64 [E]`` on
    the kernel's device (CUDA, or CPU under ``TRITON_INTERPRET=1``). ``active`` is read back
    to the host, the one sync (``Groups.active`` is an int)."""
    from .group_shrink_kernel import launch_group_shrink

    counts = counts.to(torch.int32).contiguous()
    expert, offset, count = (torch.zeros_like(counts) for _ in range(3))
    active = torch.zeros(1, dtype=torch.int32, device=counts.device)
    launch_group_shrink(counts, expert, offset, count, active)
    return Groups(expert, offset, count, int(active.item()))
