"""One-sided transports between attention clients and expert servers."""

from sglang_eaas.transport.base import Region, RegionHandle, Transport, TransportError


def create_transport(name: str) -> Transport:
    """The transport backend called ``name``; backends import lazily."""
    if name == "shm":
        from sglang_eaas.transport.shm import ShmTransport

        return ShmTransport()
    raise TransportError(f"unknown transport {name!r}; available: shm")


__all__ = ["Region", "RegionHandle", "Transport", "TransportError", "create_transport"]
