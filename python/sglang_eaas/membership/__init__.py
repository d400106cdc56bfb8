"""A member's and a watcher's side of the monitor (``sglang_eaas.monitor``): where it is, how
to reach it, and staying registered with it.

``--eaas-monitor`` / ``--monitor`` name one as ``embedded``, ``embedded:HOST:PORT`` (started by
the SGLang launcher), ``HOST:PORT`` (a standalone ``python -m sglang_eaas.monitor``, or another
SGLang's embedded one) or ``etcd://HOST:PORT`` (an etcd cluster's HTTP gateway):
``parse_monitor``. ``connect`` gives the backend for a concrete address (``tcp.py``,
``etcd.py``: ``base.py``'s interface); ``presence.Presence`` keeps a member registered.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_eaas.addresses import AddressError, parse_address
from sglang_eaas.membership.base import MemberLost, MemberSession, MonitorBackend
from sglang_eaas.membership.timing import (
    HEARTBEAT, LOSS_TIMEOUT, SUSPECT_TIMEOUT, suspect_timeout,
)
from sglang_eaas.protocol.monitor import Snapshot

EMBEDDED, TCP, ETCD = "embedded", "tcp", "etcd"
ETCD_SCHEME = "etcd://"


@dataclass(frozen=True)
class MonitorSpec:
    kind: str  # EMBEDDED | TCP | ETCD
    address: str  # HOST:PORT (port 0 for an embedded monitor on a free port)

    def __str__(self) -> str:
        if self.kind == EMBEDDED:
            return EMBEDDED if self.address == "127.0.0.1:0" else f"{EMBEDDED}:{self.address}"
        return ETCD_SCHEME + self.address if self.kind == ETCD else self.address

    @property
    def url(self) -> str:
        """How members reach it (an embedded one's address once it listens)."""
        return ETCD_SCHEME + self.address if self.kind == ETCD else self.address


def parse_monitor(spec: str, embedded_ok: bool = True) -> MonitorSpec:
    """``embedded | embedded:HOST:PORT | HOST:PORT | etcd://HOST:PORT``; ``ValueError`` with one
    sentence otherwise."""
    spec = spec.strip()
    kind, address = TCP, spec
    if spec == EMBEDDED:
        kind, address = EMBEDDED, "127.0.0.1:0"
    elif spec.startswith(EMBEDDED + ":"):
        kind, address = EMBEDDED, spec[len(EMBEDDED) + 1 :]
    elif spec.startswith(ETCD_SCHEME):
        kind, address = ETCD, spec[len(ETCD_SCHEME) :]
    elif "://" in spec:
        raise ValueError(f"{spec!r}: the only monitor URL scheme is etcd://HOST:PORT")
    if kind == EMBEDDED and not embedded_ok:
        raise ValueError("an embedded monitor is started by SGLang; give its HOST:PORT here")
    try:
        address = str(parse_address(address, allow_port_zero=kind == EMBEDDED))
    except AddressError as exc:
        raise ValueError(f"monitor {spec!r}: {exc}") from None
    return MonitorSpec(kind, address)


def connect(url: str, token: str) -> MonitorBackend:
    """The backend of a running monitor: ``HOST:PORT`` or ``etcd://HOST:PORT``."""
    spec = parse_monitor(url, embedded_ok=False)
    if spec.kind == ETCD:
        from sglang_eaas.membership.etcd import EtcdMonitor

        return EtcdMonitor(spec.address, token)
    from sglang_eaas.membership.tcp import TcpMonitor

    return TcpMonitor(spec.address, token)


def current_snapshot(url: str, token: str) -> Snapshot:
    """The running monitor's membership now (one connection, closed after)."""
    monitor = connect(url, token)
    try:
        return monitor.watch(-1, 0.0)
    finally:
        monitor.close()


__all__ = ["MemberLost", "MemberSession", "MonitorBackend", "MonitorSpec", "connect",
           "current_snapshot", "parse_monitor", "HEARTBEAT", "LOSS_TIMEOUT", "SUSPECT_TIMEOUT",
           "suspect_timeout"]
