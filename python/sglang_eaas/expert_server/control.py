"""The expert server's control endpoint: clients authenticate, join over TCP and get a slot.

The messages are ``protocol/control.py``'s, over the authenticated line channel
(``endpoint.LineEndpoint``). A client keeps its connection open for as long as it uses its
slots: when the connection closes at any step (client exit or crash), they return to the pool;
``leave`` only makes the return synchronous, so a client that closes knows it is done. One
connection may join up to ``SLOTS_PER_CONNECTION`` times: a client with two micro-batches in
flight (two-batch overlap) has a slot for each.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any

from sglang_eaas.endpoint import LineEndpoint
from sglang_eaas.expert_server.replicas import weights_chunk
from sglang_eaas.protocol.control import (
    OPS, SLOTS_PER_CONNECTION, AddExperts, AddParts, Drain, Drained, DropExperts, DropParts,
    ExpertWeights, ExportWeights, JoinRequest, ReleaseWeights,
)
from sglang_eaas.protocol.lines import ControlError, Done, Message

if TYPE_CHECKING:
    from sglang_eaas.expert_server.server import ExpertServer, Membership


# the holdings changes, fenced by the operation lease's epoch (ExpertServer.obey)
CHANGES = {"drain": Drain, "add_experts": AddExperts, "drop_experts": DropExperts,
           "add_parts": AddParts, "drop_parts": DropParts}
CHANGE_METHODS = {"add_experts": "add", "drop_experts": "drop", "add_parts": "add_parts",
                  "drop_parts": "drop_parts"}


def control_endpoint(server: "ExpertServer", host: str, port: int, token: str) -> LineEndpoint:
    return LineEndpoint((host, port), token, lambda conn: ControlSession(server, conn),
                        "eaas-control")


class ControlSession:
    """One client's connection: its joins (each a slot), whose memberships end with it."""

    ops = OPS

    def __init__(self, server: "ExpertServer", connection: socket.socket):
        self.server, self.connection = server, connection
        self.members: list[Membership] = []
        self.closing = False

    def handle(self, op: str, message: dict[str, Any]) -> Message:
        if op == "join":
            request = JoinRequest.from_message(message)  # a malformed join is that, first
            if self.members and not self.members[-1].active:
                raise ControlError("out_of_order", "'join' must follow the last join's 'ready'")
            if len(self.members) >= SLOTS_PER_CONNECTION:
                raise ControlError("out_of_order", (
                    f"this connection already holds {SLOTS_PER_CONNECTION} slots"))
            if self.members and request.client != self.members[0].client:
                raise ControlError("out_of_order", "one connection's slots are one client's")
            reply, member = self.server.join(request, self.connection)
            self.members.append(member)
            return reply
        if op == "ready":
            if not self.members or self.members[-1].active:
                raise ControlError("out_of_order", "'ready' must follow one 'join'")
            self.members[-1].activate()
            return Done()
        if op == "stats":
            return self.server.stats_record()
        if op in CHANGES:
            request = CHANGES[op].from_message(message)
            self.server.obey(request.epoch)
            if op == "drain":
                return Drained(self.server.drain(request))
            change = getattr(self.server.replicas, CHANGE_METHODS[op])
            return change(request)
        if op == "export_weights":
            return self.server.exports.export(ExportWeights.from_message(message))
        if op == "release_weights":
            return self.server.exports.release(ReleaseWeights.from_message(message))
        if op == "expert_weights":
            return weights_chunk(self.server, ExpertWeights.from_message(message))
        self.closing = True  # leave
        self.close()
        return Done()

    def close(self) -> None:
        members, self.members = self.members, []
        for member in members:
            member.release()
