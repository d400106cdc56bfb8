"""The slot protocol's header work as Triton kernels, for the client's device path.

The host path packs and checks headers with ``struct`` (``header.py``); a client whose whole
step runs on the device (``client/device_step.py``) cannot: its request header is a template
made once per (layer, tokens) on the host, and each dispatch the ``stamp_request`` kernel bumps
the slot's sequence counter (device memory), writes it into the template and recomputes the
CRC32. After the wait, ``check_result`` validates the answer's header against that counter and
writes a status code instead of raising. Field offsets come from ``header.py``; tests compare
the bytes with ``RequestHeader.pack`` and the verdicts with ``ResultHeader.unpack``.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from sglang_eaas.protocol.header import MAGIC, VERSION, RequestHeader, ResultHeader, ResultStatus


class DeviceCheck(enum.IntEnum):
    """What ``check_result`` writes into ``status[2]``; the client adds a server's rows only
    while it is ``OK`` (``client/device_step.py``)."""

    OK = 0
    NO_ANSWER = 1  # the wait ran out before SERVER_DONE
    BAD_HEADER = 2  # magic, version or checksum wrong
    REJECTED = 3  # the server refused the request (its reason in status[3])
    WRONG_ANSWER = 4  # an answer to another request (sequence or token count)


def crc32_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 256-entry table of ``zlib.crc32`` (reflected polynomial 0xEDB88320), as int64 so
    that no entry is negative."""
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table.append(c)
    return torch.tensor(table, dtype=torch.int64, device=device)


@triton.jit
def _crc32(ptr, table_ptr, NBYTES: tl.constexpr):
    crc = tl.full((), 0xFFFFFFFF, tl.int64)
    for i in tl.static_range(NBYTES):
        byte = tl.load(ptr + i).to(tl.int64)
        crc = tl.load(table_ptr + ((crc ^ byte) & 0xFF)) ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@triton.jit
def _load_le(ptr, NBYTES: tl.constexpr):
    value = tl.full((), 0, tl.int64)
    for i in tl.static_range(NBYTES):
        value = value | (tl.load(ptr + i).to(tl.int64) << (8 * i))
    return value


@triton.jit
def _store_le(ptr, value, NBYTES: tl.constexpr):
    for i in tl.static_range(NBYTES):
        tl.store(ptr + i, ((value >> (8 * i)) & 0xFF).to(tl.uint8))


@triton.jit
def stamp_request_kernel(header_ptr, seq_ptr, table_ptr, SEQ_AT: tl.constexpr,
                         BODY: tl.constexpr):
    """``seq += 1``; write it into the header template, then the header's CRC32."""
    seq = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, seq)
    _store_le(header_ptr + SEQ_AT, seq, 8)
    _store_le(header_ptr + BODY, _crc32(header_ptr, table_ptr, BODY), 4)


@triton.jit
def check_result_kernel(answer_ptr, seq_ptr, tokens, table_ptr, status_ptr, magic, version,
                        status_ok, STATUS_AT: tl.constexpr, SEQ_AT: tl.constexpr,
                        TOKENS_AT: tl.constexpr, REASON_AT: tl.constexpr, BODY: tl.constexpr):
    """``status[2]`` = a ``DeviceCheck`` for the answer header at ``answer``, ``status[3]`` the
    server's reject reason, unless an earlier failure is still there; ``status[0]`` (set by the
    wait) says whether an answer came."""
    reached = tl.load(status_ptr)
    intact = ((_load_le(answer_ptr, 4) == magic) & (_load_le(answer_ptr + 4, 2) == version)
              & (_load_le(answer_ptr + BODY, 4) == _crc32(answer_ptr, table_ptr, BODY)))
    accepted = _load_le(answer_ptr + STATUS_AT, 1) == status_ok
    matches = ((_load_le(answer_ptr + SEQ_AT, 8) == tl.load(seq_ptr))
               & (_load_le(answer_ptr + TOKENS_AT, 4) == tokens))
    code = tl.where(reached == 0, 1, tl.where(~intact, 2, tl.where(~accepted, 3,
                                                                   tl.where(~matches, 4, 0))))
    first = tl.load(status_ptr + 2)  # sticky: the first failure stays until the host reads it
    tl.store(status_ptr + 2, tl.where(first != 0, first, code).to(tl.int32))
    tl.store(status_ptr + 3, tl.where(first != 0, tl.load(status_ptr + 3),
                                      _load_le(answer_ptr + REASON_AT, 4)).to(tl.int32))


def stamp_request(header: torch.Tensor, seq: torch.Tensor, table: torch.Tensor) -> None:
    """One launch: ``seq`` (int64 ``[1]``) += 1, stamped into ``header`` (uint8, a template
    from ``RequestHeader.pack``) with a fresh checksum."""
    stamp_request_kernel[(1,)](header, seq, table, SEQ_AT=RequestHeader.SEQ_AT,
                               BODY=RequestHeader.BODY_BYTES)


def check_result(answer: torch.Tensor, seq: torch.Tensor, tokens: int, table: torch.Tensor,
                 status: torch.Tensor) -> None:
    """One launch: judge the result header at the start of ``answer`` (uint8) into
    ``status`` (int32 ``[reached, last flag, DeviceCheck, reject reason]``)."""
    check_result_kernel[(1,)](
        answer, seq, tokens, table, status, MAGIC, VERSION, int(ResultStatus.OK),
        STATUS_AT=ResultHeader.STATUS_AT, SEQ_AT=ResultHeader.SEQ_AT,
        TOKENS_AT=ResultHeader.TOKENS_AT, REASON_AT=ResultHeader.REASON_AT,
        BODY=ResultHeader.BODY_BYTES)
