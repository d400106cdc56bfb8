"""The ibgda API: a process creates ``LocalRegion``s that peers reach one-sidedly through
``RemoteRegion``s, and exchanges ``RegionHandle``s with them out of band.

    transport = ibgda.create_transport("shm")       # or "mooncake", "device"
    region = transport.create_region(size)          # owner side: passive
    handle = region.handle.to_dict()                # send to the peer (JSON-safe)
    peer = transport.connect(RegionHandle.from_dict(handle))
    peer.put_signal([(0x40, payload)], flag_offset=0, value=1)  # payload, then flag (release)
    peer.wait_flag(0, 2, timeout=1.0)               # acquire-poll, then
    peer.read(0x40, out)                            # read the answer
    peer.close(); region.close()

Flags are bytes, words are little-endian u32 (doorbells), both at the caller's offsets.
"""

from __future__ import annotations

import abc
import os
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import torch


class TransportError(RuntimeError):
    """A region could not be created, mapped or accessed (out of bounds, peer gone, ...)."""


@dataclass(frozen=True)
class RegionHandle:
    """What a peer needs to reach a region.

    Attributes:
        backend: the transport that created it.
        name: the backend's name for it (a ``/dev/shm`` file, a Mooncake ``host:rpc_port``).
        size: bytes.
        address: the region's base address in its owner (backends that address remotely).
    """

    backend: str
    name: str
    size: int
    address: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "RegionHandle":
        try:
            return cls(str(fields["backend"]), str(fields["name"]), int(fields["size"]),
                       int(fields.get("address", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"malformed region handle {fields!r}: {exc}") from exc


def check_bounds(handle: RegionHandle, offset: int, nbytes: int) -> None:
    """Raise ``TransportError`` unless ``[offset, offset + nbytes)`` lies inside the region."""
    if offset < 0 or nbytes < 0 or offset + nbytes > handle.size:
        raise TransportError(f"access [{offset}, {offset + nbytes}) outside region "
                             f"{handle.name} of {handle.size} bytes")


def as_bytes(data: torch.Tensor) -> torch.Tensor:
    """A contiguous ``uint8`` view of ``data`` (copying only if it is not contiguous)."""
    return data.contiguous().view(-1).view(torch.uint8)


class LocalRegion(abc.ABC):
    """Memory this process owns and peers write into; the owner only reads, polls and sleeps."""

    handle: RegionHandle

    @abc.abstractmethod
    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A ``uint8 [nbytes]`` tensor aliasing the region."""

    @abc.abstractmethod
    def load_flag(self, offset: int) -> int:
        """Acquire-load the flag byte: later reads see what the peer wrote before storing it."""

    @abc.abstractmethod
    def store_flag(self, offset: int, value: int) -> None:
        """Release-store the flag byte: earlier writes are visible before it is."""

    @abc.abstractmethod
    def load_word(self, offset: int) -> int:
        """Acquire-load the u32 at ``offset``."""

    @abc.abstractmethod
    def notify(self, offset: int) -> None:
        """Bump the doorbell u32 at ``offset`` and wake its sleepers."""

    def wait_word(self, offset: int, expected: int, timeout: float) -> None:
        """Sleep until the u32 at ``offset`` may differ from ``expected``, at most ``timeout``.

        May return early; callers re-check. Backends whose peers cannot wake this process
        (remote writes land without a signal) sleep briefly and let the caller poll.
        """
        time.sleep(min(timeout, 50e-6))

    def idle(self, bell: int, seen: int, spin_until: float, timeout: float) -> None:
        """Nothing to do right now: before ``spin_until`` (a ``time.perf_counter`` time) yield
        the core and return, to be polled again; after it, ``wait_word(bell, seen, timeout)``."""
        if time.perf_counter() < spin_until:
            os.sched_yield()
        else:
            self.wait_word(bell, seen, timeout)

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving the region to peers and free it."""


Write = tuple[int, torch.Tensor]  # (offset in the region, data)


class RemoteRegion(abc.ABC):
    """A peer's region reached one-sidedly: the peer's CPU takes no part in any operation."""

    handle: RegionHandle

    @abc.abstractmethod
    def write(self, offset: int, data: torch.Tensor) -> None:
        """Copy ``data`` (any dtype) into the region at ``offset``; done when this returns."""

    @abc.abstractmethod
    def read(self, offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (contiguous, any dtype) from the region at ``offset``."""

    def mapped(self, offset: int, nbytes: int) -> torch.Tensor | None:
        """A zero-copy ``uint8 [nbytes]`` view of the peer's bytes, on backends where they are
        mapped into this process (``shm``); None where every access is a transfer (then
        ``read``). After an acquiring ``load_flag``/``wait_flag``, it shows what the peer
        wrote before storing the flag."""
        return None

    @abc.abstractmethod
    def store_flag(self, offset: int, value: int) -> None:
        """Release-store the flag byte: every earlier write lands before it."""

    @abc.abstractmethod
    def load_flag(self, offset: int) -> int:
        """Acquire-load the flag byte: later reads see what preceded its store."""

    def put_signal(self, writes: Sequence[Write], flag_offset: int, value: int) -> None:
        """Write every ``(offset, data)``, then release-store ``value`` into the flag."""
        for offset, data in writes:
            self.write(offset, data)
        self.store_flag(flag_offset, value)

    def notify(self, offset: int) -> None:
        """Ring the peer's doorbell u32 at ``offset`` (no-op where peers poll instead)."""

    def wait_flag(self, offset: int, value: int, timeout: float, bell: int | None = None,
                  spin: float = 0.0) -> bool:
        """Acquire-poll the flag until it equals ``value`` (True) or ``timeout`` passes (False).

        ``bell`` names a doorbell u32 the peer rings after storing the flag, for backends that
        can sleep on it; the others poll with a growing pause. ``spin`` seconds of busy polling
        (yielding between polls) come first: CPU time traded for the wake-up latency of a
        sleep.
        """
        if self._spin(offset, value, min(spin, timeout)):
            return True
        deadline, pause = time.monotonic() + timeout, 10e-6
        while self.load_flag(offset) != value:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def _spin(self, offset: int, value: int, seconds: float) -> bool:
        """Busy-poll the flag for up to ``seconds``; True once it equals ``value``. Between
        polls the core is yielded to any other runnable process, so on an oversubscribed host
        a spinning waiter does not hold up the peer it waits for."""
        deadline = time.monotonic() + seconds
        while True:
            if self.load_flag(offset) == value:
                return True
            if time.monotonic() >= deadline:
                return False
            os.sched_yield()

    @abc.abstractmethod
    def close(self) -> None:
        """Forget the peer's region (the peer's memory is untouched)."""


class Transport(abc.ABC):
    """Creates local regions and connects to peers' regions of one backend."""

    name: str
    owner_sleeps_on_futex = False  # True where peers' stores come with a futex wake

    @abc.abstractmethod
    def create_region(self, size: int) -> LocalRegion:
        """Allocate a zeroed region of ``size`` bytes that peers can connect to."""

    @abc.abstractmethod
    def connect(self, handle: RegionHandle) -> RemoteRegion:
        """Reach the peer region described by ``handle``."""

    def _check_backend(self, handle: RegionHandle) -> None:
        if handle.backend != self.name:
            raise TransportError(f"handle is for backend {handle.backend!r}, not {self.name!r}")
