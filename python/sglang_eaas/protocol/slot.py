"""The two ends of one slot: ``ClientSlot`` (requests in, results out) and ``ServerSlot``.

Both work on a ``Region`` from any transport; the ordering rule is always the same: payload,
then header, then the flag (release); the reader loads the flag (acquire), then the header.
After publishing, the writer rings the reader's doorbell (a u32 the reader can sleep on):
the server's region-wide bell for a request, the slot's own bell for a result.
"""

from __future__ import annotations

import time

import torch

from sglang_eaas.protocol.flags import Actor, ProtocolError, SlotState, check_transition
from sglang_eaas.protocol.header import (
    HEADER_BYTES, DType, HeaderError, RejectReason, RequestHeader, ResultHeader, ResultStatus,
)
from sglang_eaas.protocol.layout import SlotLayout
from sglang_eaas.transport.base import Region

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16,
                DType.FLOAT16: torch.float16}
DTYPE_CODES = {v: k for k, v in TORCH_DTYPES.items()}
# The names used on command lines and in join messages.
DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Slot:
    def __init__(self, region: Region, base: int, layout: SlotLayout):
        self.region, self.base, self.layout = region, base, layout
        self.dtype = TORCH_DTYPES[layout.dtype]
        # Zero-copy views of the payload sections at full capacity; requests use a prefix.
        rows, h, k = layout.max_tokens, layout.hidden_size, layout.top_k
        self._hidden = self._tensor(layout.hidden, self.dtype, (rows, h))
        self._expert_ids = self._tensor(layout.expert_ids, torch.int32, (rows, k))
        self._router_weights = self._tensor(layout.router_weights, torch.float32, (rows, k))
        self._result = self._tensor(layout.result, self.dtype, (rows, h))

    def state(self) -> int:
        return self.region.load_flag(self.base + self.layout.flag)

    def _move(self, actor: Actor, new: SlotState) -> None:
        check_transition(actor, self.state(), new)
        self.region.store_flag(self.base + self.layout.flag, new)

    def _tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
        return self.region.view(self.base + offset, nbytes).view(dtype).view(shape)


class ClientSlot(_Slot):
    """The client's side: only it writes requests and reads results."""

    def __init__(self, region: Region, base: int, layout: SlotLayout, server_bell: int):
        super().__init__(region, base, layout)
        self.server_bell, self.seq = server_bell, 0

    def send(self, layer_id: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
             router_weights: torch.Tensor) -> None:
        """Publish a request.

        Args:
            hidden: ``[T, hidden_size]`` in the slot dtype, ``T <= max_tokens``.
            expert_ids: ``[T, top_k]`` integer global expert ids, -1 where not for this server.
            router_weights: ``[T, top_k]`` float router weights.
        """
        layout, tokens = self.layout, hidden.shape[0]
        if tokens > layout.max_tokens or tuple(expert_ids.shape) != (tokens, layout.top_k):
            raise ProtocolError(f"request of {tokens} tokens does not fit slot {layout}")
        check_transition(Actor.CLIENT, self.state(), SlotState.CLIENT_WRITE_DONE)
        self.seq += 1
        self._hidden[:tokens].copy_(hidden)
        self._expert_ids[:tokens].copy_(expert_ids)
        self._router_weights[:tokens].copy_(router_weights)
        header = RequestHeader(layer_id, tokens, layout.top_k, layout.hidden_size, layout.dtype,
                               self.seq, layout.payload_bytes(tokens))
        self.region.write(self.base + layout.request_header, header.pack())
        self._move(Actor.CLIENT, SlotState.CLIENT_WRITE_DONE)
        self.region.ring(self.server_bell)

    def done(self) -> bool:
        return self.state() == SlotState.SERVER_DONE

    def wait(self, timeout: float) -> bool:
        """Sleep until the server published (True) or ``timeout`` seconds passed (False)."""
        bell, deadline = self.base + self.layout.bell, time.monotonic() + timeout
        while True:
            seen = self.region.load_word(bell)
            if self.done():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # Bounded sleeps: a wake-up lost to store/load reordering costs at most 10 ms.
            self.region.wait_word(bell, seen, min(left, 0.01))

    def result(self) -> torch.Tensor:
        """The ``[T, hidden_size]`` result of the last request, once ``done()``; zero-copy view.

        Raises ``ProtocolError`` if the server rejected the request or answered another one.
        """
        if not self.done():
            raise ProtocolError("result read before the server published it")
        header = ResultHeader.unpack(
            self.region.read(self.base + self.layout.result_header, HEADER_BYTES))
        if header.status != ResultStatus.OK:
            raise ProtocolError(f"server rejected request {self.seq}: {header.reason.name}")
        if header.seq != self.seq:
            raise ProtocolError(f"result is for request {header.seq}, expected {self.seq}")
        return self._result[: header.num_tokens]

    def leave(self) -> None:
        """Mark the slot OFFLINE (orderly close); waits for no one."""
        if self.state() in (SlotState.EMPTY, SlotState.SERVER_DONE):
            self._move(Actor.CLIENT, SlotState.OFFLINE)


class ServerSlot(_Slot):
    """The server's side: it reads requests, writes results and never initiates anything."""

    def __init__(self, region: Region, base: int, layout: SlotLayout):
        super().__init__(region, base, layout)
        self.last_seq = 0

    def ready(self) -> bool:
        return self.state() == SlotState.CLIENT_WRITE_DONE

    def request(self) -> tuple[RequestHeader, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Header and zero-copy ``hidden, expert_ids, router_weights`` of a ready request.

        Raises ``HeaderError`` for a corrupt, stale or ill-sized request; ``reject`` it then.
        """
        layout = self.layout
        header = RequestHeader.unpack(
            self.region.read(self.base + layout.request_header, HEADER_BYTES))
        if header.seq <= self.last_seq:
            raise HeaderError(RejectReason.STALE_SEQUENCE,
                              f"sequence {header.seq} after {self.last_seq}")
        self.last_seq = header.seq
        tokens = header.num_tokens
        if (header.dtype != layout.dtype or header.top_k != layout.top_k
                or header.hidden_size != layout.hidden_size or not 0 < tokens <= layout.max_tokens
                or header.payload_bytes != layout.payload_bytes(tokens)):
            raise HeaderError(RejectReason.BAD_SIZES, f"{header} does not match {layout}")
        return (header, self._hidden[:tokens], self._expert_ids[:tokens],
                self._router_weights[:tokens])

    def result_buffer(self, num_tokens: int) -> torch.Tensor:
        """Where to compute the ``[num_tokens, hidden_size]`` result in place."""
        return self._result[:num_tokens]

    def publish(self, seq: int, num_tokens: int) -> None:
        """The result is in ``result_buffer``: write its header, then SERVER_DONE."""
        self.region.write(self.base + self.layout.result_header,
                          ResultHeader(ResultStatus.OK, seq, num_tokens).pack())
        self._move(Actor.SERVER, SlotState.SERVER_DONE)
        self.region.ring(self.base + self.layout.bell)

    def reject(self, reason: RejectReason) -> None:
        """Answer a request that must not be computed; the client raises on reading it."""
        self.region.write(self.base + self.layout.result_header,
                          ResultHeader(ResultStatus.REJECTED, self.last_seq, 0, reason).pack())
        self._move(Actor.SERVER, SlotState.SERVER_DONE)
        self.region.ring(self.base + self.layout.bell)

    def open(self) -> None:
        """Hand the (OFFLINE) slot to a newly joined client."""
        self.last_seq = 0
        self._move(Actor.SERVER, SlotState.EMPTY)

    def reclaim(self) -> None:
        """The owning client is gone: OFFLINE, whatever the slot held."""
        if self.state() != SlotState.OFFLINE:
            self._move(Actor.SERVER, SlotState.OFFLINE)
