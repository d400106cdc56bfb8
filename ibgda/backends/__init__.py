"""The transport backends; each imports its dependencies only when chosen."""

from __future__ import annotations

import importlib

from ibgda.region import Transport, TransportError

BACKENDS = {
    "shm": "ibgda.backends.shm:ShmTransport",
    "mooncake": "ibgda.backends.mooncake:MooncakeTransport",
    "device": "ibgda.backends.device:DeviceTransport",
}


def create_transport(name: str, **options) -> Transport:
    """The backend called ``name`` (``shm``, ``mooncake`` or ``device``).

    ``options`` go to the backend (``mooncake`` takes ``host``, the address peers reach).
    """
    if name not in BACKENDS:
        raise TransportError(f"unknown transport {name!r}; available: {', '.join(BACKENDS)}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(**options)
