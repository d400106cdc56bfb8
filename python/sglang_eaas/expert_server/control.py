"""The expert server's control endpoint: clients authenticate, join over TCP and get a slot.

The messages and their limits are ``protocol/control.py``'s. Authentication comes first: the
first line of a connection must carry the shared token, and nothing else on the connection is
read or parsed before it does; anything unauthenticated gets one error reply and the connection
is closed. Every refusal is counted by reason (``stats()["control_refused"]``).

A client keeps its connection open for as long as it uses its slot. When the connection closes
at any step (client exit or crash), the slot returns to the pool; ``leave`` only makes the return
synchronous, so a client that closes knows it is done.
"""

from __future__ import annotations

import collections
import json
import logging
import socketserver
import threading
from typing import Any, Callable

from sglang_eaas.protocol.control import (
    AUTH_TIMEOUT,
    MAX_AUTH_LINE,
    MAX_LINE,
    ControlError,
    JoinReply,
    JoinRequest,
    authenticated,
    parse_request,
)

logger = logging.getLogger(__name__)
AUTH_FAILED = "authentication failed: wrong or missing token (SGLANG_EAAS_TOKEN / --token)"


class ControlServer(socketserver.ThreadingTCPServer):
    """Threads block on their connection; the data path never waits on this."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], token: str,
                 join: Callable[[JoinRequest], tuple[JoinReply, Any]],
                 stats: Callable[[], dict[str, Any]]):
        assert token, "the control endpoint needs a shared token"
        self.token, self.join, self.stats = token, join, stats
        self._lock = threading.Lock()
        self.refused: collections.Counter[str] = collections.Counter()  # by reason
        self.refused_connections = 0  # connections closed because of a refusal
        super().__init__(address, _Handler)
        self.thread = threading.Thread(target=self.serve_forever, name="eaas-control",
                                       daemon=True)

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def count_refusal(self, reason: str, closing: bool) -> None:
        with self._lock:
            self.refused[reason] += 1
            self.refused_connections += closing

    def counters(self) -> dict[str, Any]:
        with self._lock:
            return {"control_refused": dict(self.refused),
                    "refused_connections": self.refused_connections}


class _Handler(socketserver.StreamRequestHandler):
    server: ControlServer

    def handle(self) -> None:
        if not self._authenticate():
            return
        member = None  # the server's membership record of a joined client
        try:
            while True:
                line = self.rfile.readline(MAX_LINE)
                if not line:
                    break
                if len(line) >= MAX_LINE and not line.endswith(b"\n"):
                    self._refuse("line_too_long", f"a control message line is limited to "
                                 f"{MAX_LINE} bytes", closing=True)
                    break
                try:
                    op, join = parse_request(line)
                    if op == "join":
                        if member is not None:
                            raise ControlError("out_of_order", "this connection already joined")
                        reply, member = self.server.join(join)
                        self._send(reply.to_message())
                    elif op == "ready":
                        if member is None or member.active:
                            raise ControlError("out_of_order", "'ready' must follow one 'join'")
                        member.activate()
                        self._send({"ok": True})
                    elif op == "stats":
                        self._send({"ok": True, "stats": {**self.server.stats(),
                                                          **self.server.counters()}})
                    else:  # leave
                        if member is not None:
                            member.release()
                            member = None
                        self._send({"ok": True})
                        break
                except ControlError as exc:
                    self._refuse(exc.reason, str(exc), closing=False)
                except Exception as exc:  # a bug here must not take the server down
                    logger.exception("control message failed")
                    self._refuse("internal_error", f"internal error: {exc}", closing=False)
        except OSError:
            pass  # the client vanished: same as leaving
        finally:
            if member is not None:
                member.release()

    def _authenticate(self) -> bool:
        """Read and check the connection's first line, before anything else is read."""
        self.connection.settimeout(AUTH_TIMEOUT)
        try:
            line = self.rfile.readline(MAX_AUTH_LINE)
        except OSError:  # timed out, or reset
            self.server.count_refusal("auth_timeout", closing=True)
            return False
        if not line:
            return False  # connected and closed: a port probe, nothing to refuse
        if authenticated(line, self.server.token):
            self.connection.settimeout(None)
            return True
        too_long = len(line) >= MAX_AUTH_LINE and not line.endswith(b"\n")
        reason = "line_too_long" if too_long else "unauthenticated"
        try:
            self._refuse(reason, AUTH_FAILED, closing=True)
        except OSError:
            pass
        return False

    def _refuse(self, reason: str, error: str, closing: bool) -> None:
        self.server.count_refusal(reason, closing)
        self._send({"ok": False, "error": error})

    def _send(self, reply: dict[str, Any]) -> None:
        self.wfile.write((json.dumps(reply) + "\n").encode())
