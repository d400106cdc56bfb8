"""Host memory shared with peers: one ``mmap`` seen as bytes, tensors and atomic flags/words.

``HostMemory`` is the mechanism; ``HostLocalRegion`` (the owner's side) and
``MappedRemoteRegion`` (a peer that maps the same pages) are the two ``ibgda`` regions on top.
All flag and word accesses go through ``ibgda._host_atomics`` (C11 release/acquire atomics and
futexes), written so the ordering rule holds on weakly ordered CPUs too; tested on x86-64 only
(test/test_shm_ordering.py).
"""

from __future__ import annotations

import ctypes
import mmap
import time

import torch

from ibgda import _host_atomics as atomics
from ibgda.region import LocalRegion, RegionHandle, RemoteRegion, as_bytes, check_bounds


class HostMemory:
    """A bounds-checked mapping; after ``release`` it goes with its last tensor view."""

    def __init__(self, handle: RegionHandle, mapping: mmap.mmap):
        self.handle, self._mmap = handle, mapping
        self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)
        self._anchor = ctypes.c_char.from_buffer(mapping)
        self.address = ctypes.addressof(self._anchor)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        check_bounds(self.handle, offset, nbytes)
        return self.bytes[offset : offset + nbytes]

    def flag_address(self, offset: int) -> int:
        check_bounds(self.handle, offset, 1)
        return self.address + offset

    def word_address(self, offset: int) -> int:
        check_bounds(self.handle, offset, 4)
        if offset % 4:
            raise ValueError(f"word offset {offset} is not 4-byte aligned")
        return self.address + offset

    def load_flag(self, offset: int) -> int:
        return atomics.load_u8_acquire(self.flag_address(offset))

    def store_flag(self, offset: int, value: int) -> None:
        atomics.store_u8_release(self.flag_address(offset), value)

    def load_word(self, offset: int) -> int:
        return atomics.load_u32_acquire(self.word_address(offset))

    def notify(self, offset: int) -> None:
        address = self.word_address(offset)
        atomics.fetch_add_u32(address, 1)
        atomics.futex_wake(address)

    def wait_word(self, offset: int, expected: int, timeout: float) -> None:
        atomics.futex_wait(self.word_address(offset), expected, timeout)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def release(self) -> None:
        """Forget the mapping; it is unmapped once no tensor view of it is left. Each view holds
        a reference to the ``mmap`` (``torch.frombuffer`` keeps the object, not a buffer
        export), so closing the ``mmap`` here would unmap memory a view still reads."""
        if self._mmap is None:
            return
        del self.bytes, self._anchor
        self._mmap = None


class HostLocalRegion(LocalRegion):
    """The owner's side of host memory that peers write into."""

    def __init__(self, memory: HostMemory, sleeps_on_futex: bool = True):
        self.memory, self.handle = memory, memory.handle
        self._sleeps_on_futex = sleeps_on_futex

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.memory.view(offset, nbytes)

    def load_flag(self, offset: int) -> int:
        return self.memory.load_flag(offset)

    def store_flag(self, offset: int, value: int) -> None:
        self.memory.store_flag(offset, value)

    def load_word(self, offset: int) -> int:
        return self.memory.load_word(offset)

    def notify(self, offset: int) -> None:
        self.memory.notify(offset)

    def wait_word(self, offset: int, expected: int, timeout: float) -> None:
        if self._sleeps_on_futex:
            self.memory.wait_word(offset, expected, timeout)
        else:
            super().wait_word(offset, expected, timeout)

    def close(self) -> None:
        self.memory.release()


class MappedRemoteRegion(RemoteRegion):
    """A peer's region mapped into this process: one-sided ops are plain loads and stores."""

    def __init__(self, memory: HostMemory):
        self.memory, self.handle = memory, memory.handle

    def write(self, offset: int, data: torch.Tensor) -> None:
        src = as_bytes(data)
        self.memory.view(offset, src.numel()).copy_(src)

    def read(self, offset: int, out: torch.Tensor) -> None:
        if not out.is_contiguous():
            raise ValueError("read() needs a contiguous output tensor")
        dst = as_bytes(out)
        dst.copy_(self.memory.view(offset, dst.numel()))

    def mapped(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.memory.view(offset, nbytes)

    def store_flag(self, offset: int, value: int) -> None:
        self.memory.store_flag(offset, value)

    def load_flag(self, offset: int) -> int:
        return self.memory.load_flag(offset)

    def notify(self, offset: int) -> None:
        self.memory.notify(offset)

    def wait_flag(self, offset: int, value: int, timeout: float, bell: int | None = None,
                  spin: float = 0.0) -> bool:
        if bell is None:
            return super().wait_flag(offset, value, timeout, bell, spin)
        if self._spin(offset, value, min(spin, timeout)):
            return True
        deadline = time.monotonic() + timeout
        while True:
            seen = self.memory.load_word(bell)
            if self.memory.load_flag(offset) == value:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.memory.wait_word(bell, seen, left)

    def close(self) -> None:
        self.memory.release()
