"""One attention client's connection to one expert server: a joined slot plus its control socket."""

from __future__ import annotations

import json
import socket

from sglang_eaas.protocol.header import DType
from sglang_eaas.protocol.layout import SlotLayout
from sglang_eaas.protocol.slot import ClientSlot
from sglang_eaas.transport import RegionHandle, TransportError, create_transport


class ServerConnection:
    """Joins on construction; the slot stays ours while the control socket is open."""

    def __init__(self, address: str, client_name: str, fingerprint: str, dtype: str,
                 timeout: float = 30.0):
        self.address = address
        host, _, port = address.rpartition(":")
        try:
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as exc:
            raise TransportError(f"expert server {address} is unreachable: {exc}") from exc
        self._file = self._sock.makefile("rwb")
        reply = self._call({"op": "join", "client": client_name, "fingerprint": fingerprint,
                            "dtype": dtype})
        if not reply.get("ok"):
            self.close()
            raise TransportError(f"expert server {address} refused to join: {reply.get('error')}")
        handle = RegionHandle(**reply["region"])
        layout = reply["layout"]
        self.layout = SlotLayout(layout["max_tokens"], layout["hidden_size"], layout["top_k"],
                                 DType(layout["dtype"]))
        self.experts: list[int] = reply["experts"]
        self.moe_layers: list[int] = reply["moe_layers"]
        self.region = create_transport(handle.backend).connect(handle)
        self.slot = ClientSlot(self.region, reply["base"], self.layout, reply["bell"])

    def _call(self, message: dict) -> dict:
        try:
            self._file.write((json.dumps(message) + "\n").encode())
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
        """Leave the slot (OFFLINE) and close the control connection."""
        slot = getattr(self, "slot", None)
        if slot is not None:
            slot.leave()
            self.region.close()
            self.slot = None
        try:
            self._file.close()
            self._sock.close()
        except OSError:
            pass
