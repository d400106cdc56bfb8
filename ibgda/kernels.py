"""Triton kernels of the ``device`` backend: the client's one-sided ops as GPU kernels.

``put_signal`` copies up to ``MAX_SECTIONS`` byte sections into the peer's region and, in the
last program to finish, release-stores the flag word (system scope), so a dispatch is one launch
with no host step in it. ``wait_flag`` acquire-polls a flag word; ``read`` copies out. All take
device tensors and scalars only, so a decode step made of them can be captured in a CUDA graph.

On a CPU the same kernels run under ``TRITON_INTERPRET=1`` against shared-memory tensors, where
they see (and are seen by) other processes' loads and stores.

Flags are accessed as the u32 word holding them (the three bytes above a flag are reserved as
zero by the slot layout), because GPUs have no byte-wide atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_SECTIONS = 4
BLOCK = 4096  # bytes per program and section


@triton.jit
def _copy_block(dst_ptr, dst_offset, src_ptr, nbytes, offs):
    mask = offs < nbytes
    tl.store(dst_ptr + dst_offset + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


@triton.jit
def put_signal_kernel(region_ptr, words_ptr, arrivals_ptr,
                      src0, off0, n0, src1, off1, n1, src2, off2, n2, src3, off3, n3,
                      flag_word, value, HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr):
    """Copy sections ``src_i -> region[off_i : off_i + n_i]``; the last program to arrive
    stores ``value`` into ``words[flag_word]`` with release semantics and resets ``arrivals``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _copy_block(region_ptr, off0, src0, n0, offs)
    _copy_block(region_ptr, off1, src1, n1, offs)
    _copy_block(region_ptr, off2, src2, n2, offs)
    _copy_block(region_ptr, off3, src3, n3, offs)
    if HAS_FLAG:
        # acq_rel: this program's copies are ordered before its arrival, and the last
        # arrival sees every other program's copies before it publishes the flag.
        arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="sys")
        if arrived == tl.num_programs(0) - 1:
            tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed", scope="sys")
            tl.atomic_xchg(words_ptr + flag_word, value, sem="release", scope="sys")


@triton.jit
def wait_flag_kernel(words_ptr, flag_word, value, status_ptr, max_spins):
    """Acquire-poll the low byte of ``words[flag_word]`` until it equals ``value``, at most
    ``max_spins`` times; ``status`` gets [1 if it did else 0, the last byte seen]."""
    seen = tl.atomic_add(words_ptr + flag_word, 0, sem="acquire", scope="sys") & 0xFF
    spins = 0
    while (seen != value) & (spins < max_spins):
        seen = tl.atomic_add(words_ptr + flag_word, 0, sem="acquire", scope="sys") & 0xFF
        spins += 1
    tl.store(status_ptr, (seen == value).to(tl.int32))
    tl.store(status_ptr + 1, seen)


@triton.jit
def read_kernel(out_ptr, region_ptr, offset, nbytes, BLOCK: tl.constexpr):
    """``out[:nbytes] = region[offset : offset + nbytes]``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < nbytes
    tl.store(out_ptr + offs, tl.load(region_ptr + offset + offs, mask=mask), mask=mask)


def grid_for(nbytes: int) -> tuple[int]:
    return (max(1, triton.cdiv(nbytes, BLOCK)),)
