"""The transport interface: one-sided access to a peer's memory region.

A server *creates* a region and exports its ``RegionHandle``; a client *connects* to the handle
and then writes, reads and moves flags in that region without the server's involvement.
Backends: ``shm`` (same host). Cross-host and device-initiated backends plug in here.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass

import torch


class TransportError(RuntimeError):
    """A region could not be created, mapped or accessed."""


@dataclass(frozen=True)
class RegionHandle:
    """What a peer needs to map a region: the backend, its name for the region, its size."""

    backend: str
    name: str
    size: int


class Region(abc.ABC):
    """A mapped region (local or a peer's): byte-addressed, bounds-checked."""

    handle: RegionHandle

    @abc.abstractmethod
    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``uint8 [nbytes]`` tensor aliasing the region (zero-copy where the backend can)."""

    def write(self, offset: int, data: torch.Tensor | bytes) -> None:
        """Copy ``data`` (any dtype, contiguous) into the region at ``offset``."""
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8) if isinstance(
            data, (bytes, bytearray)) else data.contiguous().view(-1).view(torch.uint8)
        self.view(offset, src.numel()).copy_(src)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.view(offset, nbytes).numpy().tobytes()

    @abc.abstractmethod
    def load_flag(self, offset: int) -> int:
        """Read the 1-byte flag at ``offset`` (acquire: later reads see what preceded its store)."""

    @abc.abstractmethod
    def store_flag(self, offset: int, value: int) -> None:
        """Write the 1-byte flag (release: earlier writes are visible before the flag is)."""

    def load_word(self, offset: int) -> int:
        """Read the u32 at ``offset`` (4-byte aligned)."""
        return int(self.view(offset, 4).view(torch.int32).item()) & 0xFFFFFFFF

    def store_word(self, offset: int, value: int) -> None:
        self.view(offset, 4).view(torch.int32).fill_(value - (1 << 32) if value >= 1 << 31
                                                      else value)

    def wait_word(self, offset: int, expected: int, timeout: float) -> None:
        """Sleep until the u32 at ``offset`` may differ from ``expected`` or ``timeout`` passes.

        May return early for any reason; callers re-check. Backends without a wake-up
        mechanism just sleep a little.
        """
        time.sleep(min(timeout, 50e-6))

    def wake_word(self, offset: int) -> None:
        """Wake the peers sleeping in ``wait_word`` on ``offset`` (no-op without wake-ups)."""

    def ring(self, offset: int) -> None:
        """Bump the doorbell u32 at ``offset`` and wake its sleepers."""
        self.store_word(offset, (self.load_word(offset) + 1) & 0xFFFFFFFF)
        self.wake_word(offset)

    @abc.abstractmethod
    def close(self) -> None:
        """Unmap; the creator also frees the region."""

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.handle.size:
            raise TransportError(
                f"access [{offset}, {offset + nbytes}) outside region {self.handle.name} "
                f"of {self.handle.size} bytes"
            )


class Transport(abc.ABC):
    """Creates local regions and connects to peers' regions."""

    name: str

    @abc.abstractmethod
    def create_region(self, size: int) -> Region:
        """Allocate a zeroed region of ``size`` bytes that peers can connect to."""

    @abc.abstractmethod
    def connect(self, handle: RegionHandle) -> Region:
        """Map the peer region described by ``handle``."""
