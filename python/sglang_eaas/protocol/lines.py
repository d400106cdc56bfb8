"""The authenticated JSON-line channel of every sglang-eaas TCP endpoint (expert servers' control
endpoints and the monitor).

A connection opens with one authentication line, ``EAAS-AUTH <token>\\n``, compared in constant
time before anything else on the connection is read or parsed; a connection that fails it (wrong
token, no line within ``AUTH_TIMEOUT``, a line over ``MAX_AUTH_LINE``) gets one error reply and
is closed. Then JSON lines, one request, one reply, each at most ``MAX_LINE`` bytes:

    -> {"op": OP, ...fields}   <- {"ok": true, ...} | {"ok": false, "error": SENTENCE, "reason": R}

``R`` is the counter the refusal is counted under. What each endpoint's ops carry are typed
records (``protocol/control.py`` for expert servers, ``protocol/monitor.py`` for the monitor),
checked field by field by ``check_fields``.
"""

from __future__ import annotations

import hmac
import json
import reprlib
import select
import socket
import typing
from dataclasses import MISSING, fields
from typing import Any

from ibgda import TransportError
from sglang_eaas.addresses import parse_address

AUTH_PREFIX = b"EAAS-AUTH "
MAX_AUTH_LINE = 1024  # bytes, newline included
MAX_LINE = 1 << 20  # bytes of one JSON message line, newline included
AUTH_TIMEOUT = 10.0  # seconds a new connection has to authenticate
AUTH_FAILED = "authentication failed: wrong or missing token (SGLANG_EAAS_TOKEN / --token)"


class ControlError(ValueError):
    """A message that is refused; ``reason`` is the counter it is counted under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class Refused(TransportError):
    """The peer answered ``ok: false``; ``reason`` is its counter name (``""`` if it gave none)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
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


# -- typed fields ---------------------------------------------------------------------------
_KINDS = {"str": (str, "a string"), "int": (int, "an integer"), "bool": (bool, "true or false"),
          "float": ((int, float), "a number"), "list[str]": (list, "a list of strings"),
          "list[int]": (list, "a list of integers"), "dict": (dict, "an object"),
          "list[list[int]]": (list, "a list of lists of integers")}
_ITEMS = {"list[str]": str, "list[int]": int}


def _is(value: Any, annotation: str) -> bool:
    kind = _KINDS[annotation][0]
    if isinstance(value, bool) and annotation != "bool":
        return False  # JSON true is not the integer 1
    if not isinstance(value, kind):
        return False
    if annotation == "list[list[int]]":
        return all(_is(row, "list[int]") for row in value)
    item = _ITEMS.get(annotation)
    return item is None or all(isinstance(v, item) and not isinstance(v, bool) for v in value)


def check_fields(record: type, message: dict[str, Any]) -> dict[str, Any]:
    """The fields of dataclass ``record`` from ``message``, each of its annotated type (a field
    with a default may be missing), else ``ControlError("bad_field", ...)``."""
    values = {}
    op = shown(message.get("op"))
    for f in fields(record):
        if f.name not in message:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise ControlError("bad_field", f"{op} needs field {f.name!r}")
        value = message[f.name]
        if not _is(value, f.type):
            raise ControlError("bad_field", f"{op}: field {f.name!r} must be "
                               f"{_KINDS[f.type][1]}, got {type(value).__name__}")
        values[f.name] = value
    return values


class Message:
    """A typed record that arrives over the channel (a dataclass): ``from_message`` checks each
    field's type (``check_fields``), then ``validate`` checks what types cannot say."""

    @classmethod
    def from_message(cls, message: dict[str, Any]):
        record = cls(**check_fields(cls, message))
        record.validate()
        return record

    def validate(self) -> None:
        """Raise ``ControlError("bad_field", ...)`` for a value its type allows but the record
        does not."""


def parse_line(line: bytes, ops: typing.Collection[str]) -> tuple[str, dict[str, Any]]:
    """One JSON request line -> ``(op, message)``; ``ControlError`` for anything but a JSON
    object whose ``op`` is one of ``ops``."""
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        raise ControlError("malformed", "a message must be one JSON object per line") from None
    if not isinstance(message, dict):
        raise ControlError("malformed", f"a message must be a JSON object, not "
                           f"{type(message).__name__}")
    op = message.get("op")
    if op not in ops:
        raise ControlError("unknown_op", f"unknown op {shown(op)} (expected one of "
                           f"{', '.join(ops)})")
    return op, message


# -- the calling end ------------------------------------------------------------------------
_WHAT = {"join": "to join", "ready": "the slot confirmation", "stats": "a stats request",
         "leave": "the leave", "drain": "to drain", "register": "the registration",
         "heartbeat": "a heartbeat", "set_status": "a status change",
         "set_holdings": "a holdings change", "watch": "a watch",
         "report": "a report"}


class Channel:
    """An authenticated connection to one endpoint; ``peer`` names it in errors."""

    def __init__(self, address: str, token: str, timeout: float = 30.0,
                 peer: str = "expert server"):
        self.address, self.peer = address, peer
        host, port = parse_address(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TransportError(f"{peer} {address} is unreachable: {exc}") from exc
        self._file = self._sock.makefile("rwb")
        self._pending = auth_line(token)  # sent with the first request: no extra round trip

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request; the reply, ``Refused`` if refused, ``TransportError`` if the line
        broke."""
        try:
            self._file.write(self._pending + (json.dumps({"op": op, **fields}) + "\n").encode())
            self._pending = b""
            self._file.flush()
            line = self._file.readline(MAX_LINE)
        except OSError as exc:
            raise TransportError(f"{self.peer} {self.address}: {exc}") from exc
        if not line:
            raise TransportError(f"{self.peer} {self.address} closed the connection")
        try:
            reply = json.loads(line)
        except ValueError:
            raise TransportError(f"{self.peer} {self.address} sent a malformed reply") from None
        if not isinstance(reply, dict):
            raise TransportError(f"{self.peer} {self.address} sent a malformed reply")
        if not reply.get("ok"):
            raise Refused(f"{self.peer} {self.address} refused {_WHAT.get(op, repr(op))}: "
                          f"{reply.get('error', reply)}", str(reply.get("reason", "")))
        return reply

    def settimeout(self, seconds: float | None) -> None:
        self._sock.settimeout(seconds)

    @property
    def socket(self) -> socket.socket:
        return self._sock

    def closed_by_peer(self) -> bool:
        """Whether the peer has closed the connection: a peek, only once the socket is
        readable (a socket with a timeout waits for data even with MSG_DONTWAIT)."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            return bool(readable) and self._sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):  # reset, or closed here
            return True

    def close(self) -> None:
        try:
            self._file.close()
            self._sock.close()
        except OSError:
            pass
