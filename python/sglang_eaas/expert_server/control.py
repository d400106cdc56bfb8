"""The expert server's control endpoint: clients join over TCP and get a slot.

JSON lines over a TCP connection that the client keeps open for as long as it uses the slot.
Every message carries ``"token"``, the shared secret; a wrong or missing token is refused and
the connection closed.

    -> {"op": "join", "client": str, "fingerprint": str, "dtype": "float32"|"bfloat16"|"float16"}
    <- {"ok": true, "slot": int, "region": {...RegionHandle}, "base": int, "bell": int,
        "layout": {...}, "experts": [int], "moe_layers": [int]}  or  {"ok": false, "error": str}
    -> {"op": "ready"}   (the client mapped the region)   <- {"ok": true}: the slot is served
    -> {"op": "stats"}   <- {"ok": true, "stats": {...}}     (on any connection)
    -> {"op": "leave"}   <- {"ok": true}: the slot is back in the pool when this arrives

When the connection closes at any step (client exit or crash), the slot returns to the pool
too; ``leave`` only makes the return synchronous, so a client that closes knows it is done.
"""

from __future__ import annotations

import hmac
import json
import logging
import socketserver
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)


class ControlServer(socketserver.ThreadingTCPServer):
    """Threads block on their connection; the data path never waits on this."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], token: str,
                 join: Callable[[dict[str, Any]], tuple[dict[str, Any], Any]],
                 stats: Callable[[], dict[str, Any]]):
        assert token, "the control endpoint needs a shared token"
        self.token, self.join, self.stats = token, join, stats
        self.refused = 0
        super().__init__(address, _Handler)
        self.thread = threading.Thread(target=self.serve_forever, name="eaas-control",
                                       daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"


class _Handler(socketserver.StreamRequestHandler):
    server: ControlServer

    def handle(self) -> None:
        member = None  # the _Membership of a joined client
        try:
            for line in self.rfile:
                try:
                    message = json.loads(line)
                    if not hmac.compare_digest(str(message.get("token", "")).encode(),
                                               self.server.token.encode()):
                        self.server.refused += 1
                        self._send({"ok": False, "error": "authentication failed: wrong or "
                                    "missing token (SGLANG_EAAS_TOKEN / --token)"})
                        break
                    op = message.get("op")
                    if op == "join" and member is None:
                        reply, member = self.server.join(message)
                    elif op == "ready" and member is not None and not member.active:
                        member.activate()
                        reply = {"ok": True}
                    elif op == "stats":
                        reply = {"ok": True, "stats": {**self.server.stats(),
                                                       "refused_connections": self.server.refused}}
                    elif op == "leave":
                        if member is not None:
                            member.release()
                            member = None
                        self._send({"ok": True})
                        break
                    else:
                        reply = {"ok": False, "error": f"unexpected op {op!r}"}
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    reply = {"ok": False, "error": f"bad control message: {exc}"}
                self._send(reply)
        except OSError:
            pass  # the client vanished: same as leaving
        finally:
            if member is not None:
                member.release()

    def _send(self, reply: dict[str, Any]) -> None:
        self.wfile.write((json.dumps(reply) + "\n").encode())
