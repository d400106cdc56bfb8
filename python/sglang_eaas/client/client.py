"""``EaasClient``: one attention rank's dispatch -> (remote run) -> combine over expert servers.

The data path. It reads a ``View`` (routing table + connections) from its ``ClientTier`` and
adopts a new one only between steps (``begin_step`` / the first MoE layer of a step), so every
layer of a step reads one table. Failures are handled where they are seen:

* a server that does not answer within ``result_timeout`` (or that the monitor reports lost
  meanwhile, or whose connection broke) is dropped at once (``ClientTier.lose``, a narrower
  view for the rest of the step) and the entries it had are sent again to the other holders of
  their experts: tokens come out as if it had never been there;
* an entry whose expert has no live holder cannot be computed: the token's row is recorded as
  failed (``end_step`` returns them, naming the layer and experts) and the rest of the batch
  goes on; SGLang ends the requests those rows belong to with an error (``client/steps.py``).

Each layer call's expert ids are counted once, in ``dispatch`` (``load``, a ``LoadRecorder``:
windows of steps to ``/metrics``, the dump file and the monitor's heartbeat).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from ibgda import TransportError
from sglang_eaas import transports
from sglang_eaas.balance.forecast import RoutingBook
from sglang_eaas.balance.load import LoadWindow
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.connection import ServerConnection
from sglang_eaas.client.handles import Chunk, Dispatched, Sent
from sglang_eaas.client.load_recorder import DEFAULT_WINDOW_STEPS, LoadRecorder
from sglang_eaas.client.device_step import DeviceFailure, DeviceStep, drives_devices
from sglang_eaas.client.metrics import TierMetrics
from sglang_eaas.client.tier import ClientTier, TierSettings, View
from sglang_eaas.esft.routing import AdapterRouting
from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import HEARTBEAT
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import NO_HOLDER, PlacementError
from sglang_eaas.protocol import ProtocolError
from sglang_eaas.protocol.header import RejectReason
from sglang_eaas.protocol.slot import POLL_SPIN_US, ClientSlot, Rejected
from sglang_eaas.routing_table import RoutingTable

WAIT_SLICE = 0.05  # seconds between checks, while waiting, of what the monitor said
NOT_HELD = (RejectReason.FOREIGN_EXPERT, RejectReason.UNKNOWN_LAYER)  # holdings changed


class EaasClient:
    """Joins every expert server at construction, so placement errors surface before serving."""

    def __init__(self, addresses: list[str], info: MoeModelInfo, model: ModelIdentity,
                 dtype: torch.dtype, name: str,
                 expected_experts: Holdings | None = None,
                 result_timeout: float = 2.0, transport: str = transports.AUTO,
                 poll_spin: float = POLL_SPIN_US * 1e-6, monitor: str = "",
                 heartbeat: float = HEARTBEAT, wait_for_experts: float = 30.0,
                 metrics: TierMetrics | None = None, micro_batches: int = 1,
                 load_window: int = DEFAULT_WINDOW_STEPS,
                 load_sinks: Sequence[Callable[[LoadWindow], None]] = (),
                 adapter_slots: int = 0, routing: RoutingBook | None = None):
        """``micro_batches``: 2 to have two layers in flight at once (two-batch overlap:
        ``dispatch(micro_batch=i)``), each on a slot of its own at every server.
        ``load_window``: steps per load window; ``load_sinks``: called with each one.
        ``adapter_slots``: expert ids per MoE layer past the model's, for ESFT adapters'
        experts (``esft``: their rerouting, then)."""
        self.info, self.result_timeout, self.poll_spin = info, result_timeout, poll_spin
        self.micro_batches = micro_batches
        self.dispatched = [0] * micro_batches  # MoE layers sent, per micro-batch
        self.metrics = metrics or TierMetrics()
        self.load = LoadRecorder(name, info.moe_layers, info.num_experts, load_window,
                                 load_sinks)
        self.routing = routing
        self.tier = ClientTier(TierSettings(tuple(addresses), monitor, heartbeat, result_timeout,
                                            transport, expected_experts, wait_for_experts,
                                            micro_batches=micro_batches,
                                            adapter_slots=adapter_slots),
                               info, model, dtype, name, self.metrics,
                               load=self.load.message,  # the heartbeat's: the last window
                               adopted=lambda: self.view.epoch)
        self._lock = threading.Lock()  # the view in use, the staged one, in_step
        self._staged: View | None = None
        self.in_step = False
        self._first_layer = min(info.moe_layers)
        self._failed: dict[int, str] = {}  # token row -> why it could not be computed
        self._device_ok = True
        self._device_step: DeviceStep | None = None
        self._explicit_steps = False  # begin_step/end_step are called (SGLang's run_batch)
        self.esft = AdapterRouting(info.moe_layers, info.num_experts) if adapter_slots else None
        self.view = self.tier.start()
        self._install(self.view)
        self.tier.follow(self._offer)

    # -- views -----------------------------------------------------------------------------
    @property
    def table(self) -> RoutingTable:
        return self.view.table

    @property
    def connections(self) -> list[ServerConnection]:
        return list(self.view.connections.values())

    @property
    def _by_id(self) -> dict[str, ServerConnection]:
        return dict(self.view.connections)

    @property
    def device_step(self) -> DeviceStep | None:
        return self._device_step

    @device_step.setter
    def device_step(self, step: DeviceStep | None) -> None:
        """``None`` keeps this client on the host path (tests compare the two paths)."""
        self._device_ok = step is not None
        self._device_step = step

    @property
    def max_tokens(self) -> int:
        return min((c.layout.max_tokens for c in self.view.connections.values()), default=1)

    def stage(self, view: View | RoutingTable) -> None:
        """Use ``view`` from the next step on (now, if no step is under way), so every layer of
        a step sees one table, never half of two. A bare ``RoutingTable`` is viewed with this
        client's connections, which must include its servers."""
        if isinstance(view, RoutingTable):
            live = self.tier.live_connections()
            unknown = [s for s in view.servers if s not in live]
            if unknown:
                raise PlacementError(f"routing table {view.epoch} names servers {unknown} "
                                     "this client is not connected to")
            view = View(view, {s: live[s] for s in view.servers})
        if not self._offer(view):
            raise PlacementError(f"routing table {view.epoch} is not newer than the table in "
                                 f"use ({self.view.epoch})")

    def _offer(self, view: View) -> bool:
        """Stage ``view`` (install it, between steps); False if it is older than what this
        client has (views are built on several threads: the newest wins)."""
        with self._lock:
            newest = self._staged.epoch if self._staged is not None else self.view.epoch
            if view.epoch <= newest:
                return False
            if self.in_step:
                self._staged = view
            else:
                self._staged = None
                self._install(view)
            return True

    def _install(self, view: View) -> None:
        """Use ``view`` now (between steps, or after a failure narrowed the table)."""
        conns = list(view.connections.values())
        # the device path routes EP layers only (a TP layer's expansion is not built there)
        if (self._device_ok and conns and all(drives_devices(c) for c in conns)
                and not view.table.layouts):
            step = self._device_step
            if step is not None and step.drives(view):
                step.load_table(view.table)  # the same tensors: a captured graph stays valid
            else:
                self._device_step = DeviceStep(conns, view.table, self.result_timeout)
        else:
            self._device_step = None
        self.view = view
        self.metrics.view(view)

    def begin_step(self, explicit: bool = True) -> None:
        """A step starts: adopt a staged view; forget the last step's failures."""
        self._explicit_steps |= explicit
        self.load.begin_step()
        with self._lock:
            self.in_step = True
            self._failed = {}
            staged, self._staged = self._staged, None
            if staged is not None and staged.epoch > self.view.epoch:
                self._install(staged)

    def end_step(self) -> dict[int, str]:
        """The step is over: the token rows that could not be computed, and why; a view
        staged meanwhile is adopted now."""
        with self._lock:
            ended, self.in_step = self.in_step, False
            staged, self._staged = self._staged, None
            if staged is not None and staged.epoch > self.view.epoch:
                self._install(staged)
            failed, self._failed = self._failed, {}
        if ended:
            self.load.end_step()
        return failed

    def _view_for(self, layer_id: int) -> View:
        """The view this layer reads; without explicit steps, a step is everything from one
        first MoE layer to the next."""
        if layer_id == self._first_layer and not self._explicit_steps:
            self.end_step()
            self.begin_step(explicit=False)
        return self.view

    # -- the data path ---------------------------------------------------------------------
    def reroute(self, layer_id: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """The step's ``topk_ids`` (all its rows) with each ESFT adapter token's experts
        replaced by its adapter's (``esft/routing.py``); as given without adapters."""
        return topk_ids if self.esft is None else self.esft.reroute(layer_id, topk_ids)

    def forward(self, layer_id: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, row_offset: int = 0) -> torch.Tensor:
        """``sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` computed by the expert servers:
        ``combine(dispatch(...))``.

        Args:
            hidden: ``[T, H]``; topk_ids: ``[T, K]`` global expert ids; topk_weights: ``[T, K]``.
            row_offset: where these rows start in the step's batch (failed rows are recorded
                at ``row_offset + row``).
        Returns:
            ``[T, H]`` in ``hidden.dtype``: partial sums added in server order (deterministic).
            Rows that need an expert no live server holds lack that expert's share; they are
            recorded (``end_step``).
        """
        return self.combine(self.dispatch(layer_id, hidden, topk_ids, topk_weights, row_offset))

    def dispatch(self, layer_id: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor, row_offset: int = 0, micro_batch: int = 0
                 ) -> Dispatched:
        """Send the layer's rows (their first chunk of ``max_tokens``) to the expert servers
        and return at once; ``combine`` waits for the answers. ``micro_batch``: which of this
        client's slots per server carries them (two micro-batches may be in flight)."""
        assert 0 <= micro_batch < self.micro_batches, (micro_batch, self.micro_batches)
        self._view_for(layer_id)
        handle = Dispatched(layer_id, hidden, topk_ids, topk_weights, row_offset, micro_batch)
        self.dispatched[micro_batch] += 1
        self.metrics.dispatched(micro_batch)
        if self._device_step is None:  # the device path exchanges whole in combine
            ids = topk_ids.cpu().numpy()
            self.load.count(layer_id, ids)
            self._start_host(handle, ids)
        else:
            ids = topk_ids
            self.load.count(layer_id, topk_ids)
        if self.routing is not None:  # a copy: the data path may mark ids it cannot send
            self.routing.note(layer_id, ids.copy() if isinstance(ids, np.ndarray) else ids,
                              row_offset)
        return handle

    def _start_host(self, handle: Dispatched, ids: np.ndarray) -> None:
        """The host path from the first chunk: ``ids`` as the layer's layout routes them (a
        TP layer's entries expanded into one per part)."""
        table = self.view.table
        handle.parts = table.parts(handle.layer_id)
        handle.ids = table.expand(handle.layer_id, ids)
        handle.out = torch.zeros_like(handle.hidden)
        handle.step = self.max_tokens
        if handle.hidden.shape[0]:
            self._start_chunk(handle, 0)

    def combine(self, handle: Dispatched) -> torch.Tensor:
        """Wait for ``handle``'s answers (sending its later chunks, and again the entries of
        a server that failed) and return the sum, ``[T, H]``."""
        if handle.out is None:
            return self._forward_device(handle)
        while handle.chunk is not None:
            chunk = handle.chunk
            sent = handle.sent
            while True:
                self._collect(handle, chunk, sent)
                if not chunk.pending.any():
                    break
                sent = self._send(handle, chunk)
            handle.chunk = None
            if chunk.start + handle.step < handle.hidden.shape[0]:
                self._start_chunk(handle, chunk.start + handle.step)
        return handle.out

    def _start_chunk(self, handle: Dispatched, start: int) -> None:
        """Chunks of max_tokens consecutive rows, as the device path makes them, so that each
        server computes the same batches (and bits) on both paths."""
        rows = slice(start, start + handle.step)
        handle.chunk = Chunk(start, handle.ids[rows] >= 0)
        handle.sent = self._send(handle, handle.chunk, first=True)

    def _send(self, handle: Dispatched, chunk: Chunk, first: bool = False) -> list[Sent]:
        """Send every pending entry of ``chunk`` to a holder of its expert (of its part, in a
        TP layer: each server gets at most one part of an expert, so its entries fit ``[rows,
        K]`` as in EP). ``first``: the chunk's first send (its balance goes to ``metrics``;
        a re-send's does not)."""
        layer_id, rows = handle.layer_id, slice(chunk.start, chunk.start + handle.step)
        table, conns = self.view.table, self.view.connections
        if table.parts(layer_id) != handle.parts:
            # the layer's layout changed under it (a refusal brought a newer table, or a loss):
            # its parts' sums and whole experts' do not mix, so the chunk starts again in the
            # new layout (its rows of ``out`` hold only its own sums; every answer sent for it
            # has been collected or given up on)
            handle.parts = table.parts(layer_id)
            handle.ids = table.expand(layer_id, handle.topk_ids.cpu().numpy())
            handle.out[rows].zero_()
            chunk.pending = handle.ids[rows] >= 0
        parts, handle.epoch = handle.parts, self.view.epoch
        ids, hidden, weights = handle.ids[rows], handle.hidden[rows], handle.topk_weights[rows]
        server_of = table.assign(layer_id, np.where(chunk.pending, ids, -1))
        if first:
            self.metrics.exchange(layer_id, server_of, len(table.servers))
        orphans = server_of == NO_HOLDER
        if orphans.any():
            self._record_orphans(layer_id, ids // parts, orphans, handle.row_offset + chunk.start)
            chunk.pending &= ~orphans
        sent = []
        for index in np.unique(server_of[chunk.pending & (server_of >= 0)]).tolist():
            conn = conns[table.servers[index]]
            mask = server_of == index
            picked = np.flatnonzero(mask.any(axis=1))
            chosen = np.where(mask, ids, -1)[picked]
            if parts > 1:  # one part per (token, k) at most: the one held here
                chosen = chosen.reshape(picked.size, -1, parts).max(axis=2)
            chosen = torch.from_numpy(chosen.astype(np.int32))
            if picked.size == len(ids):  # every row of the chunk: no gather, no scatter
                rows_of: torch.Tensor | slice = slice(chunk.start, chunk.start + picked.size)
                sent_hidden, sent_weights = hidden.contiguous(), weights.contiguous()
            else:
                picked_t = torch.from_numpy(picked).to(hidden.device)
                rows_of = picked_t + chunk.start
                sent_hidden, sent_weights = hidden[picked_t], weights[picked_t]
            try:
                conn.slots[handle.micro_batch].send(layer_id, sent_hidden, chosen,
                                                    sent_weights.float(), ring=False,
                                                    parts=parts)
                conn.in_flight += 1
                self.metrics.sent(conn.address)
            except (TransportError, ProtocolError) as exc:
                self._lose(conn, f"sending failed: {exc}", report=True)
                continue
            sent.append(Sent(conn, rows_of, mask))
        for conn, _, _ in sent:  # every request is published before any server wakes
            try:
                conn.slots[handle.micro_batch].ring()
            except TransportError as exc:  # a server that sleeps through it is timed out
                self._lose(conn, f"ringing failed: {exc}", report=True)
        return sent

    def _collect(self, handle: Dispatched, chunk: Chunk, sent: list[Sent]) -> None:
        """Add what ``sent`` brings back; a server that fails leaves its entries pending."""
        for conn, rows, mask in sent:
            slot = conn.slots[handle.micro_batch]
            try:
                why = self._wait(conn, slot, handle.layer_id)
                if why is not None:
                    self._lose(conn, why, report=conn.lost_why is None)
                    continue
                try:
                    result = slot.result()
                except Rejected as exc:
                    if exc.reason not in NOT_HELD:
                        raise TransportError(f"expert server {conn.address}: {exc}") from None
                    # its holdings changed: the entries go again by a newer table. Again if
                    # that one still has it holding them (a view newer for another change,
                    # made before the monitor had this one's: under back-to-back operations),
                    # each time a newer table; none within the result timeout: it is lost
                    if not self._adopt_newer(handle.layer_id, handle.epoch):
                        self._lose(conn, f"refused MoE layer {handle.layer_id}'s experts "
                                   f"({exc.reason.name}) and no newer table came", report=False)
                    continue
                except ProtocolError as exc:  # answered, wrongly: a bug to see, not to hide
                    raise TransportError(f"expert server {conn.address}: {exc}") from None
                if isinstance(rows, slice):
                    handle.out[rows].add_(result.to(handle.out.device))
                else:
                    handle.out.index_add_(0, rows, result.to(handle.out.device))
                chunk.pending &= ~mask
            finally:
                conn.in_flight -= 1

    def _wait(self, conn: ServerConnection, slot: ClientSlot, layer_id: int) -> str | None:
        """Wait for ``conn``'s answer; ``None`` once it is there, else why it will not come."""
        deadline = time.monotonic() + self.result_timeout
        spin = self.poll_spin
        while True:
            remaining = deadline - time.monotonic()
            if slot.wait(max(0.0, min(WAIT_SLICE, remaining)), spin):
                return None
            spin = 0.0
            if conn.lost_why is not None:
                return conn.lost_why
            if remaining <= 0:
                self.metrics.timeout(conn.address)
                return f"did not answer MoE layer {layer_id} within {self.result_timeout:g}s"

    def _adopt_newer(self, layer_id: int, sent_with: int) -> bool:
        """A server refused experts this client's table says it holds: it stopped holding
        them (it says so before it frees them, and frees them only once no request came for a
        while, so this is a client that lagged). Wait for the view that says so (the tier
        thread brings it) and use it now; False if none came within the result timeout. A view
        newer than ``sent_with`` (the epoch the refused entries were sent by) already in use
        counts: the other micro-batch's refusal may have installed it."""
        deadline = time.monotonic() + self.result_timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.view.epoch > sent_with:
                    return True
                staged, self._staged = self._staged, None
                if staged is not None and staged.epoch > self.view.epoch:
                    self._install(staged)
                    return True
            time.sleep(WAIT_SLICE / 10)
        return False

    def _lose(self, conn: ServerConnection, why: str, report: bool) -> None:
        """Drop ``conn`` now: the rest of this step uses a table without it."""
        view = self.tier.lose(conn, why, report)
        with self._lock:
            if self._staged is not None and self._staged.epoch < view.epoch:
                self._staged = None  # built before the loss: it may still hold ``conn``
            if view.epoch > self.view.epoch:
                self._install(view)

    def _record_orphans(self, layer_id: int, ids: np.ndarray, orphans: np.ndarray,
                        first_row: int) -> None:
        untrusted = set(self.view.table.untrusted.get(layer_id, ()))
        for row in np.flatnonzero(orphans.any(axis=1)).tolist():
            experts = sorted(set(ids[row][orphans[row]].tolist()))
            self._failed.setdefault(first_row + row, (
                f"experts {experts} of MoE layer {layer_id} are ESFT adapter experts that two "
                "expert servers describe differently (two adapters placed under one id at once)"
                if untrusted.issuperset(experts) else
                f"experts {experts} of MoE layer {layer_id} have no live expert server"))

    def note_orphans(self, layer_id: int, topk_ids: torch.Tensor, row_offset: int = 0) -> None:
        """Record every row of ``topk_ids`` (with attention TP: the whole batch, not only this
        rank's share) that needs an expert no live server holds (a host read, only when the
        table in use has such an expert)."""
        table = self.view.table
        if table.missing.get(layer_id) or table.untrusted.get(layer_id):
            parts = table.parts(layer_id)
            ids = table.expand(layer_id, topk_ids.cpu().numpy())
            self._record_orphans(layer_id, ids // parts, table.assign(layer_id, ids) == NO_HOLDER,
                                 row_offset)

    def _forward_device(self, handle: Dispatched) -> torch.Tensor:
        """The device exchange; a failed server is dropped and the layer run again without it
        (eager mode: the check reads the status after the layer)."""
        h = handle
        while True:
            self.note_orphans(h.layer_id, h.topk_ids, h.row_offset)
            try:
                return self._device_step.forward(h.layer_id, h.hidden, h.topk_ids,
                                                 h.topk_weights)
            except DeviceFailure as failure:
                if failure.unanswered != set(failure.servers):
                    raise  # answered wrongly: a bug to see, not to route around
                for address, why in failure.servers.items():
                    conn = self.view.connections.get(address)
                    if conn is not None:
                        self._lose(conn, why, report=True)
                if self._device_step is None:  # no server left on the device path: the host's
                    self._start_host(h, h.topk_ids.cpu().numpy())
                    return self.combine(h)

    def close(self) -> None:
        self.load.close_window()  # the steps since the last window
        self.tier.close()
