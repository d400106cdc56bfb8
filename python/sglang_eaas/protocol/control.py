"""The control channel to an expert server: authentication line, typed messages, bounded lines.

A connection opens with one authentication line, ``EAAS-AUTH <token>\\n``, compared in constant
time before anything else on the connection is read or parsed; a connection that fails it (wrong
token, no line within ``AUTH_TIMEOUT``, a line over ``MAX_AUTH_LINE``) gets one error reply and
is closed. Then JSON lines, one request, one reply, each at most ``MAX_LINE`` bytes:

    -> {"op": "join", ...JoinRequest}  <- {"ok": true, ...JoinReply} | {"ok": false, "error"}
    -> {"op": "ready"}                 <- {"ok": true}: the slot is served from now on
    -> {"op": "stats"}                 <- {"ok": true, "stats": {...}}
    -> {"op": "leave"}                 <- {"ok": true}: the slot is back in the pool

The records below are the only definition of these messages; both ends use them.
"""

from __future__ import annotations

import hmac
import json
import reprlib
import socket
from dataclasses import asdict, dataclass, fields
from typing import Any

from ibgda import TransportError
from sglang_eaas.addresses import parse_address
from sglang_eaas.protocol.header import DType
from sglang_eaas.protocol.layout import SlotLayout

AUTH_PREFIX = b"EAAS-AUTH "
MAX_AUTH_LINE = 1024  # bytes, newline included
MAX_LINE = 1 << 20  # bytes of one JSON message line, newline included
AUTH_TIMEOUT = 10.0  # seconds a new connection has to authenticate


class ControlError(ValueError):
    """A control message that is refused; ``reason`` is the counter it is counted under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def auth_line(token: str) -> bytes:
    return AUTH_PREFIX + token.encode() + b"\n"


def authenticated(line: bytes, token: str) -> bool:
    """Whether the first line of a connection carries ``token`` (constant-time compare)."""
    return hmac.compare_digest(line.rstrip(b"\r\n"), auth_line(token)[:-1])


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlevel = 3


def shown(value: Any) -> str:
    """``repr(value)``, cut short: a refusal names what it refuses without echoing it whole (a
    1 MiB field echoed back would make a reply longer than a client reads, MAX_LINE)."""
    return _SHOWN.repr(value)


# -- messages -------------------------------------------------------------------------------
def _check_fields(record: type, message: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``record`` from ``message``, each of its annotated type, else ControlError."""
    values = {}
    for f in fields(record):
        if f.name not in message:
            raise ControlError("bad_field", f"{message.get('op')!r} needs field {f.name!r}")
        value, kind = message[f.name], _TYPES[f.type]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is list:
            ok = ok and all(isinstance(v, str) for v in value)
        if not ok:
            raise ControlError("bad_field", f"{message.get('op')!r}: field {f.name!r} must be "
                               f"{_TYPE_WORDS[f.type]}, got {type(value).__name__}")
        values[f.name] = value
    return values


_TYPES = {"str": str, "int": int, "list[str]": list}
_TYPE_WORDS = {"str": "a string", "int": "an integer", "list[str]": "a list of strings"}


@dataclass(frozen=True)
class JoinRequest:
    """A client asks for a slot; the server checks it serves the same model and weights."""

    client: str  # a name for logs
    fingerprint: str  # MoeModelInfo.fingerprint(): the model's MoE shape
    dtype: str  # the client's activations dtype: float32 | bfloat16 | float16
    transport: str  # the ibgda backend asked for, or "auto"
    expert_digests: list[str]  # weights.expert_digests(): one per expert of the model

    op = "join"


@dataclass(frozen=True)
class JoinReply:
    """Where the reserved slot is, and what the server holds."""

    slot: int
    region: dict  # ibgda.RegionHandle.to_dict()
    base: int  # the slot's offset in the region
    bell: int  # the server doorbell's offset
    layout: SlotLayout
    experts: list[int]  # held in at least one layer
    layer_experts: dict[int, list[int]]  # MoE layer -> experts held there (maybe none)
    moe_layers: list[int]
    first_seq: int  # the client's first request is first_seq + 1 (a fresh range per join)

    def to_message(self) -> dict[str, Any]:
        return {"ok": True, **asdict(self), "layout": {
            **asdict(self.layout), "dtype": int(self.layout.dtype)},
            "layer_experts": {str(layer): ids for layer, ids in self.layer_experts.items()}}

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> "JoinReply":
        layout = dict(message["layout"])
        layout["dtype"] = DType(layout["dtype"])
        return cls(message["slot"], message["region"], message["base"], message["bell"],
                   SlotLayout(**layout), list(message["experts"]),
                   {int(layer): list(ids) for layer, ids in message["layer_experts"].items()},
                   list(message["moe_layers"]), message["first_seq"])


OPS = ("join", "ready", "stats", "leave")
_WHAT = {"join": "to join", "ready": "the slot confirmation", "stats": "a stats request",
         "leave": "the leave"}


def parse_request(line: bytes) -> tuple[str, JoinRequest | None]:
    """One JSON request line -> ``(op, JoinRequest or None)``; raises ``ControlError``."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        raise ControlError("malformed", "a control message must be one JSON object per line") \
            from None
    if not isinstance(message, dict):
        raise ControlError("malformed", f"a control message must be a JSON object, not "
                           f"{type(message).__name__}")
    op = message.get("op")
    if op not in OPS:
        raise ControlError("unknown_op", f"unknown op {shown(op)} (expected one of "
                           f"{', '.join(OPS)})")
    if op == "join":
        return op, JoinRequest(**_check_fields(JoinRequest, message))
    return op, None


# -- the client's end -----------------------------------------------------------------------
class ControlChannel:
    """A client's authenticated connection to one expert server's control endpoint."""

    def __init__(self, address: str, token: str, timeout: float = 30.0):
        self.address = address
        host, port = parse_address(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TransportError(f"expert server {address} is unreachable: {exc}") from exc
        self._file = self._sock.makefile("rwb")
        self._pending = auth_line(token)  # sent with the first request: no extra round trip

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request; the reply, or ``TransportError`` if refused or the line broke."""
        try:
            self._file.write(self._pending + (json.dumps({"op": op, **fields}) + "\n").encode())
            self._pending = b""
            self._file.flush()
            line = self._file.readline(MAX_LINE)
        except OSError as exc:
            raise TransportError(f"expert server {self.address}: {exc}") from exc
        if not line:
            raise TransportError(f"expert server {self.address} closed the control connection")
        try:
            reply = json.loads(line)
        except ValueError:
            raise TransportError(f"expert server {self.address} sent a malformed reply") from None
        if not reply.get("ok"):
            raise TransportError(f"expert server {self.address} refused {_WHAT[op]}: "
                                 f"{reply.get('error', reply)}")
        return reply

    def settimeout(self, seconds: float | None) -> None:
        self._sock.settimeout(seconds)

    def close(self) -> None:
        try:
            self._file.close()
            self._sock.close()
        except OSError:
            pass


def probe(address: str, token: str, timeout: float = 10.0) -> dict[str, Any]:
    """A server's stats (experts, model fingerprint, counters) over a fresh connection."""
    channel = ControlChannel(address, token, timeout)
    try:
        return channel.call("stats")["stats"]
    finally:
        channel.close()
