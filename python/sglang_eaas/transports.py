"""Which ``ibgda`` backend carries the slots: ``--transport`` (expert server) and
``--eaas-transport`` (attention client).

A server offers one backend, chosen with ``auto`` by where it listens: ``shm`` on a loopback
address (every client is on its host), ``mooncake`` otherwise. A client with ``auto`` takes
what each server offers; with a backend named, it refuses servers that offer another.
"""

from __future__ import annotations

import ipaddress
import socket

import ibgda

AUTO = "auto"
CHOICES = (AUTO, *ibgda.BACKENDS)
HELP = ("'shm': shared memory, same host; 'mooncake': Mooncake Transfer Engine, across hosts "
        "(TCP, or RDMA on clusters); 'device': the kernel-initiated path (CPU twin under "
        "TRITON_INTERPRET=1 here); 'auto': ")


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def server_backend(choice: str, host: str) -> str:
    """The backend a server listening on ``host`` offers for ``--transport choice``."""
    if choice != AUTO:
        return choice
    return "shm" if is_loopback(host) else "mooncake"


def create_server_transport(backend: str, host: str) -> ibgda.Transport:
    """The transport a server creates its slot region with; Mooncake advertises ``host``."""
    if backend == "mooncake":
        reachable = socket.gethostbyname(socket.gethostname()) if host in ("", "0.0.0.0") else host
        return ibgda.create_transport(backend, host=reachable)
    return ibgda.create_transport(backend)
