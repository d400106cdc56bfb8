"""The expert server's control endpoint: clients join over TCP and get a slot.

JSON lines over a TCP connection that the client keeps open for as long as it uses the slot:

    -> {"op": "join", "client": str, "fingerprint": str, "dtype": "float32"|"bfloat16"|"float16"}
    <- {"ok": true, "slot": int, "region": {...RegionHandle}, "base": int, "layout": {...},
        "experts": [int], "moe_layers": [int]}   or   {"ok": false, "error": str}
    -> {"op": "stats"}   <- {"ok": true, "stats": {...}}     (on any connection)

When the connection closes (client exit, crash or ``{"op": "leave"}``) the slot is reclaimed.
"""

from __future__ import annotations

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

    def __init__(self, address: tuple[str, int],
                 join: Callable[[dict[str, Any]], tuple[dict[str, Any], Callable[[], None]]],
                 stats: Callable[[], dict[str, Any]]):
        self.join, self.stats = join, stats
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
        release: Callable[[], None] | None = None
        try:
            for line in self.rfile:
                try:
                    message = json.loads(line)
                    op = message.get("op")
                    if op == "join" and release is None:
                        reply, release = self.server.join(message)
                    elif op == "stats":
                        reply = {"ok": True, "stats": self.server.stats()}
                    elif op == "leave":
                        break
                    else:
                        reply = {"ok": False, "error": f"unexpected op {op!r}"}
                except (ValueError, KeyError, TypeError) as exc:
                    reply = {"ok": False, "error": f"bad control message: {exc}"}
                self.wfile.write((json.dumps(reply) + "\n").encode())
        except OSError:
            pass  # the client vanished: same as leaving
        finally:
            if release is not None:
                release()
