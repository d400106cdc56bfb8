"""One attention client's connection to one expert server: a joined slot plus its control socket."""

from __future__ import annotations

import json
import socket

from ibgda import RegionHandle, TransportError, create_transport
from sglang_eaas import envs, transports
from sglang_eaas.protocol.header import DType
from sglang_eaas.protocol.layout import SlotLayout
from sglang_eaas.protocol.slot import ClientSlot


LEAVE_TIMEOUT = 2.0  # seconds a closing client waits for the server to take its slot back


class ServerConnection:
    """Joins on construction; the slot stays ours while the control socket is open."""

    def __init__(self, address: str, client_name: str, fingerprint: str, dtype: str,
                 token: str | None = None, transport: str = transports.AUTO,
                 timeout: float = 30.0):
        """Join in two steps: ``join`` reserves a slot, ``ready`` (sent once the region is
        mapped here) makes the server poll it; a failure in between frees the slot."""
        self.address, self.token = address, envs.TOKEN.get() if token is None else token
        host, _, port = address.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as exc:
            raise TransportError(f"expert server {address} is unreachable: {exc}") from exc
        self._file = self._sock.makefile("rwb")
        reply = self._call({"op": "join", "client": client_name, "fingerprint": fingerprint,
                            "dtype": dtype, "transport": transport})
        if not reply.get("ok"):
            self.close()
            raise TransportError(f"expert server {address} refused to join: {reply.get('error')}")
        handle = RegionHandle.from_dict(reply["region"])
        layout = reply["layout"]
        self.layout = SlotLayout(layout["max_tokens"], layout["hidden_size"], layout["top_k"],
                                 DType(layout["dtype"]))
        self.experts: list[int] = reply["experts"]
        self.moe_layers: list[int] = reply["moe_layers"]
        try:
            self.region = create_transport(handle.backend).connect(handle)
            self.slot = ClientSlot(self.region, reply["base"], self.layout, reply["bell"])
            ready = self._call({"op": "ready"})
            if not ready.get("ok"):
                raise TransportError(f"expert server {address}: {ready.get('error')}")
        except BaseException:
            self.close()
            raise

    def _call(self, message: dict) -> dict:
        try:
            self._file.write((json.dumps({**message, "token": self.token}) + "\n").encode())
            self._file.flush()
            line = self._file.readline()
        except OSError as exc:
            raise TransportError(f"expert server {self.address}: {exc}") from exc
        if not line:
            raise TransportError(f"expert server {self.address} closed the control connection")
        return json.loads(line)

    def stats(self) -> dict:
        return self._call({"op": "stats"})["stats"]

    def close(self) -> None:
        """Leave the slot (OFFLINE), wait for the server to take it back, close the control
        connection. A server that is already gone needs no goodbye."""
        if getattr(self, "slot", None) is not None:
            self.slot.leave()
            self.slot = None
            try:
                self._sock.settimeout(LEAVE_TIMEOUT)  # a hung server must not hang our exit
                self._call({"op": "leave"})
            except (TransportError, ValueError):
                pass
        if getattr(self, "region", None) is not None:
            self.region.close()
            self.region = None
        try:
            self._file.close()
            self._sock.close()
        except OSError:
            pass
