"""The two ends of one slot: ``ClientSlot`` (requests in, results out) and ``ServerSlot``.

The slot lives in the server's memory. The server sees it as an ``ibgda.LocalRegion``; the
client reaches it one-sidedly through an ``ibgda.RemoteRegion`` of any backend. The ordering
rule is always the same: payload and header, then the flag (release); the reader loads the
flag (acquire), then the header. After publishing, the writer rings the reader's doorbell (a
u32 the reader can sleep on, on backends with wake-ups): the server's region-wide bell for a
request, the slot's own bell for a result.
"""

from __future__ import annotations

import torch

from ibgda import LocalRegion, RemoteRegion
from ibgda.region import Write
from sglang_eaas.protocol.flags import Actor, ProtocolError, SlotState, check_transition
from sglang_eaas.protocol.header import (
    HEADER_BYTES, DType, HeaderError, RejectReason, RequestHeader, ResultHeader, ResultStatus,
)
from sglang_eaas.protocol.layout import SlotLayout

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16,
                DType.FLOAT16: torch.float16}
DTYPE_CODES = {v: k for k, v in TORCH_DTYPES.items()}
# The names used in join messages, and every spelling SGLang's --dtype accepts for them.
DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES_BY_NAME.items()}
DTYPE_SPELLINGS = {**{name: name for name in DTYPES_BY_NAME}, "float": "float32", "half": "float16"}


def dtype_name(spelling: str) -> str:
    """The canonical name of a dtype spelled as SGLang's ``--dtype`` accepts it (any case)."""
    name = DTYPE_SPELLINGS.get(spelling.lower())
    if name is None:
        raise ValueError(f"unknown dtype {spelling!r} (expected one of "
                         f"{', '.join(DTYPE_SPELLINGS)})")
    return name
# How long either end busy-polls (yielding the core between polls) before it sleeps on a
# doorbell: a futex wake-up costs tens of microseconds, a poll under one (docs/protocol.md).
POLL_SPIN_US = 2000


def request_header(layout: SlotLayout, layer_id: int, tokens: int, seq: int,
                   parts: int = 1) -> bytes:
    """The packed header of a request of ``tokens`` tokens for ``layer_id`` in a ``layout`` slot
    (``parts``: the layer's experts routed in that many parts, ``RequestHeader.parts``)."""
    return RequestHeader(layer_id, tokens, layout.top_k, layout.hidden_size, layout.dtype, seq,
                         layout.payload_bytes(tokens), parts).pack()


def request_writes(layout: SlotLayout, base: int, hidden: torch.Tensor,
                   expert_ids: torch.Tensor, router_weights: torch.Tensor,
                   header: torch.Tensor) -> list[Write]:
    """A request's sections for ``RemoteRegion.put_signal`` (payload, then header), in the
    slot's dtypes."""
    return [(base + layout.hidden, hidden.to(TORCH_DTYPES[layout.dtype])),
            (base + layout.expert_ids, expert_ids.to(torch.int32)),
            (base + layout.router_weights, router_weights.to(torch.float32)),
            (base + layout.request_header, header)]


class Rejected(ProtocolError):
    """The server refused the request; ``reason`` says why (``RejectReason``)."""

    def __init__(self, reason: RejectReason, seq: int):
        super().__init__(f"server rejected request {seq}: {reason.name}")
        self.reason = reason


class ClientSlot:
    """The client's side: only it writes requests and reads results.

    It mirrors the flag locally (only the server moves it, and only from CLIENT_WRITE_DONE to
    SERVER_DONE, which ``wait`` observes), so sending costs no remote read. Where the region is
    mapped into this process (``shm``) every section is written and read through typed views
    made once, so a round trip costs a few tensor ops beyond the copies themselves.
    """

    def __init__(self, region: RemoteRegion, base: int, layout: SlotLayout, server_bell: int,
                 first_seq: int = 0):
        """``first_seq``: the join's sequence base; the first request is ``first_seq + 1``."""
        self.region, self.base, self.layout = region, base, layout
        self.server_bell, self.seq = server_bell, first_seq
        self.dtype = TORCH_DTYPES[layout.dtype]
        self.state = SlotState.EMPTY
        self._tokens = 0
        self._flag, self._bell = base + layout.flag, base + layout.bell
        self._answer_at = base + layout.result_header
        self._inbox = torch.empty(0, dtype=torch.uint8)  # result header + result, grown on use
        slot = region.mapped(base, layout.size)
        self._views = None if slot is None else _SlotViews(slot, layout)

    def _move(self, new: SlotState) -> None:
        check_transition(Actor.CLIENT, self.state, new)
        self.state = new

    def send(self, layer_id: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
             router_weights: torch.Tensor, ring: bool = True, parts: int = 1) -> None:
        """Publish a request: payload and header, then CLIENT_WRITE_DONE, in one put.

        Args:
            hidden: ``[T, hidden_size]``, ``T <= max_tokens`` (cast to the slot dtype).
            expert_ids: ``[T, top_k]`` integer global expert ids, -1 where not for this server.
            router_weights: ``[T, top_k]`` float router weights.
            ring: wake the server now; ``False``: the caller calls ``ring`` (a client that
                sends to several servers publishes every request before it wakes any, so a
                woken server cannot take the core before the others have their requests).
            parts: the layer is routed in that many parts (``expert_ids`` are then routed part
                ids ``e * parts + p``; ``RequestHeader.parts``).
        """
        layout, tokens = self.layout, hidden.shape[0]
        if (tokens > layout.max_tokens or tuple(hidden.shape) != (tokens, layout.hidden_size)
                or tuple(expert_ids.shape) != (tokens, layout.top_k)
                or tuple(router_weights.shape) != (tokens, layout.top_k)):
            raise ProtocolError(f"request of {tokens} tokens does not fit slot {layout}")
        check_transition(Actor.CLIENT, self.state, SlotState.CLIENT_WRITE_DONE)
        self.seq += 1
        header = request_header(layout, layer_id, tokens, self.seq, parts)
        views = self._views
        if views is not None:  # the same put, through this process's mapping
            views.hidden[:tokens].copy_(hidden)
            views.expert_ids[:tokens].copy_(expert_ids)
            views.router_weights[:tokens].copy_(router_weights)
            views.request_header.write(header)
            self.region.store_flag(self._flag, SlotState.CLIENT_WRITE_DONE)
        else:
            header_bytes = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            self.region.put_signal(request_writes(layout, self.base, hidden, expert_ids,
                                                  router_weights, header_bytes),
                                   self._flag, SlotState.CLIENT_WRITE_DONE)
        self.state, self._tokens = SlotState.CLIENT_WRITE_DONE, tokens
        if ring:
            self.ring()

    def ring(self) -> None:
        """Ring the server's doorbell: a server asleep on it wakes and reads its slots."""
        self.region.notify(self.server_bell)

    def wait(self, timeout: float, spin: float = POLL_SPIN_US * 1e-6) -> bool:
        """Wait until the server published (True) or ``timeout`` seconds passed (False),
        busy-polling for the first ``spin`` seconds, then sleeping on the slot's doorbell."""
        if self.state == SlotState.CLIENT_WRITE_DONE and self.region.wait_flag(
                self._flag, SlotState.SERVER_DONE, timeout, self._bell, spin):
            self.state = SlotState.SERVER_DONE
        return self.state == SlotState.SERVER_DONE

    def result(self) -> torch.Tensor:
        """The ``[T, hidden_size]`` result of the last request, after ``wait``; valid until the
        next ``send``. Where the region is mapped here (``shm``) it is a view of the slot
        itself, no copy; elsewhere one read brings header and result together.

        Raises ``ProtocolError`` if the server rejected the request or answered another one.
        """
        if self.state != SlotState.SERVER_DONE:
            raise ProtocolError("result read before the server published it")
        tokens, views = self._tokens, self._views
        if views is not None:
            header, result = views.result_header.read(), views.result[:tokens]
        else:
            nbytes = HEADER_BYTES + tokens * self.layout.hidden_size * self.dtype.itemsize
            if self._inbox.numel() < nbytes:
                self._inbox = torch.empty(nbytes, dtype=torch.uint8)
            answer = self._inbox[:nbytes]
            # The result payload follows its header directly (SlotLayout): one read.
            self.region.read(self._answer_at, answer)
            header = answer[:HEADER_BYTES].numpy().tobytes()
            result = answer[HEADER_BYTES:].view(self.dtype).view(tokens, self.layout.hidden_size)
        answered = ResultHeader.unpack(header)
        if answered.status != ResultStatus.OK:
            raise Rejected(answered.reason, self.seq)
        if answered.seq != self.seq or answered.num_tokens != tokens:
            raise ProtocolError(f"result is for request {answered.seq} of "
                                f"{answered.num_tokens} tokens, expected {self.seq} of {tokens}")
        return result

    def leave(self) -> None:
        """Mark the slot OFFLINE (orderly close); waits for no one."""
        if self.state in (SlotState.EMPTY, SlotState.SERVER_DONE):
            self._move(SlotState.OFFLINE)
            self.region.store_flag(self._flag, SlotState.OFFLINE)


class _SlotViews:
    """Typed full-capacity views of one slot's sections, made from a ``uint8 [size]`` view of
    the slot; requests use a prefix."""

    def __init__(self, slot: torch.Tensor, layout: SlotLayout):
        dtype = TORCH_DTYPES[layout.dtype]
        rows, h, k = layout.max_tokens, layout.hidden_size, layout.top_k

        def section(offset: int, dtype: torch.dtype, cols: int) -> torch.Tensor:
            return slot[offset : offset + rows * cols * dtype.itemsize].view(dtype).view(rows, cols)

        self.hidden = section(layout.hidden, dtype, h)
        self.expert_ids = section(layout.expert_ids, torch.int32, k)
        self.router_weights = section(layout.router_weights, torch.float32, k)
        self.result = section(layout.result, dtype, h)
        self.request_header = _HeaderBytes(slot[layout.request_header:][:HEADER_BYTES])
        self.result_header = _HeaderBytes(slot[layout.result_header:][:HEADER_BYTES])


class _HeaderBytes:
    """A header's 64 bytes in a slot: a memoryview on host memory (no tensor op per access),
    tensor copies on device memory (an expert server whose region is on a GPU)."""

    def __init__(self, view: torch.Tensor):
        self._tensor = view
        self._bytes = memoryview(view.numpy()) if view.device.type == "cpu" else None

    def read(self) -> bytes:
        return bytes(self._bytes) if self._bytes is not None else bytes(self._tensor.cpu().numpy())

    def write(self, packed: bytes) -> None:
        if self._bytes is not None:
            self._bytes[: len(packed)] = packed
        else:
            self._tensor[: len(packed)].copy_(torch.frombuffer(bytearray(packed),
                                                               dtype=torch.uint8))


class ServerSlot:
    """The server's side: it reads requests, writes results and never initiates anything."""

    def __init__(self, region: LocalRegion, base: int, layout: SlotLayout):
        self.region, self.base, self.layout = region, base, layout
        self.dtype = TORCH_DTYPES[layout.dtype]
        self._flag, self._bell = base + layout.flag, base + layout.bell
        self._views = _SlotViews(region.view(base, layout.size), layout)
        self.last_seq = 0

    def state(self) -> int:
        return self.region.load_flag(self._flag)

    def _move(self, new: SlotState) -> None:
        check_transition(Actor.SERVER, self.state(), new)
        self.region.store_flag(self._flag, new)

    def ready(self) -> bool:
        return self.state() == SlotState.CLIENT_WRITE_DONE

    def request(self) -> tuple[RequestHeader, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Header and zero-copy ``hidden, expert_ids, router_weights`` of a ready request.

        Raises ``HeaderError`` for a corrupt, stale or ill-sized request; ``reject`` it then.
        """
        layout, views = self.layout, self._views
        header = RequestHeader.unpack(views.request_header.read())
        if header.seq <= self.last_seq:
            raise HeaderError(RejectReason.STALE_SEQUENCE,
                              f"sequence {header.seq} after {self.last_seq}")
        self.last_seq = header.seq
        tokens = header.num_tokens
        if (header.dtype != layout.dtype or header.top_k != layout.top_k
                or header.hidden_size != layout.hidden_size or not 0 < tokens <= layout.max_tokens
                or header.payload_bytes != layout.payload_bytes(tokens)):
            raise HeaderError(RejectReason.BAD_SIZES, f"{header} does not match {layout}")
        return (header, views.hidden[:tokens], views.expert_ids[:tokens],
                views.router_weights[:tokens])

    def result_buffer(self, num_tokens: int) -> torch.Tensor:
        """Where to compute the ``[num_tokens, hidden_size]`` result in place."""
        return self._views.result[:num_tokens]

    def publish(self, seq: int, num_tokens: int) -> None:
        """The result is in ``result_buffer``: write its header, then SERVER_DONE."""
        self._answer(ResultHeader(ResultStatus.OK, seq, num_tokens))

    def reject(self, reason: RejectReason) -> None:
        """Answer a request that must not be computed; the client raises on reading it."""
        self._answer(ResultHeader(ResultStatus.REJECTED, self.last_seq, 0, reason))

    def _answer(self, header: ResultHeader) -> None:
        """Header, then SERVER_DONE (release), then the client's doorbell. A move the flag
        does not allow raises before anything is written (an earlier answer stays intact)."""
        check_transition(Actor.SERVER, self.state(), SlotState.SERVER_DONE)
        packed = header.pack()
        self._views.result_header.write(packed)
        self._move(SlotState.SERVER_DONE)
        self.region.notify(self._bell)

    def open(self, first_seq: int = 0) -> None:
        """Hand the (OFFLINE) slot to a newly joined client whose requests count from
        ``first_seq + 1``."""
        self.last_seq = first_seq
        self._move(SlotState.EMPTY)

    def reclaim(self) -> None:
        """The owning client is gone: OFFLINE, whatever the slot held (even a flag value that
        is no state at all, which only a misbehaving client can have written)."""
        state = self.state()
        if state not in iter(SlotState):
            self.region.store_flag(self._flag, SlotState.OFFLINE)
        elif state != SlotState.OFFLINE:
            self._move(SlotState.OFFLINE)
