"""``shm`` backend: POSIX shared memory (``/dev/shm``) for clients and servers on one host.

Regions are files under ``/dev/shm`` mapped with ``mmap``; ``view`` returns tensors aliasing the
mapping, so payloads are written and read in place. Doorbell words sleep and wake through Linux
futexes on the shared mapping, so a waiting peer uses no CPU and wakes at once.

Flag ordering: CPython executes the payload copy and the 1-byte flag store as separate C calls
in program order, and x86-64 (TSO) keeps stores, and loads, in program order; the backend
refuses other architectures until the native release/acquire helpers of the P2P library exist
(docs/protocol.md).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import uuid

import torch

from sglang_eaas.transport import futex
from sglang_eaas.transport.base import Region, RegionHandle, Transport, TransportError

SHM_DIR = "/dev/shm"
PREFIX = "sglang-eaas-"


def remove_orphans() -> None:
    """Unlink regions left by creators that died without closing (their pid is in the name)."""
    for name in os.listdir(SHM_DIR):
        pid = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


class ShmRegion(Region):
    def __init__(self, handle: RegionHandle, owner: bool):
        self.handle, self.owner = handle, owner
        path = os.path.join(SHM_DIR, handle.name)
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0), 0o600)
        except OSError as exc:
            raise TransportError(f"cannot open shared memory {path}: {exc}") from exc
        try:
            if owner:
                os.ftruncate(fd, handle.size)
            elif os.fstat(fd).st_size != handle.size:
                raise TransportError(
                    f"shared memory {path} has {os.fstat(fd).st_size} bytes, handle says "
                    f"{handle.size}"
                )
            self._mmap = mmap.mmap(fd, handle.size)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._flags = memoryview(self._mmap)
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self._address = ctypes.addressof(self._anchor)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        self._check(offset, nbytes)
        return self._bytes[offset : offset + nbytes]

    def read(self, offset: int, nbytes: int) -> bytes:
        self._check(offset, nbytes)
        return self._flags[offset : offset + nbytes].tobytes()

    def write(self, offset: int, data: torch.Tensor | bytes) -> None:
        if isinstance(data, (bytes, bytearray)):
            self._check(offset, len(data))
            self._flags[offset : offset + len(data)] = data
        else:
            super().write(offset, data)

    def load_flag(self, offset: int) -> int:
        self._check(offset, 1)
        return self._flags[offset]

    def store_flag(self, offset: int, value: int) -> None:
        self._check(offset, 1)
        self._flags[offset] = value

    def load_word(self, offset: int) -> int:
        self._check(offset, 4)
        return ctypes.c_uint32.from_address(self._address + offset).value

    def store_word(self, offset: int, value: int) -> None:
        self._check(offset, 4)
        ctypes.c_uint32.from_address(self._address + offset).value = value

    def wait_word(self, offset: int, expected: int, timeout: float) -> None:
        self._check(offset, 4)
        futex.wait(self._address + offset, expected, timeout)

    def wake_word(self, offset: int) -> None:
        self._check(offset, 4)
        futex.wake(self._address + offset)

    def close(self) -> None:
        if self._mmap.closed:
            return
        self._flags.release()
        del self._bytes, self._anchor
        try:
            self._mmap.close()
        except BufferError:  # a tensor view is still alive; the mapping goes with it
            pass
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.handle.name))
            except FileNotFoundError:
                pass


class ShmTransport(Transport):
    name = "shm"

    def __init__(self):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise TransportError(
                f"the shm transport relies on x86-64 store ordering; {platform.machine()} "
                "is not supported yet"
            )

    def create_region(self, size: int) -> ShmRegion:
        remove_orphans()
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        return ShmRegion(RegionHandle("shm", name, size), owner=True)

    def connect(self, handle: RegionHandle) -> ShmRegion:
        if handle.backend != self.name:
            raise TransportError(f"handle is for backend {handle.backend!r}, not 'shm'")
        return ShmRegion(handle, owner=False)
