"""Byte layout of a server's slot region: where each slot's flag, headers and payloads live."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_eaas.protocol.header import HEADER_BYTES, DType

LINE = 64
DTYPE_BYTES = {DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.FLOAT16: 2}


def _align(n: int) -> int:
    return (n + LINE - 1) // LINE * LINE


@dataclass(frozen=True)
class SlotLayout:
    """Offsets inside one slot, for requests of at most ``max_tokens`` tokens.

    ``flag`` and the result doorbell ``bell`` (a u32 the server bumps after publishing) share
    the first cache line; the payload sections are sized for ``max_tokens`` so that every
    section has a fixed offset and can be viewed as a tensor without copying.
    """

    max_tokens: int
    hidden_size: int
    top_k: int
    dtype: DType

    @property
    def flag(self) -> int:
        return 0

    @property
    def bell(self) -> int:
        return 4

    @property
    def request_header(self) -> int:
        return LINE

    @property
    def hidden(self) -> int:
        return self.request_header + HEADER_BYTES

    @property
    def expert_ids(self) -> int:
        return self.hidden + _align(self.max_tokens * self.hidden_size * DTYPE_BYTES[self.dtype])

    @property
    def router_weights(self) -> int:
        return self.expert_ids + _align(self.max_tokens * self.top_k * 4)

    @property
    def result_header(self) -> int:
        return self.router_weights + _align(self.max_tokens * self.top_k * 4)

    @property
    def result(self) -> int:
        return self.result_header + HEADER_BYTES

    @property
    def size(self) -> int:
        return self.result + _align(self.max_tokens * self.hidden_size * DTYPE_BYTES[self.dtype])

    def payload_bytes(self, num_tokens: int) -> int:
        """Bytes of a request payload of ``num_tokens`` tokens (what the header declares)."""
        return num_tokens * (self.hidden_size * DTYPE_BYTES[self.dtype] + self.top_k * 8)


@dataclass(frozen=True)
class RegionLayout:
    """A header line holding the server doorbell (a u32 clients bump after publishing a
    request), then ``num_slots`` slots of ``slot_size`` bytes back to back.

    Slots are sized for the widest payload dtype, so each client's slot can use its own dtype.
    """

    num_slots: int
    slot_size: int

    @classmethod
    def for_requests(cls, num_slots: int, max_tokens: int, hidden_size: int,
                     top_k: int) -> "RegionLayout":
        widest = max(DTYPE_BYTES, key=DTYPE_BYTES.__getitem__)
        return cls(num_slots, SlotLayout(max_tokens, hidden_size, top_k, widest).size)

    @property
    def bell(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return LINE + self.num_slots * self.slot_size

    def base(self, index: int) -> int:
        assert 0 <= index < self.num_slots, (index, self.num_slots)
        return LINE + index * self.slot_size
