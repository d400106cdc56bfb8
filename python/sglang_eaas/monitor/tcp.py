"""The monitor backend of an embedded or standalone ``MonitorServer`` (``HOST:PORT``)."""

from __future__ import annotations

import threading

from ibgda import TransportError
from sglang_eaas.monitor.base import MemberLost, MemberSession, MonitorBackend
from sglang_eaas.protocol.lines import Channel, Refused
from sglang_eaas.protocol.monitor import Member, Snapshot

PEER = "monitor"
CALL_TIMEOUT = 10.0  # seconds for a reply that does not wait on purpose


class TcpMonitor(MonitorBackend):
    def __init__(self, address: str, token: str):
        self.address, self.token = address, token
        self._lock = threading.Lock()  # one caller at a time on the shared channel
        self._channel: Channel | None = None

    def _call(self, op: str, patience: float = CALL_TIMEOUT, **fields) -> dict:
        """One call on the shared channel, reconnecting once if the connection broke."""
        with self._lock:
            for attempt in range(2):
                if self._channel is None:
                    self._channel = Channel(self.address, self.token, CALL_TIMEOUT, PEER)
                self._channel.settimeout(patience)
                try:
                    return self._channel.call(op, **fields)
                except Refused:
                    raise
                except TransportError:
                    self._channel.close()
                    self._channel = None
                    if attempt:
                        raise
        raise AssertionError("unreachable")

    def session(self) -> "TcpSession":
        return TcpSession(self)

    def watch(self, after: int, timeout: float) -> Snapshot:
        reply = self._call("watch", patience=timeout + CALL_TIMEOUT, after=after, timeout=timeout)
        return Snapshot.from_message(reply["snapshot"])

    def report(self, server: str, incarnation: str, why: str) -> bool:
        return self._call("report", server=server, incarnation=incarnation, why=why)["evicted"]

    def stats(self) -> dict:
        return self._call("stats")["stats"]

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None


class TcpSession(MemberSession):
    """The member's own connection: if it closes, the monitor loses the member at once."""

    def __init__(self, monitor: TcpMonitor):
        self._channel = Channel(monitor.address, monitor.token, CALL_TIMEOUT, PEER)
        self._incarnation = ""

    def _call(self, op: str, **fields) -> dict:
        try:
            return self._channel.call(op, **fields)
        except Refused as exc:
            if exc.reason == "unknown_incarnation":
                raise MemberLost(str(exc)) from None
            raise

    def register(self, member: Member, heartbeat: float) -> Member:
        message = {k: v for k, v in member.to_message().items()
                   if k not in ("incarnation", "beat_age")}
        reply = self._call("register", member=message, heartbeat=heartbeat)
        self._incarnation = reply["incarnation"]
        return Member(**{**member.to_message(), "incarnation": self._incarnation})

    def heartbeat(self, load: dict) -> None:
        self._call("heartbeat", incarnation=self._incarnation, load=load)

    def set_status(self, status: str) -> None:
        self._call("set_status", incarnation=self._incarnation, status=status)

    def set_holdings(self, layer_experts: dict, adapter_experts: dict | None = None) -> None:
        self._call("set_holdings", incarnation=self._incarnation, layer_experts=layer_experts,
                   adapter_experts=adapter_experts or {})

    def leave(self) -> None:
        self._call("leave", incarnation=self._incarnation)

    def close(self) -> None:
        self._channel.close()
