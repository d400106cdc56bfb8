"""``HOST:PORT`` addresses of expert servers' control endpoints, parsed and checked in one place.

Used by ``--eaas-expert-servers``, placement files, ``--listen`` and every connection, so a bad
address is refused where it is typed, not when a connect fails later. IPv6 is refused: the control
endpoint listens on IPv4 and the ``shm``/Mooncake handshakes advertise IPv4 hosts, so an IPv6
address could not work end to end.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import NamedTuple

# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


class AddressError(ValueError):
    """An address that is not a usable ``HOST:PORT``."""


class Address(NamedTuple):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_address(text: str, allow_port_zero: bool = False) -> Address:
    """``"host:port"`` -> ``Address``; raises ``AddressError`` with one sentence saying why not.

    ``host`` is an IPv4 address or a host name; ``port`` is 1-65535 (0 too with
    ``allow_port_zero``, for a listener that picks a free port).
    """
    text = text.strip()
    if text.startswith("[") or _is_ipv6(text) or _is_ipv6(text.rpartition(":")[0]):
        raise AddressError(f"{text!r}: IPv6 addresses are not supported (the control endpoint "
                           "and the transports use IPv4); give an IPv4 address or a host name")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or ":" in host:
        raise AddressError(f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:7000)")
    low = 0 if allow_port_zero else 1
    if not low <= int(port) <= 65535:
        raise AddressError(f"{text!r}: port {port} is not in {low}-65535")
    if not _valid_host(host):
        raise AddressError(f"{text!r}: {host!r} is neither an IPv4 address nor a host name")
    return Address(host, int(port))


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
        return True
    except ValueError:
        return False


def _valid_host(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    if len(host) > 253 or host.replace(".", "").isdigit():  # 1.2.3 or 300.1.1.1: no name
        return False
    return all(_LABEL.match(label) for label in host.split("."))


def free_port(avoid: frozenset[int] = frozenset()) -> int:
    """A port free now on loopback, not one of ``avoid`` (ports a process about to start has
    been told to bind, but has not bound yet: SGLang's HTTP port, while its model loads)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def accepts(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``HOST:PORT`` now."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False
