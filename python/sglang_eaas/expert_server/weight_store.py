"""Where an expert server's weights live: one region of the weight fabric per layer version.

Every MoE layer's rows (``w13 [capacity, 2I, H]``, then ``w2 [capacity, H, I]``) sit in one
``ibgda`` region of the server's fabric transport (``shm``: a ``/dev/shm`` file; ``mooncake``:
memory registered with the Transfer Engine), so a peer filling replicas reads them one-sidedly
(``fabric.py``), and a peer on the same host may map them and compute with them without a copy.

**Spare rows.** A region has room for ``spare`` rows past those it is made for, faulted in when
it is made (written once), so that later replicas are appended in place: written into warm
memory, nothing else copied (ElasticMoE's pre-initialised expert memory). A row once written is
never written again: an append takes rows past the region's high-water mark (``used``), and a
drop only unmaps the expert's id, leaving its row dead until the layer is compacted (the next
append that does not fit builds the layer's next version in a new region, holding only the live
rows, with ``spare`` rows again). So a peer that mapped a region, a lease on it and a batch
computing with an older version all see rows that do not change. A version's region is closed
(its file unlinked) once nothing refers to it any more (every version over it replaced and every
peer's lease on it given back), while peers that mapped it keep their mapping (the memory goes
with the last one). A standby server also reserves a pre-faulted region per MoE layer
(``reserve``), which its first fill of that layer takes.

``WeightStore(None, ...)`` keeps weights in plain memory: ``--weight-fabric off``, and tools.
"""

from __future__ import annotations

import threading
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
    rows: int  # capacity: the rows the region's layout has room for
    mapped: bool = False
    used: int = 0  # rows written so far (appends go past them; own regions only)

    @property
    def free(self) -> int:
        """Rows that can still be appended in place (none in a mapped peer's region)."""
        return 0 if self.mapped else self.rows - self.used


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
    """Allocates layer versions: in the fabric's regions (``transport``), each with room for
    ``spare`` more rows, or in plain memory (``transport`` None; no spare rows)."""

    def __init__(self, transport: Transport | None, info: MoeModelInfo, dtype: torch.dtype,
                 spare: int = 0):
        if spare < 0:
            raise ValueError(f"spare rows must be >= 0, got {spare}")
        self.transport, self.info, self.dtype = transport, info, dtype
        self.spare = spare if transport is not None else 0
        self._reserved: list[WeightBacking] = []  # pre-faulted, never written: taken by empty()
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        """The fabric's ibgda backend ("" in plain memory)."""
        return self.transport.name if self.transport is not None else ""

    def empty(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, WeightBacking | None]:
        """Uninitialised ``w13 [rows, 2I, H]``, ``w2 [rows, H, I]`` of this server's dtype, and
        the region they live in (None in plain memory), its first ``rows`` rows used: a reserved
        region where one has room, else a new one with ``spare`` rows past them. The caller
        fills them before anyone reads them."""
        (a, b), (c, d) = row_shapes(self.info)
        if self.transport is None:
            return (torch.empty(rows, a, b, dtype=self.dtype),
                    torch.empty(rows, c, d, dtype=self.dtype), None)
        backing = self._take_reserved(rows) or self._region(rows + self.spare, prefault=rows)
        backing.used = rows
        w13, w2 = self.views(backing)
        return w13[:rows], w2[:rows], backing

    def append(self, backing: WeightBacking | None, rows: int
               ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """Room for ``rows`` more rows in ``backing``'s region, past every row written so far:
        ``w13``, ``w2`` views of the whole used part (old rows, then the new ones) and where
        the new ones start; None where the region has no room (or is not this server's)."""
        if backing is None or backing.mapped or backing.free < rows:
            return None
        start = backing.used
        backing.used += rows
        w13, w2 = self.views(backing)
        return w13[:backing.used], w2[:backing.used], start

    def views(self, backing: WeightBacking) -> tuple[torch.Tensor, torch.Tensor]:
        """``w13``, ``w2`` of every row the region has room for."""
        return layer_views(backing.region, backing.rows, self.info, self.dtype,
                           backing.w2_offset)

    def reserve(self, count: int) -> None:
        """Make ``count`` regions of ``spare`` rows now, every page faulted in, for later fills
        to take (a standby server's one per MoE layer)."""
        if self.transport is None or not self.spare:
            return
        made = [self._region(self.spare, prefault=0) for _ in range(count)]
        with self._lock:
            self._reserved += made

    def reserved(self) -> int:
        """Reserved regions not taken yet."""
        with self._lock:
            return len(self._reserved)

    def _take_reserved(self, rows: int) -> WeightBacking | None:
        with self._lock:
            fits = [b for b in self._reserved if b.rows >= rows]
            if not fits:
                return None
            taken = min(fits, key=lambda b: b.rows)
            self._reserved.remove(taken)
            return taken

    def _region(self, rows: int, prefault: int) -> WeightBacking:
        """A new region with room for ``rows`` rows; the pages of rows ``prefault`` on faulted
        in now (written), so writing them later runs at a warm copy's speed."""
        region = self.transport.create_region(max(region_size(rows, self.info, self.dtype), 1))
        backing = WeightBacking(region, w2_offset(rows, self.info, self.dtype), rows)
        # The region goes (its file unlinked) with the last reference to its backing; views
        # still alive keep the memory mapped until they go too.
        weakref.finalize(backing, region.close)
        if prefault < rows:
            w13, w2 = self.views(backing)
            w13[prefault:].zero_()
            w2[prefault:].zero_()
        return backing

