"""The expert server's control endpoint: clients authenticate, join over TCP and get a slot.

The messages are ``protocol/control.py``'s, over the authenticated line channel
(``endpoint.LineEndpoint``). A client keeps its connection open for as long as it uses its
slot: when the connection closes at any step (client exit or crash), the slot returns to the
pool; ``leave`` only makes the return synchronous, so a client that closes knows it is done.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from sglang_eaas.endpoint import LineEndpoint
from sglang_eaas.protocol.control import OPS, Drain, JoinRequest
from sglang_eaas.protocol.lines import ControlError

if TYPE_CHECKING:
    from sglang_eaas.expert_server.server import ExpertServer, Membership


def control_endpoint(server: "ExpertServer", host: str, port: int, token: str) -> LineEndpoint:
    return LineEndpoint((host, port), token, lambda conn: ControlSession(server, conn),
                        "eaas-control")


class ControlSession:
    """One client's connection: at most one join, whose membership ends with the connection."""

    ops = OPS

    def __init__(self, server: "ExpertServer", connection: socket.socket):
        self.server, self.connection = server, connection
        self.member: Membership | None = None
        self.closing = False

    def handle(self, op: str, message: dict[str, Any]) -> dict[str, Any]:
        if op == "join":
            request = JoinRequest.from_message(message)  # a malformed join is that, first
            if self.member is not None:
                raise ControlError("out_of_order", "this connection already joined")
            reply, self.member = self.server.join(request, self.connection)
            return reply.to_message()
        if op == "ready":
            if self.member is None or self.member.active:
                raise ControlError("out_of_order", "'ready' must follow one 'join'")
            self.member.activate()
            return {}
        if op == "stats":
            return {"stats": self.server.stats_message()}
        if op == "drain":
            return {"clients": self.server.drain(Drain.from_message(message))}
        self.closing = True  # leave
        self.close()
        return {}

    def close(self) -> None:
        if self.member is not None:
            self.member.release()
            self.member = None
