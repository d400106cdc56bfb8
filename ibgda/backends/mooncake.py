"""``mooncake``: peers on other hosts through Mooncake Transfer Engine, with no etcd.

The owner registers its region with its engine and stays passive; a peer's engine writes and
reads it one-sidedly (TCP here, RDMA on clusters with ``protocol="rdma"``, untested here).
Engines find each other by P2P handshake: a handle's name is the owner's ``host:rpc_port``.

Ordering: ``write``/``read`` are synchronous (the bytes are in place when they return), so a
flag written by a later synchronous call is a release: the owner never sees it before the
payload. Payload and flag are never batched into one call (a batch is unordered). Remote writes
land through the engine's threads, which cannot wake a futex: the owner polls its memory and
``notify`` is a no-op.
"""

from __future__ import annotations

import mmap
import threading

import torch

from ibgda.host_memory import HostLocalRegion, HostMemory
from ibgda.region import (
    RegionHandle, RemoteRegion, Transport, TransportError, as_bytes, check_bounds,
)

INSTALL_HINT = ("install it with 'apt-get install -y libibverbs1' and 'pip install "
                "mooncake-transfer-engine-non-cuda' (scripts/setup.sh does both)")
_engines: dict[tuple[str, str, str], object] = {}
_lock = threading.Lock()


def engine(host: str, protocol: str = "tcp", device_name: str = ""):
    """This process's Transfer Engine for ``host`` (started once, P2P-handshake metadata)."""
    key = (host, protocol, device_name)
    with _lock:
        if key not in _engines:
            try:
                from mooncake.engine import TransferEngine
            except ImportError as exc:
                raise TransportError(f"the mooncake transport needs Mooncake: {exc}; "
                                     f"{INSTALL_HINT}") from exc
            te = TransferEngine()
            if te.initialize(host, "P2PHANDSHAKE", protocol, device_name) != 0:
                raise TransportError(f"Mooncake Transfer Engine failed to start on {host} "
                                     f"({protocol})")
            _engines[key] = te
        return _engines[key]


class MooncakeLocalRegion(HostLocalRegion):
    """Registered with the engine while open; the owner polls (no wake-ups through Mooncake)."""

    def __init__(self, memory: HostMemory, te):
        super().__init__(memory, sleeps_on_futex=False)
        self._te = te

    def close(self) -> None:
        if not self.memory.closed:
            self._te.unregister_memory(self.memory.address)
        super().close()


class MooncakeRemoteRegion(RemoteRegion):
    """A peer's registered region, reached through a registered local staging buffer."""

    def __init__(self, handle: RegionHandle, te):
        self.handle, self._te = handle, te
        self._staging: HostMemory | None = None
        self._grow(4096)
        self._flag_probe = torch.zeros(1, dtype=torch.uint8)
        self.read(0, self._flag_probe)  # fail now, not mid-request, if the peer is unreachable

    def _grow(self, nbytes: int) -> None:
        if self._staging is not None and self._staging.handle.size >= nbytes:
            return
        size = max(nbytes, 2 * (self._staging.handle.size if self._staging else 0))
        staging = HostMemory(RegionHandle("mooncake", "staging", size), mmap.mmap(-1, size))
        if self._te.register_memory(staging.address, size) != 0:
            raise TransportError(f"cannot register a {size}-byte staging buffer with Mooncake")
        self._release_staging()
        self._staging = staging

    def _release_staging(self) -> None:
        if self._staging is not None:
            self._te.unregister_memory(self._staging.address)
            self._staging.release()
            self._staging = None

    def _transfer(self, op: str, offset: int, nbytes: int) -> None:
        check_bounds(self.handle, offset, nbytes)
        call = self._te.transfer_sync_write if op == "write" else self._te.transfer_sync_read
        rc = call(self.handle.name, self._staging.address, self.handle.address + offset, nbytes)
        if rc != 0:
            raise TransportError(f"Mooncake {op} of {nbytes} bytes at offset {offset} of "
                                 f"{self.handle.name} failed (rc {rc}): peer gone or refused")

    def write(self, offset: int, data: torch.Tensor) -> None:
        src = as_bytes(data)
        check_bounds(self.handle, offset, src.numel())
        self._grow(src.numel())
        self._staging.bytes[: src.numel()].copy_(src)
        self._transfer("write", offset, src.numel())

    def read(self, offset: int, out: torch.Tensor) -> None:
        if not out.is_contiguous():
            raise ValueError("read() needs a contiguous output tensor")
        dst = as_bytes(out)
        check_bounds(self.handle, offset, dst.numel())
        self._grow(dst.numel())
        self._transfer("read", offset, dst.numel())
        dst.copy_(self._staging.bytes[: dst.numel()])

    def store_flag(self, offset: int, value: int) -> None:
        """A separate synchronous write after the earlier ones completed: a release."""
        self.write(offset, torch.tensor([value], dtype=torch.uint8))

    def load_flag(self, offset: int) -> int:
        self.read(offset, self._flag_probe)
        return int(self._flag_probe.item())

    def close(self) -> None:
        self._release_staging()


class MooncakeTransport(Transport):
    """``host``: the address peers reach this process's engine at."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp", device_name: str = ""):
        self.host = host
        self._te = engine(host, protocol, device_name)

    def create_region(self, size: int) -> MooncakeLocalRegion:
        memory_map = mmap.mmap(-1, size)  # anonymous: page-aligned and zeroed
        handle = RegionHandle(self.name, f"{self.host}:{self._te.get_rpc_port()}", size)
        memory = HostMemory(handle, memory_map)
        memory.handle = handle = RegionHandle(handle.backend, handle.name, size, memory.address)
        if self._te.register_memory(memory.address, size) != 0:
            memory.release()
            raise TransportError(f"cannot register a {size}-byte region with Mooncake")
        return MooncakeLocalRegion(memory, self._te)

    def connect(self, handle: RegionHandle) -> MooncakeRemoteRegion:
        self._check_backend(handle)
        return MooncakeRemoteRegion(handle, self._te)
