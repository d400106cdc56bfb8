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
from sglang_eaas.protocol.flags import Actor, ProtocolError, SlotState, check_transition
from sglang_eaas.protocol.header import (
    HEADER_BYTES, DType, HeaderError, RejectReason, RequestHeader, ResultHeader, ResultStatus,
)
from sglang_eaas.protocol.layout import SlotLayout

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16,
                DType.FLOAT16: torch.float16}
DTYPE_CODES = {v: k for k, v in TORCH_DTYPES.items()}
# The names used on command lines and in join messages.
DTYPES_BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ClientSlot:
    """The client's side: only it writes requests and reads results.

    It mirrors the flag locally (only the server moves it, and only from CLIENT_WRITE_DONE to
    SERVER_DONE, which ``wait`` observes), so sending costs no remote read.
    """

    def __init__(self, region: RemoteRegion, base: int, layout: SlotLayout, server_bell: int):
        self.region, self.base, self.layout = region, base, layout
        self.server_bell, self.seq = server_bell, 0
        self.dtype = TORCH_DTYPES[layout.dtype]
        self.state = SlotState.EMPTY
        self._tokens = 0
        self._inbox = torch.empty(0, dtype=torch.uint8)  # result header + result, grown on use

    def _move(self, new: SlotState) -> None:
        check_transition(Actor.CLIENT, self.state, new)
        self.state = new

    def send(self, layer_id: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
             router_weights: torch.Tensor) -> None:
        """Publish a request: payload and header, then CLIENT_WRITE_DONE, in one put.

        Args:
            hidden: ``[T, hidden_size]``, ``T <= max_tokens`` (cast to the slot dtype).
            expert_ids: ``[T, top_k]`` integer global expert ids, -1 where not for this server.
            router_weights: ``[T, top_k]`` float router weights.
        """
        layout, tokens = self.layout, hidden.shape[0]
        if tokens > layout.max_tokens or tuple(expert_ids.shape) != (tokens, layout.top_k):
            raise ProtocolError(f"request of {tokens} tokens does not fit slot {layout}")
        check_transition(Actor.CLIENT, self.state, SlotState.CLIENT_WRITE_DONE)
        self.seq += 1
        header = RequestHeader(layer_id, tokens, layout.top_k, layout.hidden_size, layout.dtype,
                               self.seq, layout.payload_bytes(tokens))
        base = self.base
        self.region.put_signal([
            (base + layout.hidden, hidden.to(self.dtype)),
            (base + layout.expert_ids, expert_ids.to(torch.int32)),
            (base + layout.router_weights, router_weights.to(torch.float32)),
            (base + layout.request_header, torch.frombuffer(bytearray(header.pack()),
                                                            dtype=torch.uint8)),
        ], base + layout.flag, SlotState.CLIENT_WRITE_DONE)
        self.state, self._tokens = SlotState.CLIENT_WRITE_DONE, tokens
        self.region.notify(self.server_bell)

    def wait(self, timeout: float, spin: float = 0.0) -> bool:
        """Wait until the server published (True) or ``timeout`` seconds passed (False),
        busy-polling for the first ``spin`` seconds."""
        if self.state == SlotState.CLIENT_WRITE_DONE and self.region.wait_flag(
                self.base + self.layout.flag, SlotState.SERVER_DONE, timeout,
                self.base + self.layout.bell, spin):
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
        h = self.layout.hidden_size
        nbytes = HEADER_BYTES + self._tokens * h * self.dtype.itemsize
        # The result payload follows its header directly (SlotLayout).
        answer = self.region.mapped(self.base + self.layout.result_header, nbytes)
        if answer is None:
            if self._inbox.numel() < nbytes:
                self._inbox = torch.empty(nbytes, dtype=torch.uint8)
            answer = self._inbox[:nbytes]
            self.region.read(self.base + self.layout.result_header, answer)
        header = ResultHeader.unpack(answer[:HEADER_BYTES].numpy().tobytes())
        if header.status != ResultStatus.OK:
            raise ProtocolError(f"server rejected request {self.seq}: {header.reason.name}")
        if header.seq != self.seq or header.num_tokens != self._tokens:
            raise ProtocolError(f"result is for request {header.seq} of {header.num_tokens} "
                                f"tokens, expected {self.seq} of {self._tokens}")
        return answer[HEADER_BYTES:].view(self.dtype).view(self._tokens, h)

    def leave(self) -> None:
        """Mark the slot OFFLINE (orderly close); waits for no one."""
        if self.state in (SlotState.EMPTY, SlotState.SERVER_DONE):
            self._move(SlotState.OFFLINE)
            self.region.store_flag(self.base + self.layout.flag, SlotState.OFFLINE)


class ServerSlot:
    """The server's side: it reads requests, writes results and never initiates anything."""

    def __init__(self, region: LocalRegion, base: int, layout: SlotLayout):
        self.region, self.base, self.layout = region, base, layout
        self.dtype = TORCH_DTYPES[layout.dtype]
        # Zero-copy views of the payload sections at full capacity; requests use a prefix.
        rows, h, k = layout.max_tokens, layout.hidden_size, layout.top_k
        self._hidden = self._tensor(layout.hidden, self.dtype, (rows, h))
        self._expert_ids = self._tensor(layout.expert_ids, torch.int32, (rows, k))
        self._router_weights = self._tensor(layout.router_weights, torch.float32, (rows, k))
        self._result = self._tensor(layout.result, self.dtype, (rows, h))
        self.last_seq = 0

    def _tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        nbytes = shape[0] * shape[1] * dtype.itemsize
        return self.region.view(self.base + offset, nbytes).view(dtype).view(shape)

    def state(self) -> int:
        return self.region.load_flag(self.base + self.layout.flag)

    def _move(self, new: SlotState) -> None:
        check_transition(Actor.SERVER, self.state(), new)
        self.region.store_flag(self.base + self.layout.flag, new)

    def ready(self) -> bool:
        return self.state() == SlotState.CLIENT_WRITE_DONE

    def request(self) -> tuple[RequestHeader, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Header and zero-copy ``hidden, expert_ids, router_weights`` of a ready request.

        Raises ``HeaderError`` for a corrupt, stale or ill-sized request; ``reject`` it then.
        """
        layout = self.layout
        header = RequestHeader.unpack(
            self.region.view(self.base + layout.request_header, HEADER_BYTES).numpy().tobytes())
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
        self._answer(ResultHeader(ResultStatus.OK, seq, num_tokens))

    def reject(self, reason: RejectReason) -> None:
        """Answer a request that must not be computed; the client raises on reading it."""
        self._answer(ResultHeader(ResultStatus.REJECTED, self.last_seq, 0, reason))

    def _answer(self, header: ResultHeader) -> None:
        """Header, then SERVER_DONE (release), then the client's doorbell."""
        packed = header.pack()
        self.region.view(self.base + self.layout.result_header, len(packed)).copy_(
            torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        self._move(SlotState.SERVER_DONE)
        self.region.notify(self.base + self.layout.bell)

    def open(self) -> None:
        """Hand the (OFFLINE) slot to a newly joined client."""
        self.last_seq = 0
        self._move(SlotState.EMPTY)

    def reclaim(self) -> None:
        """The owning client is gone: OFFLINE, whatever the slot held."""
        if self.state() != SlotState.OFFLINE:
            self._move(SlotState.OFFLINE)
