"""Where an expert server's weights live: one region of the weight fabric per layer version.

Every MoE layer's rows (``w13 [n, 2I, H]``, then ``w2 [n, H, I]``) sit in one ``ibgda`` region
of the server's fabric transport (``shm``: a ``/dev/shm`` file; ``mooncake``: memory registered
with the Transfer Engine), so a peer filling replicas reads them one-sidedly (``fabric.py``),
and a peer on the same host may map them and compute with them without a copy. A region is
never written after it is filled: a change of holdings builds the layer's next version in a new
region, and a version's region is closed (its file unlinked) once nothing refers to it any more
(the layer replaced and every peer's lease on it given back), while peers that mapped it keep
their mapping (the memory goes with the last one).

``WeightStore(None, ...)`` keeps weights in plain memory: ``--weight-fabric off``, and tools.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ibgda import LocalRegion, RemoteRegion, Transport
from sglang_eaas.model_info import MoeModelInfo

ALIGN = 64  # bytes: w2 starts on a cache line


@dataclass(eq=False)
class WeightBacking:
    """The region a layer version's rows live in, and where its ``w2`` starts; peers reach it
    through ``region.handle`` (own regions), or it is a peer's region mapped here (``mapped``:
    not exported again, as its owner may retire it)."""

    region: LocalRegion | RemoteRegion
    w2_offset: int
    rows: int
    mapped: bool = False


def row_shapes(info: MoeModelInfo) -> tuple[tuple[int, int], tuple[int, int]]:
    """One expert's ``w13`` and ``w2`` shapes."""
    return (2 * info.moe_intermediate_size, info.hidden_size), (
        info.hidden_size, info.moe_intermediate_size)


def w2_offset(rows: int, info: MoeModelInfo, dtype: torch.dtype) -> int:
    """Where ``w2`` starts in a region of ``rows`` experts: right after ``w13``, aligned."""
    (a, b), _ = row_shapes(info)
    return -(-rows * a * b * dtype.itemsize // ALIGN) * ALIGN


def region_size(rows: int, info: MoeModelInfo, dtype: torch.dtype) -> int:
    _, (c, d) = row_shapes(info)
    return w2_offset(rows, info, dtype) + rows * c * d * dtype.itemsize


def layer_views(region: LocalRegion | RemoteRegion, rows: int, info: MoeModelInfo,
                dtype: torch.dtype, offset: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``w13``, ``w2`` of ``rows`` experts as views of ``region`` (own, or a peer's mapped
    one; ``offset``: where ``w2`` starts, by default as ``w2_offset`` says); None where the
    region is not mapped into this process (every access a transfer)."""
    (a, b), (c, d) = row_shapes(info)
    start = w2_offset(rows, info, dtype) if offset is None else offset
    size = start + rows * c * d * dtype.itemsize
    whole = (region.view(0, size) if isinstance(region, LocalRegion)
             else region.mapped(0, size))
    if whole is None:
        return None
    w13 = whole[: rows * a * b * dtype.itemsize].view(dtype).view(rows, a, b)
    w2 = whole[start:size].view(dtype).view(rows, c, d)
    return w13, w2


class WeightStore:
    """Allocates layer versions: in the fabric's regions (``transport``), or in plain memory
    (``transport`` None)."""

    def __init__(self, transport: Transport | None, info: MoeModelInfo, dtype: torch.dtype):
        self.transport, self.info, self.dtype = transport, info, dtype

    @property
    def backend(self) -> str:
        """The fabric's ibgda backend ("" in plain memory)."""
        return self.transport.name if self.transport is not None else ""

    def empty(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, WeightBacking | None]:
        """Uninitialised ``w13 [rows, 2I, H]``, ``w2 [rows, H, I]`` of this server's dtype, and
        the region they live in (None in plain memory). The caller fills them before anyone
        reads them."""
        (a, b), (c, d) = row_shapes(self.info)
        if self.transport is None:
            return (torch.empty(rows, a, b, dtype=self.dtype),
                    torch.empty(rows, c, d, dtype=self.dtype), None)
        region = self.transport.create_region(max(region_size(rows, self.info, self.dtype), 1))
        w13, w2 = layer_views(region, rows, self.info, self.dtype)
        backing = WeightBacking(region, w2_offset(rows, self.info, self.dtype), rows)
        # The region goes (its file unlinked) with the last reference to its backing; views
        # still alive keep the memory mapped until they go too.
        weakref.finalize(backing, region.close)
        return w13, w2, backing

