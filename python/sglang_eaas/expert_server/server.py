"""``ExpertServer``: polls its slots, batches ready requests, runs experts, publishes results."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import ibgda
from sgl_kernel_ext import cpu_ops
from sglang_eaas import transports
from sglang_eaas.checkpoint import expert_digests
from sglang_eaas.expert_server.compute import local_experts, weighted_expert_sum
from sglang_eaas.expert_server.control import control_endpoint
from sglang_eaas.expert_server.expert_load import ExpertLoad
from sglang_eaas.expert_server.fabric import WeightExports
from sglang_eaas.expert_server.held import HeldExperts
from sglang_eaas.expert_server.replicas import Replicas
from sglang_eaas.expert_server.weight_store import WeightStore
from sglang_eaas.holdings import ServerHoldings
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.membership import HEARTBEAT
from sglang_eaas.protocol import ProtocolError, RegionLayout, SlotLayout, SlotState
from sglang_eaas.protocol.header import HeaderError, RejectReason, RequestHeader
from sglang_eaas.protocol.control import Drain, JoinReply, JoinRequest, ServerStats
from sglang_eaas.protocol.lines import ControlError, shown
from sglang_eaas.protocol.slot import (
    DTYPE_CODES, DTYPES_BY_NAME, POLL_SPIN_US, ServerSlot, dtype_name,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertServerConfig:
    model_path: str
    experts: tuple[int, ...]  # held in every MoE layer, except where layer_experts says
    host: str = "127.0.0.1"
    port: int = 0
    token: str = ""  # shared secret clients must present on the control endpoint
    dtype: str = "auto"  # weights dtype, any spelling SGLang accepts; "auto" = the checkpoint's
    transport: str = "auto"  # an ibgda backend, or auto (sglang_eaas.transports)
    max_clients: int = 8
    max_tokens: int = 2048  # per request; clients split larger batches
    min_batch_tokens: int = 1
    max_wait_us: int = 0
    poll_spin_us: int = POLL_SPIN_US  # busy-poll this long after the last request, then sleep
    threads: int = 1
    layer_experts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # per-layer override
    monitor: str = ""  # HOST:PORT or etcd://HOST:PORT of the monitor to register with, or none
    heartbeat: float = HEARTBEAT  # seconds between heartbeats to the monitor
    kernel: str = "fast"  # the expert math: "fast" (C++ grouped kernel) or "reference" (compute)
    shrink: bool = True  # fast kernel: walk only the active experts (False: all, an ablation)
    weight_fabric: str = "map"  # fabric.MODES: map (zero-copy where it can) | copy | off
    spare_experts: int = -1  # spare rows per MoE layer's region; -1: spare_rows() decides
    fill_threads: int = 0  # threads copying a fill's rows; 0: min(cores, FILL_THREADS)
    part: tuple[int, int] | None = None  # (p, P): hold part p of P of those experts instead

    def holdings(self, moe_layers: tuple[int, ...]) -> ServerHoldings:
        """Which experts this server holds in each MoE layer (possibly none in some): whole,
        or (``part``) that part of each, as routed part ids."""
        experts = {layer: self.layer_experts.get(layer, self.experts) for layer in moe_layers}
        if self.part is None:
            return ServerHoldings(experts)
        p, parts = self.part
        return ServerHoldings({layer: () for layer in moe_layers},
                              parts={layer: (parts, [e * parts + p for e in ids])
                                     for layer, ids in experts.items()})


FILL_THREADS = 8  # the most threads a fill copies with by default


def spare_rows(config: ExpertServerConfig, info: MoeModelInfo) -> int:
    """Spare rows per MoE layer's region (``--spare-experts``): by default a quarter of the
    most experts held in a layer (at least 2); for a server holding none (standby), a quarter
    of the model's experts, the share of one server in a four-server tier."""
    if config.spare_experts >= 0:
        return config.spare_experts
    most = max(map(len, config.holdings(info.moe_layers).values()), default=0)
    return max(2, -(-(most or info.num_experts) // 4))


def fill_threads(config: ExpertServerConfig) -> int:
    return config.fill_threads or max(1, min(os.cpu_count() or 1, FILL_THREADS))


def fabric_transport(slots: ibgda.Transport, mode: str) -> ibgda.Transport | None:
    """The transport a server keeps its weights in (``--weight-fabric``; None: plain memory):
    the slots' own, except that weights on a ``device`` server's host stay in ``shm`` here (on
    a GPU node they would be device memory shared over CUDA IPC: docs/elastic.md)."""
    if mode == "off":
        return None
    return ibgda.create_transport("shm") if slots.name == "device" else slots


@dataclass
class _Ready:
    index: int
    slot: ServerSlot
    header: RequestHeader
    hidden: torch.Tensor
    local_experts: torch.Tensor  # [T * K] local rows, -1 = skip
    router_weights: torch.Tensor


class ExpertServer:
    """Stateless: everything it knows about a client is the slot the client writes into."""

    def __init__(self, config: ExpertServerConfig):
        self.config = config
        torch.set_num_threads(config.threads)
        if config.kernel == "fast":
            cpu_ops.ops()  # built and loaded now, not at the first request (KernelUnavailable)
        self.info = MoeModelInfo.from_model_path(config.model_path)
        self.dtype = DTYPES_BY_NAME[dtype_name(
            self.info.dtype if config.dtype == "auto" else config.dtype)]
        self.transport = transports.create_server_transport(
            transports.server_backend(config.transport, config.host), config.host)
        self.held = HeldExperts(
            config.model_path, self.info, config.holdings(self.info.moe_layers),
            WeightStore(fabric_transport(self.transport, config.weight_fabric), self.info,
                        self.dtype, spare_rows(config, self.info)), self._announce)
        if not self.held.holdings.holds_any():  # standby: warm for its first fill, which
            self.held.store.reserve(len(self.info.moe_layers))  # lands in faulted-in memory
            self.held.learn_digests(expert_digests(config.model_path, self.info))  # checked
        self.exports = None  # WeightExports, once the control endpoint has its address
        self.region_layout = RegionLayout.for_requests(
            config.max_clients, config.max_tokens, self.info.hidden_size, self.info.top_k)
        self.region = self.transport.create_region(self.region_layout.size)
        for index in range(config.max_clients):
            self.region.store_flag(self.region_layout.base(index), SlotState.OFFLINE)
        self._lock = threading.Lock()
        self._active: dict[int, ServerSlot] = {}  # replaced, never mutated: the loop reads it
        self._members: dict[int, Membership] = {}  # every reserved or active slot's holder
        # When each slot was last given back: a free slot is reused least recently first, so
        # the slot of a client that was lost (not closed: it may come back and write) is
        # handed to another client as late as possible.
        self._freed_at: dict[int, float] = {}
        # Each join's requests count in a range of their own (join number << 32), so an answer
        # still in flight for a slot's previous client can never pass for the new client's.
        self._joins = itertools.count(1)
        self.stats: collections.Counter[str] = collections.Counter()
        try:
            self.control = control_endpoint(self, config.host, config.port, config.token)
        except OSError as exc:  # the port taken, the host not this machine's
            self.region.close()
            raise ibgda.TransportError(f"cannot listen on {config.host}:{config.port}: "
                                       f"{exc.strerror or exc}") from None
        self.exports = WeightExports(self.held, self.address)
        self._stop = threading.Event()
        self.tick = time.monotonic()  # the serving loop's last pass (``healthy``)
        self.tier = None  # expert_server.tier.ServerTier, with a monitor
        self.fill_threads = fill_threads(config)
        self.replicas = Replicas(self)  # holdings changed while serving
        self.epoch = 0  # the newest operation lease epoch obeyed (``obey``)

    @property
    def address(self) -> str:
        return self.control.address

    def _announce(self, holdings: ServerHoldings) -> None:
        """What it holds changed: tell the monitor (its clients then change their tables)."""
        if self.tier is not None:
            self.tier.presence.set_holdings(holdings)

    # -- control plane -------------------------------------------------------------------
    def obey(self, epoch: int) -> None:
        """A holdings change sent under the operation lease of ``epoch`` (0: outside the
        tier controller): ``ControlError("stale_epoch")`` if a newer lease changed this server
        already (the sender's lease lapsed and another operation holds the tier), else it is
        the newest, remembered and told to the monitor at the next registration."""
        with self._lock:
            if epoch and epoch < self.epoch:
                raise ControlError("stale_epoch", (
                    f"expert server {self.address} obeyed operation epoch {self.epoch} "
                    f"already; a change under epoch {epoch} comes from an operation whose "
                    "lease lapsed (another operation holds the tier)"))
            if epoch <= self.epoch:
                return
            self.epoch = epoch
        if self.tier is not None:
            self.tier.presence.set_epoch(epoch)

    def join(self, request: JoinRequest, connection: Any = None
             ) -> tuple[JoinReply, "Membership"]:
        """Reserve a slot for a client; it serves only once the client confirms (``ready``).

        Raises ``ControlError`` (counted by its reason) for a client of another model, other
        expert weights, another transport or dtype, or when every slot is taken.
        """
        if request.fingerprint != self.info.fingerprint():
            raise ControlError("join_other_model", (
                f"expert server {self.address} serves {self.config.model_path} "
                f"({self.info.model_type}, {self.info.num_experts} experts, hidden "
                f"{self.info.hidden_size}), which does not match the client's model"))
        if len(request.expert_digests) != self.info.num_experts:
            raise ControlError("bad_field", f"expert_digests must have one entry per expert "
                               f"({self.info.num_experts}), got {len(request.expert_digests)}")
        differ = [e for e, d in self.held.digests.items() if request.expert_digests[e] != d]
        if differ:
            raise ControlError("join_other_weights", (
                f"expert server {self.address} holds other weights for experts {differ} than "
                f"the client's checkpoint: {self.config.model_path} is another checkpoint of "
                "the same shape"))
        if request.transport not in (transports.AUTO, self.transport.name):
            raise ControlError("join_other_transport", (
                f"expert server {self.address} offers transport {self.transport.name!r}, the "
                f"client asked for {shown(request.transport)}; start the server with "
                f"--transport {shown(request.transport)} or the client with --eaas-transport "
                f"{self.transport.name} (or auto)"))
        dtype = DTYPES_BY_NAME.get(request.dtype)
        if dtype is None:
            raise ControlError("bad_field", f"unsupported dtype {shown(request.dtype)} (expected "
                               f"one of {', '.join(DTYPES_BY_NAME)})")
        if self.tier is not None and self.tier.draining:
            raise ControlError("join_draining", f"expert server {self.address} is draining")
        layout = SlotLayout(self.config.max_tokens, self.info.hidden_size, self.info.top_k,
                            DTYPE_CODES[dtype])
        with self._lock:
            free = [i for i in range(self.config.max_clients) if i not in self._members]
            if not free:
                raise ControlError("join_full", (
                    f"expert server {self.address} has all {self.config.max_clients} client "
                    "slots taken; start it with a larger --max-clients"))
            index = min(free, key=lambda i: self._freed_at.get(i, 0.0))
            first_seq = next(self._joins) << 32
            slot = ServerSlot(self.region, self.region_layout.base(index), layout)
            member = Membership(self, index, slot, request.client, first_seq, connection,
                                request.incarnation)
            self._members[index] = member  # reserved: not polled until 'ready'
        reply = JoinReply(slot=index, region=self.region.handle.to_dict(), base=slot.base,
                          bell=self.region_layout.bell, layout=layout,
                          holdings=self.held.holdings, moe_layers=list(self.info.moe_layers),
                          first_seq=first_seq)
        return reply, member

    def stats_record(self) -> ServerStats:
        held, control = self.held, self.control.counters()
        return ServerStats(
            fingerprint=self.info.fingerprint(), pid=os.getpid(),
            num_experts=self.info.num_experts, weight_bytes=held.weight_bytes(),
            expert_digests=dict(held.digests), holdings=held.holdings,
            adapter_paths=dict(held.adapter_paths), clients=self.client_count(),
            slots=len(self._active), expert_load=self.expert_load.per_expert(),
            control_refused=control["control_refused"],
            refused_connections=control["refused_connections"],
            counters={**self.stats, **held.counters, "retiring": held.retiring_count(),
                      "operation_epoch": self.epoch},
            **({} if self.tier is None else self.tier.counters()))

    def load(self) -> dict[str, Any]:
        """What the heartbeat tells the monitor (``status`` shows it); ``expert_load``: per
        MoE layer [tokens, ns, busiest expert, its ns] (``ExpertLoad.summary``); ``busy_us``:
        microseconds spent serving batches (the autoscaler's utilisation)."""
        return {"requests": self.stats["requests"], "tokens": self.stats["tokens"],
                "busy_us": self.stats["busy_us"],
                "clients": self.client_count(), "expert_load": self.expert_load.summary()}

    @functools.cached_property
    def expert_load(self) -> ExpertLoad:
        """Tokens and compute time per (MoE layer, expert) since the start."""
        return ExpertLoad(self.info.moe_layers, self.info.num_experts)

    def client_count(self) -> int:
        """Clients using this server now (one control connection each, holding 1-2 slots)."""
        with self._lock:
            members = list(self._members.values())
        return len({id(m.connection) if m.connection is not None else id(m)
                    for m in members if m.active and not m.released})

    def healthy(self, stall: float = 5.0) -> bool:
        """Whether the serving loop passed within ``stall`` seconds (it passes at least every
        10 ms when idle; a long batch is the only other reason for a gap)."""
        return time.monotonic() - self.tick < stall

    def clients_lost(self, clients: set[tuple[str, str]]) -> None:
        """The monitor lost these clients, ``(id, incarnation)`` (dead or hung): take their
        slots back now, and close their control connections, without waiting for TCP."""
        with self._lock:
            lost = [m for m in self._members.values()
                    if m.incarnation and (m.client, m.incarnation) in clients]
        for member in lost:
            logger.warning("client %s was lost: slot %d taken back", member.client, member.index)
            self.stats["clients_lost"] += 1
            member.disconnect()  # first: a client that sees its connection open owns its slot
            member.release()

    def drain(self, request: Drain) -> int:
        """Leave the tier gracefully (``protocol/control.py``'s ``Drain``); the number of
        clients still using the server."""
        if self.tier is None:
            raise ControlError("drain_needs_monitor", (
                f"expert server {self.address} has no monitor, so its clients would not learn "
                "that it leaves; start it with --monitor, or stop it"))
        self.tier.drain(request.force, request.timeout)
        return len(self._active)

    # -- data plane ----------------------------------------------------------------------
    def _collect(self, taken: set[int] = frozenset()) -> list[_Ready]:
        """Validate every ready slot not in ``taken``; reject bad requests at once.

        A slot is read under the membership lock, and only while it is still the one active at
        its index: the snapshot this loop walks may predate a leave and a new join of that
        index, whose client may have published already (its request would be read with the
        old client's layout and sequence number)."""
        ready = []
        for index, slot in self._active.items():
            if index in taken or not slot.ready():
                continue
            with self._lock:
                if self._active.get(index) is not slot:
                    continue  # its client left; the next pass sees the new one
                try:
                    header, hidden, ids, weights = slot.request()
                    if hidden.device.type != "cpu":  # slots in GPU memory (device transport
                        # on a GPU node): the experts are computed on the CPU, from a copy
                        hidden, ids, weights = hidden.cpu(), ids.cpu(), weights.cpu()
                    layer = self.held.served(header.layer_id, header.parts)
                    if layer is None:
                        raise HeaderError(RejectReason.UNKNOWN_LAYER, f"layer {header.layer_id}"
                                          + (f" in {header.parts} parts" if header.parts > 1
                                             else ""))
                    try:
                        local = local_experts(layer, ids)
                    except ValueError as exc:
                        raise HeaderError(RejectReason.FOREIGN_EXPERT, str(exc)) from None
                    self.held.used(header.layer_id, ids, header.parts)
                    ready.append(_Ready(index, slot, header, hidden, local, weights))
                except HeaderError as exc:
                    self.stats[f"rejected_{exc.reason.name.lower()}"] += 1
                    logger.warning("rejected a request in slot at %d: %s", slot.base, exc)
                    self._answer(slot.reject, exc.reason)
        return ready

    def _answer(self, publish: Callable, *args) -> None:
        try:
            publish(*args)
        except ProtocolError as exc:  # the client left meanwhile
            self.stats["answers_dropped"] += 1
            logger.info("answer dropped: %s", exc)

    def _reply(self, r: _Ready, rows: torch.Tensor | None) -> None:
        """Write ``rows`` into ``r``'s slot and publish them (``None``: reject SERVER_ERROR),
        under the membership lock and only while ``r``'s slot is still the one active at its
        index: its client may have left during the computation and another joined the index,
        whose slot (another dtype, other offsets) the old answer must not touch."""
        with self._lock:
            if self._active.get(r.index) is not r.slot:
                self.stats["answers_dropped"] += 1
                return
            if rows is None:
                self._answer(r.slot.reject, RejectReason.SERVER_ERROR)
            else:
                r.slot.result_buffer(rows.shape[0]).copy_(rows)
                self._answer(r.slot.publish, r.header.seq, rows.shape[0])

    def _run(self, batch: list[_Ready]) -> None:
        began = time.perf_counter()
        # a layer's whole experts and its parts (a switch holds both) are computed apart
        by_layer: dict[tuple[int, int], list[_Ready]] = collections.defaultdict(list)
        for r in batch:
            by_layer[r.header.layer_id, max(1, r.header.parts)].append(r)
        for (layer_id, parts), requests in by_layer.items():
            try:
                layer = self.held.served(layer_id, parts)
                out = weighted_expert_sum(
                    layer, _cat([r.hidden.to(self.dtype) for r in requests]),
                    _cat([r.local_experts for r in requests]),
                    _cat([r.router_weights for r in requests]),
                    kernel=self.config.kernel, shrink=self.config.shrink,
                    expert_load=self.expert_load.of(layer_id, layer),
                )
            except Exception:  # a bug must cost these requests, not the server
                logger.exception("computing layer %d failed", layer_id)
                self.stats["rejected_server_error"] += len(requests)
                for r in requests:
                    self._reply(r, None)
                continue
            start = 0
            for r in requests:
                self._reply(r, out[start : start + r.header.num_tokens])
                start += r.header.num_tokens
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        self.stats["tokens"] += sum(r.header.num_tokens for r in batch)
        # time spent serving batches: its share of wall time is the server's utilisation
        self.stats["busy_us"] += int((time.perf_counter() - began) * 1e6)

    def poll_once(self) -> int:
        """Serve what is ready now (waiting up to ``max_wait_us`` for a minimum batch)."""
        self.held.apply_swaps()
        batch = self._collect()
        if not batch:
            return 0
        deadline = time.perf_counter() + self.config.max_wait_us * 1e-6
        while (sum(r.header.num_tokens for r in batch) < self.config.min_batch_tokens
               and time.perf_counter() < deadline):
            batch += self._collect({r.index for r in batch})
        self._run(batch)
        return len(batch)

    def start(self) -> None:
        """Open the control endpoint, then register with the monitor (if any), which asks
        that endpoint whether this server holds what it registers."""
        self.control.thread.start()
        if self.config.monitor:
            from sglang_eaas.expert_server.tier import ServerTier

            self.tier = ServerTier(self)  # before it registers: changes from then on are said
            self.tier.start()

    def serve_forever(self) -> None:
        """Serve until ``stop()``; between requests, sleep on the doorbell clients ring
        (after ``poll_spin_us`` of busy polling that yields the core between polls)."""
        if not self.control.thread.is_alive():
            self.start()
        bell, spin = self.region_layout.bell, self.config.poll_spin_us * 1e-6
        busy_until = 0.0
        self.held.serving(True)
        while not self._stop.is_set():
            self.tick = time.monotonic()
            seen = self.region.load_word(bell)
            if self.poll_once():
                busy_until = time.perf_counter() + spin
            else:
                # Sleeps bounded, so that stop() and clients that cannot ring are noticed.
                self.region.idle(bell, seen, busy_until, 0.01)
        self.held.serving(False)

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        self.control.close()
        self.replicas.fabric.close()
        self.region.close()


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


class Membership:
    """A client's hold on one slot: reserved at join, serving after ``ready``, freed on release.

    Only a confirmed client's slot is polled, and whatever step fails, ``release`` returns the
    slot to the pool: nothing stays half-registered and the client can simply join again.
    """

    def __init__(self, server: ExpertServer, index: int, slot: ServerSlot, client: str,
                 first_seq: int, connection: Any = None, incarnation: str = ""):
        self.server, self.index, self.slot, self.client = server, index, slot, client
        self.first_seq, self.connection, self.incarnation = first_seq, connection, incarnation
        self.active = self.released = False

    def activate(self) -> None:
        server = self.server
        with server._lock:
            if self.released:
                raise ControlError("out_of_order", "this slot was taken back before 'ready'")
            # The client has had the slot mapped since its join, and a misbehaving one may have
            # written the flag before 'ready'; the slot goes OFFLINE first, or it would refuse
            # every later client it is offered to.
            self.slot.reclaim()
            self.slot.open(self.first_seq)
            server._active = {**server._active, self.index: self.slot}
            server.stats["clients_joined"] += 1
            self.active = True
        logger.info("client %s joined slot %d", self.client, self.index)

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        server = self.server
        with server._lock:
            if self.released:
                return
            self.released = True
            if server._members.get(self.index) is self:
                del server._members[self.index]
                server._freed_at[self.index] = time.monotonic()
            if self.active:
                server._active = {k: v for k, v in server._active.items() if k != self.index}
                self.slot.reclaim()
                server.stats["clients_left"] += 1
        if self.active:
            logger.info("client %s left slot %d", self.client, self.index)

    def disconnect(self) -> None:
        """Close the client's control connection (its session then ends)."""
        if self.connection is not None:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
