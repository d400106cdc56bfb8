"""``shm``: peers on one host share ``/dev/shm`` files; one-sided ops are loads and stores.

Doorbells sleep and wake through futexes on the shared mapping, so an idle peer uses no CPU
and wakes at once. A region's file name carries its creator's pid, so files left behind by a
creator that died are removed by the next ``create_region`` on the host.
"""

from __future__ import annotations

import mmap
import os
import uuid

from ibgda.host_memory import HostLocalRegion, HostMemory, MappedRemoteRegion
from ibgda.region import RegionHandle, Transport, TransportError

SHM_DIR = "/dev/shm"
PREFIX = "ibgda-"


def remove_orphans() -> None:
    """Unlink regions whose creator (the pid in the name) no longer exists."""
    for name in os.listdir(SHM_DIR):
        pid = name[len(PREFIX):].split("-", 1)[0] if name.startswith(PREFIX) else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


def map_shm(handle: RegionHandle, create: bool) -> HostMemory:
    """Create (zeroed) or open the ``/dev/shm`` file of ``handle`` and map it."""
    path = os.path.join(SHM_DIR, handle.name)
    if "/" in handle.name or not handle.name.startswith(PREFIX):
        raise TransportError(f"{handle.name!r} is not an ibgda shared-memory region")
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    except OSError as exc:
        raise TransportError(f"cannot open shared memory {path}: {exc}") from exc
    try:
        if create:
            os.ftruncate(fd, handle.size)
        elif os.fstat(fd).st_size != handle.size:
            raise TransportError(f"shared memory {path} has {os.fstat(fd).st_size} bytes, the "
                                 f"handle says {handle.size}")
        return HostMemory(handle, mmap.mmap(fd, handle.size))
    finally:
        os.close(fd)


class ShmLocalRegion(HostLocalRegion):
    def close(self) -> None:
        super().close()
        try:
            os.unlink(os.path.join(SHM_DIR, self.handle.name))
        except FileNotFoundError:
            pass


class ShmTransport(Transport):
    name = "shm"
    owner_sleeps_on_futex = True  # peers' stores come with a futex wake

    def create_region(self, size: int) -> ShmLocalRegion:
        remove_orphans()
        handle = RegionHandle(self.name, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}", size)
        return ShmLocalRegion(map_shm(handle, create=True), self.owner_sleeps_on_futex)

    def connect(self, handle: RegionHandle) -> MappedRemoteRegion:
        self._check_backend(handle)
        return MappedRemoteRegion(map_shm(handle, create=False))
