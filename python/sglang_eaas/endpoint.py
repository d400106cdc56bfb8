"""``LineEndpoint``: the serving end of the authenticated JSON-line channel (``protocol/lines.py``).

One thread per connection. Authentication comes first: nothing else on a connection is read or
parsed before its first line carries the shared token, and anything unauthenticated gets one
error reply and the connection is closed. Then each line is parsed into ``(op, message)`` and
handed to the connection's ``Session``; what the session refuses (``ControlError``) is answered
with the sentence and its reason, and counted by reason. An over-long line closes the connection
(the stream cannot be resynchronised). The expert server's control endpoint and the monitor are
both sessions on this endpoint.
"""

from __future__ import annotations

import collections
import json
import logging
import socket
import socketserver
import threading
from typing import Any, Callable, Collection, Protocol

from sglang_eaas.protocol.lines import (
    AUTH_FAILED, AUTH_TIMEOUT, MAX_AUTH_LINE, MAX_LINE, ControlError, Message, authenticated,
    parse_line,
)

logger = logging.getLogger(__name__)


class Session(Protocol):
    """One authenticated connection's state; ``handle`` returns the reply's record."""

    ops: Collection[str]
    closing: bool  # set by ``handle`` to close the connection after its reply

    def handle(self, op: str, message: dict[str, Any]) -> Message: ...

    def close(self) -> None: ...


class LineEndpoint(socketserver.ThreadingTCPServer):
    """Threads block on their own connection; nothing else waits on them."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], token: str,
                 new_session: Callable[[socket.socket], Session], name: str):
        assert token, "an endpoint needs a shared token"
        self.token, self.new_session = token, new_session
        self._lock = threading.Lock()
        self.refused: collections.Counter[str] = collections.Counter()  # by reason
        self.refused_connections = 0  # connections closed because of a refusal
        super().__init__(address, _Handler)
        self.thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)

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

    def close(self) -> None:
        if self.thread.is_alive():
            self.shutdown()
        self.server_close()


class _Handler(socketserver.StreamRequestHandler):
    server: LineEndpoint

    def handle(self) -> None:
        if not self._authenticate():
            return
        session = self.server.new_session(self.connection)
        try:
            while not session.closing:
                line = self.rfile.readline(MAX_LINE)
                if not line:
                    break
                if len(line) >= MAX_LINE and not line.endswith(b"\n"):
                    self._refuse("line_too_long", f"a message line is limited to {MAX_LINE} "
                                 "bytes", closing=True)
                    break
                try:
                    op, message = parse_line(line, session.ops)
                    self._send({"ok": True, **session.handle(op, message).to_message()})
                except ControlError as exc:
                    self._refuse(exc.reason, str(exc), closing=False)
                except Exception as exc:  # a bug here must not take the endpoint down
                    logger.exception("%r failed", line[:200])
                    self._refuse("internal_error", f"internal error: {exc}", closing=False)
        except OSError:
            pass  # the peer vanished (or the session shut its connection down)
        finally:
            session.close()

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
        try:
            self._refuse("line_too_long" if too_long else "unauthenticated", AUTH_FAILED,
                         closing=True)
        except OSError:
            pass
        return False

    def _refuse(self, reason: str, error: str, closing: bool) -> None:
        self.server.count_refusal(reason, closing)
        self._send({"ok": False, "error": error, "reason": reason})

    def _send(self, reply: dict[str, Any]) -> None:
        self.wfile.write((json.dumps(reply) + "\n").encode())
