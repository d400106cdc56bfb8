"""The weight fabric: expert weights move between servers one-sidedly over ``ibgda``.

A server's layers live in fabric regions (``weight_store.py``). A server that adds replicas
asks a holder to lend them (``export_weights``): the holder answers with the region of its
current version of that layer, each expert's row and digest, and a lease that keeps the region
alive until the reader gives it back (``release_weights``) or ``LEASE`` seconds pass. The
reader checks the digests against its own (the same experts of the same checkpoint or
adapter), then

* maps the region and computes with the holder's rows in place (zero copies) where the layout
  allows: the same host (``shm``), the same dtype, and nothing of that layer held yet (the
  mode ``map``; ElasticMoE's zero-copy reuse of resident weights);
* else reads the rows one-sidedly into its next version of the layer (``shm``: a memcpy split
  over ``threads`` threads; ``mooncake``: one Transfer Engine read per run of rows), without
  the holder's CPU. The rows land in the layer's spare rows where it has room (warm memory:
  ``weight_store.py``), else in a new region.

No byte checksum is taken: ``shm`` reads the holder's memory itself, and Mooncake's transports
(TCP, RDMA) check their own frames; the digests make sure the rows are the right experts.
The control channel carries only the lease (docs/protocol.md, "Weight fabric").
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

import ibgda
from ibgda import RegionHandle, TransportError
from sglang_eaas.expert_server.experts import LayerExperts, grown
from sglang_eaas.slices import Part, cut_into
from sglang_eaas.expert_server.weight_store import (
    WeightBacking, WeightStore, layer_views, row_shapes,
)
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.control import ExportWeights, ReleaseWeights, WeightsRegion
from sglang_eaas.protocol.lines import Channel, ControlError, Done
from sglang_eaas.protocol.slot import DTYPE_NAMES, DTYPES_BY_NAME

if TYPE_CHECKING:
    from sglang_eaas.expert_server.held import HeldExperts

logger = logging.getLogger(__name__)
LEASE = 60.0  # seconds a lent layer version stays readable without a release
MODES = ("map", "copy", "off")  # --weight-fabric


class WeightExports:
    """The holder's side: lends its current layer versions and keeps each alive while lent."""

    def __init__(self, held: "HeldExperts", address: str):
        self.held, self.address = held, address
        self._lock = threading.Lock()
        self._leases: dict[str, tuple[LayerExperts, float]] = {}  # lease -> version, until

    def export(self, request: ExportWeights) -> WeightsRegion:
        held = self.held
        layer = held.layers.get(request.layer)
        if held.store.transport is None:
            raise ControlError("no_weight_fabric", f"expert server {self.address} keeps its "
                               "weights in plain memory (--weight-fabric off)")
        if request.parts > 1:
            return self._export_parts(request)
        if request.adapter:
            described = held.holdings.adapters.get(request.layer, {})
            digests = {p: d.digest for p, d in described.items()}
        else:
            digests = dict(held.digests)
        said = set(held.holdings.get(request.layer, ()))
        rows = [-1] * len(request.experts) if layer is None else [
            int(layer.local_index[e]) if e < layer.local_index.numel() else -1
            for e in request.experts]
        missing = [e for e, r in zip(request.experts, rows)
                   if r < 0 or e not in said or e not in digests]
        if missing:
            raise ControlError("weights_not_held", f"expert server {self.address} does not hold "
                               f"{'adapter ' if request.adapter else ''}experts {missing} of "
                               f"MoE layer {request.layer}")
        if layer.backing is not None and layer.backing.mapped:
            # a layer mapped from a peer is the peer's to retire: lend a copy of its rows, in
            # a region of this server's (one memcpy), which the lease keeps until released
            layer = grown(layer, [], held.info.num_experts, held.store)[0]
            rows = [int(layer.local_index[e]) for e in request.experts]
        return self._lend(layer, list(request.experts), rows,
                          [digests[e] for e in request.experts])

    def _export_parts(self, request: ExportWeights) -> WeightsRegion:
        """Lend parts of ``request.parts``-part slices (routed ids), each with its expert's
        digest (the reader's check that both serve one checkpoint)."""
        held, parts = self.held, request.parts
        layer = held.part_layers.get(request.layer)
        said = held.holdings.parts.get(request.layer)
        ids = list(request.experts)
        held_ids = set(said.ids) if said is not None and said.parts == parts else set()
        missing = [i for i in ids if i not in held_ids]
        if layer is None or layer.backing is None or missing:
            raise ControlError("weights_not_held", f"expert server {self.address} does not hold "
                               f"parts {missing or ids} of {parts}-part slices of MoE layer "
                               f"{request.layer} in its weight fabric")
        digests = held.digests_of(sorted({i // parts for i in ids}))
        return self._lend(layer, ids, [int(layer.local_index[i]) for i in ids],
                          [digests[i // parts] for i in ids])

    def _lend(self, layer: LayerExperts, ids: list[int], rows: list[int],
              digests: list[str]) -> WeightsRegion:
        """A lease on ``layer``'s region: ``ids`` at ``rows``."""
        lease = uuid.uuid4().hex
        now = time.monotonic()
        with self._lock:
            self._leases = {k: v for k, v in self._leases.items() if v[1] > now}
            self._leases[lease] = (layer, now + LEASE)
        backing = layer.backing
        # the rows of the version lent (not the region's spare rows, written later)
        return WeightsRegion(lease, backing.region.handle.to_dict(),
                             DTYPE_NAMES[self.held.dtype], layer.w13.shape[0],
                             backing.w2_offset, ids, rows, digests)

    def release(self, request: ReleaseWeights) -> Done:
        with self._lock:
            self._leases.pop(request.lease, None)
        return Done()

    def lent(self) -> int:
        """Leases not yet given back or expired."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for _, until in self._leases.values() if until > now)


@dataclass
class Fill:
    """What a fill over the fabric made: the layer's next version, and how."""

    layer: LayerExperts
    mapped: bool  # zero-copy: the holder's rows, mapped
    bytes_read: int  # read one-sidedly (0 when mapped)


class FabricReader:
    """The reader's side: one per server, over its ``WeightStore`` (its transport reaches the
    holders' regions of the same backend)."""

    def __init__(self, store: WeightStore, mode: str, token: str, timeout: float,
                 threads: int = 1):
        if mode not in MODES:
            raise ValueError(f"weight fabric mode must be one of {MODES}, got {mode!r}")
        if threads < 1:
            raise ValueError(f"fill threads must be >= 1, got {threads}")
        self.store, self.mode, self.token, self.timeout = store, mode, token, timeout
        self.threads = threads
        # the copying threads, started now (a fill does not wait for threads to start), which
        # also unmap a peer's region after a read (unmapping is not the fill's to wait for)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="eaas-fill")
        started = threading.Barrier(threads)
        for _ in range(threads):
            self._pool.submit(started.wait, 10.0)
        self._channels: dict[str, _Kept] = {}  # holder -> its kept control connection
        self._channels_lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.store.transport is not None

    def close(self) -> None:
        """Stop the copying threads (what they were given and not begun is dropped: a lease
        not given back expires) and close the kept connections."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._channels_lock:
            kept, self._channels = list(self._channels.values()), {}
        for connection in kept:
            connection.channel.close()

    def fill(self, source: str, layer_id: int, base: LayerExperts | None, experts: list[int],
             digests: dict[int, str], num_experts: int, adapter: bool = False) -> Fill:
        """The next version of ``layer_id``: ``base``'s experts, then ``experts`` from the
        holder ``source`` (``digests``: this server's digest of each; the holder's must match).

        Raises ``TransportError``/``ControlError`` where the holder cannot lend them over the
        fabric (then the caller reads them otherwise), ``ValueError`` where it holds other
        weights under those ids."""
        kept, lent = self._lease(source, ExportWeights(layer_id, list(experts), adapter))
        try:
            return self._fill_from(lent, base, experts, digests, num_experts, source)
        finally:  # given back off the fill's path (it expires on its own if that fails)
            self._pool.submit(self._release, source, kept, lent.lease)

    def _lease(self, source: str, request: ExportWeights) -> tuple["_Kept", WeightsRegion]:
        """The holder's answer, over the connection kept to it (a new one where that broke:
        the holder may have closed it)."""
        with self._channels_lock:
            kept = self._channels.get(source)
        if kept is not None:
            try:
                return kept, kept.call(request)
            except TransportError:
                self._forget(source, kept)
        kept = _Kept(Channel(source, self.token, self.timeout))
        try:
            lent = kept.call(request)
        except TransportError:
            kept.channel.close()
            raise
        with self._channels_lock:
            self._channels[source] = kept
        return kept, lent

    def _forget(self, source: str, kept: "_Kept") -> None:
        with self._channels_lock:
            if self._channels.get(source) is kept:
                del self._channels[source]
        kept.channel.close()

    def _release(self, source: str, kept: "_Kept", lease: str) -> None:
        try:
            kept.call(ReleaseWeights(lease))
        except (TransportError, ControlError) as exc:
            logger.debug("could not give lease %s back to %s: %s", lease, source, exc)
            if isinstance(exc, TransportError):
                self._forget(source, kept)

    def read_parts(self, source: str, layer_id: int, experts: list[int],
                   digests: dict[int, str], cuts: list[Part], out13: torch.Tensor,
                   out2: torch.Tensor) -> int:
        """Part ``cuts[i]`` of ``experts[i]`` of ``layer_id`` into ``out13[i]``, ``out2[i]``
        (``[n, 2I/P, H]``, ``[n, H, I/P]``), cut from the whole rows the holder ``source``
        lends (``digests`` as ``fill``'s): where its region is mapped here only the parts'
        bytes are copied, else whole rows are read and cut. Returns the bytes read (0 when
        mapped). Raises as ``fill`` does."""
        def cut(i: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
            cut_into(w13[None], w2[None], cuts[i], out13[i:i + 1], out2[i:i + 1])

        return self._each_lent_row(source, ExportWeights(layer_id, list(experts)), digests,
                                   self.store.info, cut)

    def read_part_rows(self, source: str, layer_id: int, ids: list[int], parts: int,
                       digests: dict[int, str], out13: torch.Tensor, out2: torch.Tensor
                       ) -> int:
        """The holder ``source``'s rows of the parts ``ids`` (routed ids of ``parts``-part
        slices) of ``layer_id`` into ``out13[i]``, ``out2[i]`` (``[n, 2I/P, H]``, ``[n, H,
        I/P]``); ``digests``: this server's digest of each part's expert (the holder's must
        match). Returns the bytes read (0 where its region is mapped here: copied)."""
        def copy(i: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
            out13[i].copy_(w13)
            out2[i].copy_(w2)

        return self._each_lent_row(source, ExportWeights(layer_id, list(ids), parts=parts),
                                   {i: digests[i // parts] for i in ids},
                                   Part(0, parts).info(self.store.info), copy)

    def _each_lent_row(self, source: str, request: ExportWeights, digests: dict[int, str],
                       info: MoeModelInfo,
                       use: Callable[[int, torch.Tensor, torch.Tensor], None]) -> int:
        """``use(i, w13, w2)`` for each row the holder ``source`` lends for ``request`` (rows
        of ``info``'s shape, the holder's dtype): views of its region where it is mapped
        here, else each row read; the lease is given back after. Returns the bytes read."""
        kept, lent = self._lease(source, request)
        try:
            peer, dtype = self._connect(lent, request.experts, digests, source)
            try:
                views = layer_views(peer, lent.rows, info, dtype, lent.w2_offset)
                (a, b), (c, d) = row_shapes(info)
                read = 0
                for i, at in enumerate(lent.expert_rows):
                    if views is None:  # every access a transfer
                        w13, w2 = torch.empty(a, b, dtype=dtype), torch.empty(c, d, dtype=dtype)
                        peer.read(at * w13.nbytes, w13)
                        peer.read(lent.w2_offset + at * w2.nbytes, w2)
                        read += w13.nbytes + w2.nbytes
                    else:
                        w13, w2 = views[0][at], views[1][at]
                    use(i, w13, w2)
                return read
            finally:
                self._pool.submit(peer.close)
        finally:
            self._pool.submit(self._release, source, kept, lent.lease)

    def _connect(self, lent: WeightsRegion, experts: list[int], digests: dict[int, str],
                 source: str) -> tuple[ibgda.RemoteRegion, torch.dtype]:
        """The lent region, connected, and its dtype, once it is known to hold ``experts``
        with ``digests``."""
        theirs = dict(zip(lent.experts, lent.digests))
        differ = [e for e in experts if theirs.get(e) != digests[e]]
        if differ or lent.experts != list(experts):
            raise ValueError(f"{source} holds other weights for experts {differ or experts}")
        handle = RegionHandle.from_dict(lent.region)
        if handle.backend != self.store.backend:
            raise TransportError(f"{source} lends its weights over {handle.backend}, this "
                                 f"server's fabric is {self.store.backend}")
        dtype = DTYPES_BY_NAME.get(lent.dtype)
        if dtype is None:
            raise ControlError("bad_field", f"{source} lends weights of dtype {lent.dtype!r}")
        return self.store.transport.connect(handle), dtype

    def _fill_from(self, lent: WeightsRegion, base: LayerExperts | None, experts: list[int],
                   digests: dict[int, str], num_experts: int, source: str) -> Fill:
        peer, dtype = self._connect(lent, experts, digests, source)
        info = self.store.info
        size = max([num_experts, *(e + 1 for e in experts)])
        if (self.mode == "map" and base is None and dtype == self.store.dtype):
            views = layer_views(peer, lent.rows, info, dtype, lent.w2_offset)
            if views is not None:  # the peer's pages, mapped: they stay while views do
                index = torch.full((size,), -1, dtype=torch.long)
                index[torch.tensor(experts)] = torch.tensor(lent.expert_rows)
                backing = WeightBacking(peer, lent.w2_offset, lent.rows, mapped=True)
                return Fill(LayerExperts(*views, index, backing), True, 0)
        try:
            return self._read(peer, lent, dtype, base, experts, size)
        finally:
            self._pool.submit(peer.close)

    def _read(self, peer: ibgda.RemoteRegion, lent: WeightsRegion, dtype: torch.dtype,
              base: LayerExperts | None, experts: list[int], size: int) -> Fill:
        """``base``'s rows, then ``experts``' read one-sidedly, in a new version."""
        next_layer, new13, new2 = grown(base, experts, size, self.store)
        (a, b), (c, d) = row_shapes(self.store.info)
        rows13, rows2 = a * b * dtype.itemsize, c * d * dtype.itemsize  # bytes of a peer's row
        read = 0
        for first, count, at in runs(lent.expert_rows):
            for rows, offset, out in ((rows13, 0, new13), (rows2, lent.w2_offset, new2)):
                dst = out[first:first + count]
                if dtype != self.store.dtype:
                    staged = torch.empty(dst.shape, dtype=dtype)
                    peer.read(offset + at * rows, staged)
                    dst.copy_(staged)
                else:
                    self._read_rows(peer, offset + at * rows, dst)
                read += count * rows
        return Fill(next_layer, False, read)

    def _read_rows(self, peer: ibgda.RemoteRegion, offset: int, dst: torch.Tensor) -> None:
        """``dst`` (rows, contiguous) from the peer's region at ``offset``: where the region is
        mapped here (``shm``), ``memcpy`` split over ``threads`` threads (a copy of this size is
        bound by how many cores write; glibc's ``memcpy`` streams large copies, torch's
        ``copy_`` does not); else one read."""
        nbytes = dst.numel() * dst.element_size()
        src = peer.mapped(offset, nbytes)
        if src is None:
            peer.read(offset, dst)
            return
        split_memcpy(dst.data_ptr(), src.data_ptr(), nbytes, self._pool, self.threads)


def split_memcpy(to: int, at: int, nbytes: int, pool: ThreadPoolExecutor, threads: int
                 ) -> None:
    """glibc ``memcpy`` of ``nbytes`` from address ``at`` to ``to``, in ``threads`` pieces on
    ``pool``'s threads (ctypes lets the GIL go during each); returns when all are copied."""
    step = -(-nbytes // threads)
    parts = [pool.submit(ctypes.memmove, to + i, at + i, min(step, nbytes - i))
             for i in range(0, nbytes, step)]
    for part in parts:
        part.result()


@dataclass
class _Kept:
    """A control connection kept to a holder, one call at a time."""

    channel: Channel
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, request):
        with self.lock:
            return self.channel.call(request)


def runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """``(first, count, row)``: ``rows[first:first + count]`` are the consecutive rows
    ``row .. row + count - 1`` (one read each)."""
    out: list[tuple[int, int, int]] = []
    for i, row in enumerate(rows):
        if out and out[-1][2] + out[-1][1] == row:
            first, count, at = out[-1]
            out[-1] = (first, count + 1, at)
        else:
            out.append((i, 1, row))
    return out
