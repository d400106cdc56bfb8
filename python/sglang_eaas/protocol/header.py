"""Request and result headers: fixed-size little-endian records closed by a CRC32 checksum."""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

MAGIC = 0x53414145  # b"EAAS" read as little-endian u32
VERSION = 1
HEADER_BYTES = 64  # each header occupies one cache line


class DType(enum.IntEnum):
    """Dtype codes of the hidden-state payload (expert ids are int32, weights float32)."""

    FLOAT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2


class HeaderError(ValueError):
    """A header that must not be acted on; ``reason`` says why."""

    def __init__(self, reason: "RejectReason", detail: str):
        super().__init__(f"{reason.name}: {detail}")
        self.reason = reason


class RejectReason(enum.IntEnum):
    NONE = 0
    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_CHECKSUM = 3
    STALE_SEQUENCE = 4
    BAD_SIZES = 5
    UNKNOWN_LAYER = 6
    FOREIGN_EXPERT = 7  # an expert id this server does not hold
    BAD_DTYPE = 8
    SERVER_ERROR = 9  # the computation failed on the server (logged there)


class ResultStatus(enum.IntEnum):
    OK = 0
    REJECTED = 1


_CHECKSUM = struct.Struct("<I")


def _pack(fmt: struct.Struct, *fields: int) -> bytes:
    body = fmt.pack(*fields)
    return body + _CHECKSUM.pack(zlib.crc32(body))


def _unpack(fmt: struct.Struct, buf: bytes) -> tuple:
    body = memoryview(buf)[: fmt.size]
    fields = fmt.unpack(body)
    if fields[0] != MAGIC:
        raise HeaderError(RejectReason.BAD_MAGIC, f"magic {fields[0]:#x} != {MAGIC:#x}")
    if fields[1] != VERSION:
        raise HeaderError(RejectReason.BAD_VERSION, f"version {fields[1]} != {VERSION}")
    if zlib.crc32(body) != _CHECKSUM.unpack_from(buf, fmt.size)[0]:
        raise HeaderError(RejectReason.BAD_CHECKSUM, "header checksum mismatch")
    return fields


@dataclass(frozen=True)
class RequestHeader:
    """Written by the client before it publishes CLIENT_WRITE_DONE.

    The payload that follows holds ``hidden [num_tokens, hidden_size]`` in ``dtype``,
    ``expert_ids [num_tokens, top_k]`` int32 (global ids, -1 = not for this server) and
    ``router_weights [num_tokens, top_k]`` float32; ``payload_bytes`` is their total size.
    ``parts``: how the layer's experts were routed: 0 or 1 whole experts (EP), P > 1 parts of
    P-part slices, the ids then routed part ids ``e * P + p`` (tensor parallelism,
    docs/switching.md).
    """

    layer_id: int
    num_tokens: int
    top_k: int
    hidden_size: int
    dtype: DType
    seq: int  # strictly increasing per slot; a repeat or a step back is stale
    payload_bytes: int
    parts: int = 1

    _FMT = struct.Struct("<IHBBIIIIQQ")
    SEQ_AT = struct.calcsize("<IHBBIIII")  # byte offset of seq (the device path stamps it)
    BODY_BYTES = _FMT.size  # the checksum follows

    def pack(self) -> bytes:
        return _pack(self._FMT, MAGIC, VERSION, self.dtype, self.parts, self.layer_id,
                     self.num_tokens, self.top_k, self.hidden_size, self.seq, self.payload_bytes)

    @classmethod
    def unpack(cls, buf: bytes) -> "RequestHeader":
        _, _, dtype, parts, layer, tokens, top_k, hidden, seq, payload = _unpack(cls._FMT, buf)
        try:
            dtype = DType(dtype)
        except ValueError:
            raise HeaderError(RejectReason.BAD_DTYPE, f"dtype code {dtype}") from None
        return cls(layer, tokens, top_k, hidden, dtype, seq, payload, parts)


@dataclass(frozen=True)
class ResultHeader:
    """Written by the server before it publishes SERVER_DONE; echoes the request's ``seq``.

    On ``OK`` the result payload holds ``[num_tokens, hidden_size]`` in the request dtype.
    """

    status: ResultStatus
    seq: int
    num_tokens: int
    reason: RejectReason = RejectReason.NONE

    _FMT = struct.Struct("<IHBxQII")
    # Byte offsets of the fields the device path checks.
    STATUS_AT, SEQ_AT = struct.calcsize("<IH"), struct.calcsize("<IHBx")
    TOKENS_AT, REASON_AT = struct.calcsize("<IHBxQ"), struct.calcsize("<IHBxQI")
    BODY_BYTES = _FMT.size

    def pack(self) -> bytes:
        return _pack(self._FMT, MAGIC, VERSION, self.status, self.seq, self.num_tokens,
                     self.reason)

    @classmethod
    def unpack(cls, buf: bytes) -> "ResultHeader":
        _, _, status, seq, tokens, reason = _unpack(cls._FMT, buf)
        return cls(ResultStatus(status), seq, tokens, RejectReason(reason))
