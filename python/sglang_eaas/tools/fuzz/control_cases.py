"""Control fuzz cases: what a fuzzing peer sends the control endpoint, and each line's reply.

Every case is one TCP connection. Its lines are sent one at a time; a line expecting a reply
(``OK`` or the refusal reason the server must count it under) is answered before the next goes
out. The expectations follow docs/protocol.md and protocol/control.py's contract: the
authentication line first (a refusal there closes the connection), then JSON lines checked in
this order: one JSON object, a known op, the join fields and their types, then the op's own
checks (``out_of_order``, then the server's join checks: model, digests, transport, dtype).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from dataclasses import MISSING, fields

from sglang_eaas.protocol.control import (
    SLOTS_PER_CONNECTION, JoinRequest, Ready, ReleaseSlots, Stats,
)
from sglang_eaas.protocol.lines import AUTH_PREFIX, MAX_AUTH_LINE, MAX_LINE, Request

OK = "ok"  # a line the server accepts
# the join's fields a join must carry (the record's fields without a default)
JOIN_FIELDS = tuple(f.name for f in fields(JoinRequest)
                    if f.default is MISSING and f.default_factory is MISSING)


@dataclass(frozen=True)
class Line:
    data: bytes
    reply: str | None  # OK, a refusal reason, or None: no reply (a good authentication line)


@dataclass(frozen=True)
class ControlCase:
    """One connection. ``closes``: the server closes it after the last line. ``tail``: bytes
    sent last, with no newline, before closing without waiting; the server counts them under
    ``tail_reason`` (and as a refused connection if ``tail_closes``: a cut authentication
    line). ``may_reset``: the server closes with bytes of ours unread, so the reply to the last
    line may be lost to the reset (the count is what matters)."""

    kind: str
    lines: tuple[Line, ...] = ()
    closes: bool = False
    tail: bytes = b""
    tail_reason: str | None = None
    tail_closes: bool = False
    may_reset: bool = False

    def refusals(self) -> list[str]:
        """Every refusal the server must count for this case, in order."""
        reasons = [line.reply for line in self.lines if line.reply not in (None, OK)]
        return reasons + ([self.tail_reason] if self.tail_reason else [])

    @property
    def refused_connection(self) -> bool:
        """The server closes the connection on a refusal (counted in refused_connections)."""
        refused_last = bool(self.lines) and self.lines[-1].reply not in (None, OK)
        return (self.closes and refused_last) or self.tail_closes


@dataclass(frozen=True)
class ControlTarget:
    """What a fuzzing peer knows of the server: its token and what a valid join shows."""

    token: str
    fingerprint: str
    expert_digests: tuple[str, ...]
    held: frozenset[int]


def message(**fields) -> bytes:
    return json.dumps(fields).encode() + b"\n"


def request_line(request: Request) -> bytes:
    """A well-formed request, as the typed end sends it."""
    return message(op=request.op, **request.to_message())


class ControlCaseMaker:
    """Random malformed control traffic; ``make()`` draws the next connection's case."""

    def __init__(self, rng: random.Random, target: ControlTarget):
        self.rng, self.target = rng, target
        self.auth = AUTH_PREFIX + target.token.encode() + b"\n"
        self._kinds = [
            (self._bad_auth, 25), (self._auth_too_long, 1), (self._auth_cut, 3),
            (self._probe, 1), (self._session, 60), (self._joined_session, 8),
            (self._line_too_long, 1),
        ]
        self._weights = [w for _, w in self._kinds]

    def make(self) -> ControlCase:
        (maker,) = self.rng.choices([k for k, _ in self._kinds], self._weights)
        return maker()

    def valid_join(self) -> dict:
        t = self.target
        request = JoinRequest("fuzz", t.fingerprint,
                              self.rng.choice(["float32", "bfloat16", "float16"]),
                              self.rng.choice(["auto", "shm"]), list(t.expert_digests))
        return {"op": request.op, **request.to_message()}

    # -- before authentication: one refusal, then the server closes --------------------------
    def _bad_auth(self) -> ControlCase:
        rng, token = self.rng, self.target.token
        choices = {
            "random first line": lambda: rng.randbytes(rng.randint(1, 300)).replace(b"\n", b"")
            or b"x",
            "no authentication line": lambda: request_line(Stats())[:-1],
            "wrong token": lambda: AUTH_PREFIX + _mutated(rng, token).encode(),
            "token prefix": lambda: AUTH_PREFIX + token[: rng.randrange(len(token))].encode(),
            "token with a suffix": lambda: AUTH_PREFIX + (token + "x").encode(),
            "token, lowercase prefix": lambda: b"eaas-auth " + token.encode(),
            "empty line": lambda: b"",
            "longest line that fits": lambda: b"A" * (MAX_AUTH_LINE - 1),
        }
        kind = rng.choice(list(choices))
        first = choices[kind]()
        # A random line may hold a newline of its own only via the choices above (removed).
        return ControlCase(f"auth: {kind}", (Line(first + b"\n", "unauthenticated"),),
                           closes=True)

    def _auth_too_long(self) -> ControlCase:
        """A first line of MAX_AUTH_LINE bytes or more without a newline (the token first)."""
        extra = self.rng.choice([0, 0, self.rng.randint(1, 1 << 16)])
        data = (self.auth[:-1] + b"A" * (MAX_AUTH_LINE + extra))[: MAX_AUTH_LINE + extra]
        return ControlCase("auth: line too long", (Line(data, "line_too_long"),), closes=True,
                           may_reset=extra > 0)

    def _auth_cut(self) -> ControlCase:
        """Part of an authentication line, then the connection closes."""
        cut = self.auth[: self.rng.randint(1, len(self.auth) - 2)]  # never the whole token
        return ControlCase("auth: cut mid-line", tail=cut, tail_reason="unauthenticated",
                           tail_closes=True)

    def _probe(self) -> ControlCase:
        """Connect and close (a port probe): nothing to refuse, nothing counted."""
        return ControlCase("connect, close")

    # -- after authentication ----------------------------------------------------------------
    def _session(self) -> ControlCase:
        """Several bad messages on one authenticated connection (none of them joins)."""
        lines = [Line(self.auth, None)]
        for _ in range(self.rng.randint(1, 16)):
            lines.append(self._bad_message())
        return self._finish("session: bad messages", lines)

    def _joined_session(self) -> ControlCase:
        """A valid join, then bad and out-of-order messages, then leave (the slots return). A
        join is in order only after the last join's 'ready', up to SLOTS_PER_CONNECTION."""
        lines = [Line(self.auth, None), Line(json.dumps(self.valid_join()).encode() + b"\n", OK)]
        ready, slots = False, 1
        for _ in range(self.rng.randint(1, 8)):
            what = self.rng.random()
            may_join = ready and slots < SLOTS_PER_CONNECTION
            if what < 0.2:
                lines.append(Line(request_line(Ready()), "out_of_order" if ready else OK))
                ready = True
            elif what < 0.35:
                lines.append(Line(json.dumps(self.valid_join()).encode() + b"\n",
                                  OK if may_join else "out_of_order"))
                if may_join:
                    ready, slots = False, slots + 1
            elif what < 0.45:
                lines.append(Line(message(op="stats", junk=[1, {"x": None}]), OK))
            else:  # never a 'ready' before a join (above); a failing join fails its checks
                lines.append(self._bad_message(joined=not may_join))
        lines.append(Line(request_line(ReleaseSlots()), OK))
        return ControlCase("session: joined, bad messages, leave", tuple(lines), closes=True)

    def _line_too_long(self) -> ControlCase:
        """An authenticated line of MAX_LINE bytes or more without a newline."""
        extra = self.rng.choice([0, self.rng.randint(1, 1 << 16)])
        data = b'{"op": "stats", "pad": "' + b"A" * (MAX_LINE + extra)
        return ControlCase("session: line too long", (
            Line(self.auth, None), Line(data[: MAX_LINE + extra], "line_too_long")),
            closes=True, may_reset=extra > 0)

    def _finish(self, kind: str, lines: list[Line]) -> ControlCase:
        """End a session: close quietly, leave, or close mid-line (a cut message)."""
        end = self.rng.random()
        if end < 0.15:
            cut = self._bad_message().data
            tail = cut[: self.rng.randint(1, max(1, len(cut) - 2))]
            tail = tail if not tail.endswith(b"\n") else tail[:-1] + b"#"
            return ControlCase(kind + ", cut mid-line", tuple(lines), tail=b"#" + tail,
                               tail_reason="malformed")
        if end < 0.5:
            lines.append(Line(request_line(ReleaseSlots()), OK))
            return ControlCase(kind + ", leave", tuple(lines), closes=True)
        return ControlCase(kind, tuple(lines))

    def _bad_message(self, joined: bool = False) -> Line:
        """One bad line, drawn from every way a message can be wrong; ``joined``: the
        connection holds a slot (a well-formed join is then out of order)."""
        rng = self.rng
        kind = rng.choices(["not json", "not an object", "deep", "huge number", "bad utf-8",
                            "op", "join fields", "join checks", "ready"],
                           [12, 8, 3, 2, 3, 15, 25, 25, 0 if joined else 7])[0]
        if kind == "not json":
            junk = rng.randbytes(rng.randint(0, 200)).replace(b"\n", b" ")
            return Line(b"#" + junk + b"\n", "malformed")
        if kind == "not an object":
            value = rng.choice([1, -2.5, "join", None, True, [], [{"op": "join"}], "{}"])
            return Line(json.dumps(value).encode() + b"\n", "malformed")
        if kind == "deep":
            depth = rng.randint(5_000, 100_000)
            return Line(b'{"op": "stats", "x": ' + b"[" * depth + b"]" * depth + b"}\n",
                        "malformed")
        if kind == "huge number":
            return Line(b'{"op": "join", "client": 1' + b"0" * rng.randint(5_000, 50_000)
                        + b"}\n", "malformed")
        if kind == "bad utf-8":  # but an encoded lone surrogate passes: json decodes bytes
            # with 'surrogatepass', so that op is a (wrong) string
            byte = rng.choice([b"\xff", b"\xc3", b"\x80", b"\xed\xa0\x80"])
            return Line(b'{"op": "' + byte + b'"}\n',
                        "unknown_op" if byte == b"\xed\xa0\x80" else "malformed")
        if kind == "op":
            op = rng.choice([rng.randbytes(rng.randint(1, 40)).hex(), "JOIN", "join ", "Stats",
                             "", 0, None, [], {}, ["join"], True, "x" * rng.randint(1, 1 << 16)])
            fields = {"op": op} if rng.random() < 0.9 else {"ops": "join"}
            return Line(json.dumps(fields).encode() + b"\n", "unknown_op")
        if kind == "ready":  # before any join
            return Line(request_line(Ready()), "out_of_order")
        if kind == "join fields":
            return Line(json.dumps(self._bad_join_fields()).encode() + b"\n", "bad_field")
        join, reason = self._failing_join()
        return Line(json.dumps(join).encode() + b"\n", "out_of_order" if joined else reason)

    def _bad_join_fields(self) -> dict:
        """A join with a field missing or of the wrong type."""
        rng, join = self.rng, self.valid_join()
        name = rng.choice(JOIN_FIELDS)
        if rng.random() < 0.3:
            del join[name]
        elif name == "expert_digests":
            join[name] = rng.choice(["abc", None, 3, {}, [1, 2], [None], [["x"]],
                                     list(self.target.expert_digests[:-1]) + [7]])
        else:
            join[name] = rng.choice([1, 2.5, None, True, [], {}, ["x"], 10 ** 30])
        return join

    def _failing_join(self) -> tuple[dict, str]:
        """A join with well-typed fields that the server refuses, and the reason."""
        rng, join, target = self.rng, self.valid_join(), self.target
        what = rng.choice(["fingerprint", "digest count", "digest", "transport", "dtype"])
        if what == "fingerprint":
            join["fingerprint"] = rng.choice(["", rng.randbytes(8).hex(),
                                              target.fingerprint.upper() + "0"])
            return join, "join_other_model"
        if what == "digest count":
            n = len(target.expert_digests)
            join["expert_digests"] = ["0" * 16] * rng.choice([0, n - 1, n + 1, 10 * n + 3])
            return join, "bad_field"
        if what == "digest":
            digests = list(target.expert_digests)
            expert = rng.choice(sorted(target.held))
            digests[expert] = _mutated(rng, digests[expert])
            join["expert_digests"] = digests
            return join, "join_other_weights"
        if what == "transport":
            join["transport"] = rng.choice(["mooncake", "device", "SHM", "", "x" * 5000,
                                            rng.randbytes(6).hex()])
            return join, "join_other_transport"
        join["dtype"] = rng.choice(["float64", "Float32", "half", "float", "", "int8",
                                    "y" * 5000])
        return join, "bad_field"


def _mutated(rng: random.Random, text: str) -> str:
    """``text`` with one character changed (never equal to it)."""
    i = rng.randrange(len(text)) if text else 0
    old = text[i : i + 1]
    new = rng.choice([c for c in "0123456789abcdefXYZ" if c != old])
    return text[:i] + new + text[i + 1 :]
