"""Slot fuzz cases: what a fuzzing client writes into its own slot, and the answer it must get.

The expected answer is this module's own reading of the wire format and of the server's checks
as docs/protocol.md states them (in this order: magic, version, checksum, dtype code, a sequence
number above the slot's last, sizes matching the slot, a layer the server serves, only expert
ids it holds or -1). It packs and parses headers with its own ``struct`` formats and never calls
the protocol code it fuzzes; only the constants and reason codes come from ``protocol/header``.
"""

from __future__ import annotations

import random
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from sglang_eaas.protocol.header import HEADER_BYTES, MAGIC, VERSION, RejectReason

REQUEST = struct.Struct("<IHBxIIIIQQ")  # magic version dtype layer tokens top_k hidden seq payload
RESULT = struct.Struct("<IHBxQII")  # magic version status seq tokens reason
CRC = struct.Struct("<I")
DTYPE_BYTES = {0: 4, 1: 2, 2: 2}  # float32, bfloat16, float16
U32, U64 = (1 << 32) - 1, (1 << 64) - 1
CLIENT_WRITE_DONE = 1
GARBAGE_FLAGS = (0, 2, 3, 4, 0x7F, 0x80, 0xFF)  # anything but a publish (1); 0/2/3 at wrong times
OK = "ok"  # the outcome of an accepted request; rejections are RejectReason names


@dataclass(frozen=True)
class SlotShape:
    """What a fuzzing client knows of its slot and of the server behind it."""

    max_tokens: int
    hidden_size: int
    top_k: int
    dtype_code: int
    moe_layers: tuple[int, ...]
    held: frozenset[int]  # the server's experts
    num_experts: int

    def payload_bytes(self, tokens: int) -> int:
        return tokens * (self.hidden_size * DTYPE_BYTES[self.dtype_code] + 8 * self.top_k)


@dataclass
class SlotModel:
    """The fuzzer's mirror of what the server knows of one slot: the last accepted sequence
    number and the expert ids section (the server never writes the request sections)."""

    shape: SlotShape
    last_seq: int = 0
    ids: np.ndarray = field(init=False)

    def __post_init__(self):
        self.ids = np.full((self.shape.max_tokens, self.shape.top_k), -1, dtype=np.int32)

    @property
    def exhausted(self) -> bool:
        """No sequence number is left above the last one: only a new join resets it."""
        return self.last_seq >= U64 - 8


@dataclass(frozen=True)
class Answer:
    """A result header as the server must write it."""

    outcome: str  # OK or a RejectReason name
    seq: int
    tokens: int


@dataclass(frozen=True)
class SlotCase:
    """One write into a slot: ``ids``/``weights`` rows from row 0 (None: left as they are),
    ``hidden`` raw bytes from the section start, the header, then ``flag`` (a publish, or a
    value that is none)."""

    kind: str
    header: bytes
    flag: int = CLIENT_WRITE_DONE
    ids: np.ndarray | None = None
    weights: np.ndarray | None = None
    hidden: bytes | None = None


def pack_request(magic: int, version: int, dtype: int, layer: int, tokens: int, top_k: int,
                 hidden: int, seq: int, payload: int, crc: int | None = None) -> bytes:
    """A 64-byte request header; the checksum is computed unless ``crc`` is given."""
    body = REQUEST.pack(magic, version, dtype, layer, tokens, top_k, hidden, seq, payload)
    crc = zlib.crc32(body) if crc is None else crc
    return (body + CRC.pack(crc)).ljust(HEADER_BYTES, b"\0")


def with_crc(header: bytes) -> bytes:
    """``header`` with its checksum recomputed over its (possibly mutated) body."""
    body = header[: REQUEST.size]
    return body + CRC.pack(zlib.crc32(body)) + header[REQUEST.size + CRC.size :]


def expected_answer(header: bytes, model: SlotModel) -> Answer:
    """The answer the server owes a published ``header``; advances ``model.last_seq`` as the
    server does (a request past the sequence check consumes its number, whatever follows)."""
    magic, version, dtype, layer, tokens, top_k, hidden, seq, payload = REQUEST.unpack_from(header)
    shape, last = model.shape, model.last_seq

    def rejected(reason: RejectReason) -> Answer:
        return Answer(reason.name, model.last_seq, 0)

    if magic != MAGIC:
        return rejected(RejectReason.BAD_MAGIC)
    if version != VERSION:
        return rejected(RejectReason.BAD_VERSION)
    if zlib.crc32(header[: REQUEST.size]) != CRC.unpack_from(header, REQUEST.size)[0]:
        return rejected(RejectReason.BAD_CHECKSUM)
    if dtype not in DTYPE_BYTES:
        return rejected(RejectReason.BAD_DTYPE)
    if seq <= last:
        return rejected(RejectReason.STALE_SEQUENCE)
    model.last_seq = seq
    if (dtype != shape.dtype_code or top_k != shape.top_k or hidden != shape.hidden_size
            or not 0 < tokens <= shape.max_tokens or payload != shape.payload_bytes(tokens)):
        return rejected(RejectReason.BAD_SIZES)
    if layer not in shape.moe_layers:
        return rejected(RejectReason.UNKNOWN_LAYER)
    ids = model.ids[:tokens]
    if not all(int(e) == -1 or int(e) in shape.held for e in np.unique(ids)):
        return rejected(RejectReason.FOREIGN_EXPERT)
    return Answer(OK, seq, tokens)


def parse_result(header: bytes) -> Answer | str:
    """A result header read from the slot, or one sentence on why it is not a valid one."""
    magic, version, status, seq, tokens, reason = RESULT.unpack_from(header)
    if magic != MAGIC or version != VERSION:
        return f"result header has magic {magic:#x} and version {version}"
    if zlib.crc32(header[: RESULT.size]) != CRC.unpack_from(header, RESULT.size)[0]:
        return "result header checksum mismatch"
    if status not in (0, 1) or (status == 0) != (reason == 0):
        return f"result header has status {status} with reason {reason}"
    try:
        name = OK if status == 0 else RejectReason(reason).name
    except ValueError:
        return f"result header has unknown reason {reason}"
    return Answer(name, seq, tokens)


# -- case generation ------------------------------------------------------------------------
class CaseMaker:
    """Random and mutated requests for one slot; ``make(model)`` draws the next case."""

    def __init__(self, rng: random.Random, garbage_flag_rate: float = 0.01):
        self.rng = rng
        self.np_rng = np.random.default_rng(rng.getrandbits(64))
        self.garbage_flag_rate = garbage_flag_rate
        self._kinds = [
            (self._valid, 10), (self._nonfinite, 5), (self._foreign, 8),
            (self._random_header, 8), (self._random_body, 4), (self._random_body_crc, 4),
            (self._field, 40), (self._bit_flips, 15),
        ]
        self._weights = [w for _, w in self._kinds]

    def make(self, model: SlotModel) -> SlotCase:
        if self.rng.random() < self.garbage_flag_rate:
            return self._garbage_flag(model)
        (maker,) = self.rng.choices([k for k, _ in self._kinds], self._weights)
        return maker(model)

    # A valid request: its fields, ids (held or -1), weights and hidden bytes.
    def _base(self, model: SlotModel) -> tuple[list[int], np.ndarray, np.ndarray, bytes]:
        rng, shape = self.rng, model.shape
        tokens = rng.randint(1, min(4, shape.max_tokens))
        seq = min(model.last_seq + 1 + rng.randrange(3), U64)
        fields = [MAGIC, VERSION, shape.dtype_code, rng.choice(shape.moe_layers), tokens,
                  shape.top_k, shape.hidden_size, seq, shape.payload_bytes(tokens)]
        choices = [-1, *shape.held]
        ids = np.array([[rng.choice(choices) for _ in range(shape.top_k)]
                        for _ in range(tokens)], dtype=np.int32)
        weights = np.array([[rng.random() for _ in range(shape.top_k)] for _ in range(tokens)],
                           dtype=np.float32)
        return fields, ids, weights, self._normal(tokens * shape.hidden_size, shape.dtype_code)

    def _normal(self, n: int, dtype_code: int) -> bytes:
        """``n`` standard normal values in the slot's dtype, as bytes."""
        x = self.np_rng.standard_normal(n, dtype=np.float32)
        if dtype_code == 1:  # bfloat16: the high half of each float32
            return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        return (x.astype(np.float16) if dtype_code == 2 else x).tobytes()

    def _valid(self, model: SlotModel) -> SlotCase:
        fields, ids, weights, hidden = self._base(model)
        return SlotCase("valid", pack_request(*fields), ids=ids, weights=weights, hidden=hidden)

    def _nonfinite(self, model: SlotModel) -> SlotCase:
        """Valid, with NaN/inf router weights and random bit patterns as hidden states."""
        fields, ids, weights, _ = self._base(model)
        flat = weights.reshape(-1)
        for i in range(flat.size):
            if self.rng.random() < 0.5:
                flat[i] = self.rng.choice([np.nan, np.inf, -np.inf, 3e38, -0.0, 1e-45])
        hidden = self.rng.randbytes(fields[4] * model.shape.hidden_size
                                    * DTYPE_BYTES[model.shape.dtype_code])
        return SlotCase("valid, non-finite values", pack_request(*fields), ids=ids,
                        weights=weights, hidden=hidden)

    def _foreign(self, model: SlotModel) -> SlotCase:
        """Valid, except some expert ids: held elsewhere, out of range, negative, huge."""
        fields, ids, weights, hidden = self._base(model)
        shape, rng = model.shape, self.rng
        others = [e for e in range(shape.num_experts) if e not in shape.held]
        bad = [*others, -2, -(1 << 31), (1 << 31) - 1, shape.num_experts, shape.num_experts + 1]
        flat = ids.reshape(-1)
        for i in rng.sample(range(flat.size), rng.randint(1, flat.size)):
            flat[i] = rng.choice(bad)
        return SlotCase("foreign expert ids", pack_request(*fields), ids=ids, weights=weights,
                        hidden=hidden)

    def _random_header(self, model: SlotModel) -> SlotCase:
        return SlotCase("random header bytes", self.rng.randbytes(HEADER_BYTES))

    def _random_body(self, model: SlotModel) -> SlotCase:
        """Magic and version right, everything after them random (checksum included)."""
        head = struct.pack("<IH", MAGIC, VERSION)
        return SlotCase("random header body", head + self.rng.randbytes(HEADER_BYTES - 6))

    def _random_body_crc(self, model: SlotModel) -> SlotCase:
        """Random fields under a valid checksum: the field checks are reached."""
        head = struct.pack("<IH", MAGIC, VERSION)
        return SlotCase("random header body, valid checksum",
                        with_crc(head + self.rng.randbytes(HEADER_BYTES - 6)))

    def _field(self, model: SlotModel) -> SlotCase:
        """A valid header with one field set to an edge value; the checksum is recomputed over
        it 4 times in 5 (so the field checks are reached), else left as it was."""
        fields, ids, weights, hidden = self._base(model)
        old_crc = CRC.unpack_from(pack_request(*fields), REQUEST.size)[0]
        name, index, values = self.rng.choice(self._field_values(model, fields))
        fields[index] = value = self.rng.choice(values)
        if name == "token count (payload size to match)":
            fields[8] = model.shape.payload_bytes(value)
        keep_crc = self.rng.random() < 0.2
        header = pack_request(*fields, crc=old_crc if keep_crc else None)
        kind = f"field: {name}" + (", stale checksum" if keep_crc else "")
        return SlotCase(kind, header, ids=ids, weights=weights, hidden=hidden)

    def _field_values(self, model: SlotModel, fields: list[int]) -> list[tuple[str, int, list]]:
        rng, shape, last = self.rng, model.shape, model.last_seq
        tokens = fields[4]
        other_dtypes = [d for d in DTYPE_BYTES if d != shape.dtype_code]
        non_moe = [layer for layer in range(max(shape.moe_layers) + 2)
                   if layer not in shape.moe_layers]
        return [
            ("magic", 0, [rng.getrandbits(32) | 1, 0, int.from_bytes(MAGIC.to_bytes(4, "big"),
                                                                       "little")]),
            ("version", 1, [0, VERSION + 1, 0xFFFF, rng.getrandbits(16)]),
            ("dtype code", 2, [3, 0xFF, rng.randint(3, 0xFF), *other_dtypes]),
            ("layer id", 3, [*non_moe, U32, rng.getrandbits(32), rng.choice(shape.moe_layers)]),
            ("token count", 4, [0, shape.max_tokens + 1, U32, rng.getrandbits(32),
                                rng.randint(1, shape.max_tokens)]),
            ("token count (payload size to match)", 4,
             [rng.randint(1, shape.max_tokens), shape.max_tokens, 0, shape.max_tokens + 1]),
            ("top-k", 5, [0, shape.top_k + 1, U32, rng.getrandbits(32)]),
            ("hidden size", 6, [0, shape.hidden_size - 1, shape.hidden_size + 1, U32]),
            ("sequence number", 7, [last, max(last - 1, 0), 0, rng.randint(0, last),
                                    min(last + 1 + rng.getrandbits(20), U64)]
             + ([U64] if rng.random() < 0.02 else [])),
            ("payload bytes", 8, [shape.payload_bytes(tokens) + 1,
                                  shape.payload_bytes(tokens) - 1, 0, U64, rng.getrandbits(64)]),
        ]

    def _bit_flips(self, model: SlotModel) -> SlotCase:
        """A valid header with 1 to 3 bits flipped anywhere in its 64 bytes (those past the
        checksum are padding: still a valid request)."""
        fields, ids, weights, hidden = self._base(model)
        header = bytearray(pack_request(*fields))
        for _ in range(self.rng.randint(1, 3)):
            bit = self.rng.randrange(HEADER_BYTES * 8)
            header[bit // 8] ^= 1 << (bit % 8)
        return SlotCase("bit flips", bytes(header), ids=ids, weights=weights, hidden=hidden)

    def _garbage_flag(self, model: SlotModel) -> SlotCase:
        """A flag value that publishes nothing: the server must neither answer nor count."""
        fields, _, _, _ = self._base(model)
        flag = self.rng.choice([*GARBAGE_FLAGS, self.rng.randint(4, 0xFF)])
        return SlotCase("garbage flag", pack_request(*fields), flag=flag)
