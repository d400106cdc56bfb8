"""Sends ``control_cases`` to a live control endpoint over TCP and checks every reply.

A refusal must be one JSON object ``{"ok": false, "error": <one sentence>, "reason": <the
counter it is counted under, the one the case expects>}`` of at most ``MAX_REFUSAL`` bytes (an
error that echoed what it refuses without bound would be as long as the bad input, and a client
reading at most ``MAX_LINE`` could not even parse it).
"""

from __future__ import annotations

import collections
import json
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

from sglang_eaas.protocol.control import ReleaseSlots
from sglang_eaas.protocol.lines import MAX_LINE
from sglang_eaas.tools.fuzz.control_cases import (
    OK, ControlCase, ControlCaseMaker, ControlTarget, request_line,
)

MAX_REFUSAL = 1024  # bytes of one refusal line, newline included
TIMEOUT = 30.0  # seconds a reply may take before the server is reported as hung
MAX_PROBLEMS = 20
FULL_EVERY = 2000  # refused messages between two fill-every-slot rounds


@dataclass
class ControlTally:
    """What the control fuzz sent and what the server must have counted."""

    connections: int = 0
    refused_messages: int = 0  # bad messages sent: what the issue counts
    accepted: int = 0  # lines answered ok (joins, readies, stats, leaves between bad ones)
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    expected: collections.Counter = field(default_factory=collections.Counter)  # by reason
    refused_connections: int = 0
    wrong_replies: int = 0
    problems: list[str] = field(default_factory=list)
    hung: bool = False

    def problem(self, text: str) -> None:
        self.wrong_replies += 1
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)

    def count(self, case: ControlCase) -> None:
        self.connections += 1
        self.by_kind[case.kind] += 1
        refusals = case.refusals()
        self.refused_messages += len(refusals)
        self.expected.update(refusals)
        self.refused_connections += case.refused_connection
        self.accepted += sum(line.reply == OK for line in case.lines)


def _check_reply(raw: bytes, expected: str) -> str | None:
    """Why ``raw`` is not the reply ``expected`` calls for (OK or a refusal), or None."""
    try:
        reply = json.loads(raw)
    except ValueError:
        return f"reply is not JSON: {raw[:120]!r}"
    if not isinstance(reply, dict) or reply.get("ok") is not (expected == OK):
        return f"reply {raw[:200]!r}, expected {'ok' if expected == OK else expected!r}"
    if expected != OK:
        error = reply.get("error")
        if not isinstance(error, str) or not error or len(raw) > MAX_REFUSAL:
            return f"refusal ({expected}) of {len(raw)} bytes: {raw[:200]!r}"
        if reply.get("reason") != expected:
            return f"refusal for {reply.get('reason')!r}, expected {expected!r}: {raw[:200]!r}"
    return None


def run_case(address: tuple[str, int], case: ControlCase) -> list[str]:
    """Play ``case`` on a fresh connection (all of it: a wrong reply does not stop it, so the
    server's counts stay comparable); one sentence per reply that was wrong."""
    wrong: list[str] = []
    with socket.create_connection(address, timeout=TIMEOUT) as sock:
        replies = sock.makefile("rb")
        try:
            for line in case.lines:
                sock.sendall(line.data)
                if line.reply is None:
                    continue
                raw = replies.readline(MAX_LINE + 1)
                if not raw:
                    return wrong + [f"'{case.kind}': connection closed instead of a reply to "
                                    f"{line.data[:80]!r}"]
                problem = _check_reply(raw, line.reply)
                if problem:
                    wrong.append(f"'{case.kind}': {problem}")
            if case.closes and replies.readline(1):
                wrong.append(f"'{case.kind}': the server kept the connection open")
            if case.tail:
                sock.sendall(case.tail)
        except socket.timeout:
            raise  # a hung server: the caller stops the run
        except OSError as exc:
            if not case.may_reset:
                wrong.append(f"'{case.kind}': {exc}")
        finally:
            replies.close()
    return wrong


def fill_every_slot(address: tuple[str, int], maker: ControlCaseMaker, free: int,
                    tally: ControlTally) -> None:
    """Hold ``free`` joins at once (all must succeed), then one more: ``join_full``; then
    leave. A slot that leaked earlier would show as a refusal before ``free`` joins."""
    held: list[tuple[socket.socket, object]] = []  # connections and their reply readers
    try:
        for i in range(free + 1):
            sock = socket.create_connection(address, timeout=TIMEOUT)
            held.append((sock, sock.makefile("rb")))
            sock.sendall(maker.auth + json.dumps(maker.valid_join()).encode() + b"\n")
            raw = held[-1][1].readline(MAX_LINE + 1)
            wrong = _check_reply(raw, OK if i < free else "join_full")
            if wrong:
                tally.problem(f"join {i + 1} with {free} slots free: {wrong}")
        tally.connections += free + 1
        tally.accepted += free
        tally.refused_messages += 1
        tally.expected["join_full"] += 1
        tally.by_kind["fill every slot, one join more"] += 1
        for sock, replies in held[:free]:
            sock.sendall(request_line(ReleaseSlots()))
            wrong = _check_reply(replies.readline(MAX_LINE + 1), OK)
            if wrong:
                tally.problem(f"leave after filling every slot: {wrong}")
    finally:
        for sock, replies in held:
            replies.close()
            sock.close()


def run_control_fuzz(address: str, target: ControlTarget, messages: int, deadline: float,
                     seed: int, free_slots: int,
                     progress: Callable[[str], None] = lambda _: None) -> ControlTally:
    """Send at least ``messages`` bad messages (or stop at ``deadline``, a monotonic time);
    ``free_slots``: slots no one holds (fill_every_slot runs now and then)."""
    host, _, port = address.rpartition(":")
    peer = (host, int(port))
    maker, tally = ControlCaseMaker(random.Random(seed), target), ControlTally()
    next_full, next_report = 0, time.monotonic() + 5
    while tally.refused_messages < messages and time.monotonic() < deadline:
        case = maker.make()
        try:
            if tally.refused_messages >= next_full:
                fill_every_slot(peer, maker, free_slots, tally)
                next_full += FULL_EVERY
            wrong = run_case(peer, case)
        except socket.timeout:
            tally.hung = True
            tally.problem(f"'{case.kind}': no reply within {TIMEOUT:.0f} s")
            break
        except OSError as exc:  # refused or reset on connecting: the server is gone
            tally.hung = True
            tally.problem(f"'{case.kind}': the control endpoint is unreachable: {exc}")
            break
        tally.count(case)
        for problem in wrong:
            tally.problem(problem)
        if time.monotonic() > next_report:
            next_report += 5
            progress(f"control messages: {tally.refused_messages} of {messages} refused as "
                     f"expected, over {tally.connections} connections; {tally.wrong_replies} "
                     "wrong replies")
    return tally

