"""The authenticated JSON-line channel of every sglang-eaas TCP endpoint (expert servers' control
endpoints and the monitor).

A connection opens with one authentication line, ``EAAS-AUTH <token>\\n``, compared in constant
time before anything else on the connection is read or parsed; a connection that fails it (wrong
token, no line within ``AUTH_TIMEOUT``, a line over ``MAX_AUTH_LINE``) gets one error reply and
is closed. Then JSON lines, one request, one reply, each at most ``MAX_LINE`` bytes:

    -> {"op": OP, ...fields}   <- {"ok": true, ...} | {"ok": false, "error": SENTENCE, "reason": R}

``R`` is the counter the refusal is counted under. Both directions carry typed records
(``Message``: ``protocol/control.py`` for expert servers, ``protocol/monitor.py`` for the
monitor), checked field by field by ``check_fields`` where they arrive: a request names its op
and the record its reply is (``Request``), and a caller passes the record and gets the reply's
record back (``Channel.call``), as ``protocol/header.py`` does for the data path.
"""

from __future__ import annotations

import hmac
import json
import reprlib
import select
import socket
import typing
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

from ibgda import TransportError
from sglang_eaas.addresses import parse_address
from sglang_eaas.holdings import ServerHoldings

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
          "list[list[int]]": (list, "a list of lists of integers"),
          "str | None": ((str, type(None)), "a string or null")}
_ITEMS = {"list[str]": str, "list[int]": int}


def of_kind(value: Any, annotation: str) -> bool:
    """Whether ``value`` (from JSON) is of the field annotation ``annotation`` (``_KINDS``)."""
    kind = _KINDS[annotation][0]
    if isinstance(value, bool) and annotation != "bool":
        return False  # JSON true is not the integer 1
    if not isinstance(value, kind):
        return False
    if annotation == "list[list[int]]":
        return all(of_kind(row, "list[int]") for row in value)
    item = _ITEMS.get(annotation)
    return item is None or all(isinstance(v, item) and not isinstance(v, bool) for v in value)


def check_fields(record: type, message: dict[str, Any],
                 kinds: dict[str, str] | None = None) -> dict[str, Any]:
    """The fields of dataclass ``record`` from ``message``, each of its annotated type (a field
    with a default may be missing), else ``ControlError("bad_field", ...)``. ``kinds``: the
    fields to read and their types instead, for a record that converts others itself."""
    values = {}
    op = shown(message.get("op", record.__name__))
    optional = {f.name for f in fields(record)
                if f.default is not MISSING or f.default_factory is not MISSING}
    for name, kind in (kinds or {f.name: f.type for f in fields(record)}).items():
        if name not in message:
            if name in optional:
                continue
            raise ControlError("bad_field", f"{op} needs field {name!r}")
        value = message[name]
        if not of_kind(value, kind):
            raise ControlError("bad_field", f"{op}: field {name!r} must be "
                               f"{_KINDS[kind][1]}, got {type(value).__name__}")
        values[name] = value
    return values


class Message:
    """A typed record that crosses the channel (a dataclass): ``to_message`` is its JSON object,
    ``from_message`` checks each field's type (``check_fields``), then ``validate`` checks what
    types cannot say. Records with fields JSON cannot carry as they are (integer keys, nested
    records) convert them in these two methods and nowhere else."""

    @classmethod
    def from_message(cls, message: dict[str, Any]):
        record = cls(**check_fields(cls, message))
        record.validate()
        return record

    def to_message(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def validate(self) -> None:
        """Raise ``ControlError("bad_field", ...)`` for a value its type allows but the record
        does not."""


@dataclass(frozen=True)
class Done(Message):
    """The reply of a request that only succeeds (``{"ok": true}``)."""


class Request(Message):
    """A message that asks for something: its ``op`` and the record its reply is."""

    op: ClassVar[str]
    reply: ClassVar[type[Message]] = Done


# -- a server's holdings on the wire: integer keys become strings here ------------------------
HOLDINGS_FIELDS = ("layer_experts", "adapter_experts", "layer_parts")


def holdings_fields(held: ServerHoldings) -> dict[str, Any]:
    """``held`` as the wire carries it: ``layer_experts`` ``{str(layer): [ids]}``,
    ``adapter_experts`` ``{str(layer): {str(physical id): [adapter, base expert, digest]}}`` and
    ``layer_parts`` ``{str(layer): [parts, [routed part ids]]}`` (``HeldParts``; left out when
    the server holds no parts, so a message of a server without them is unchanged)."""
    fields = {"layer_experts": held.layers_message(), "adapter_experts": held.adapters_message()}
    if held.parts:
        fields["layer_parts"] = held.parts_message()
    return fields


def read_holdings(message: dict[str, Any]) -> tuple[dict[str, Any], ServerHoldings]:
    """``message`` without its holdings fields, and the ``ServerHoldings`` they carry;
    ``ControlError("bad_field")`` for anything but ``holdings_fields``' shapes."""
    layers = message.get("layer_experts", {})
    adapters = message.get("adapter_experts", {})
    if not isinstance(layers, dict) or not all(
            isinstance(layer, str) and layer.isdigit() and isinstance(ids, list)
            and all(type(e) is int and e >= 0 for e in ids) for layer, ids in layers.items()):
        raise ControlError("bad_field", f"layer_experts maps MoE layer numbers to lists of "
                           f"expert ids, got {shown(layers)}")
    if not isinstance(adapters, dict) or not all(
            isinstance(layer, str) and layer.isdigit() and isinstance(experts, dict) and all(
                physical.isdigit() and isinstance(v, list) and len(v) == 3
                and isinstance(v[0], str) and type(v[1]) is int and v[1] >= 0
                and isinstance(v[2], str) for physical, v in experts.items())
            for layer, experts in adapters.items()):
        raise ControlError("bad_field", f"adapter_experts maps MoE layer numbers to "
                           f"{{physical expert id: [adapter, base expert, digest]}}, got "
                           f"{shown(adapters)}")
    parts = message.get("layer_parts", {})
    if not isinstance(parts, dict) or not all(
            isinstance(layer, str) and layer.isdigit() and isinstance(v, list) and len(v) == 2
            and type(v[0]) is int and v[0] >= 2 and isinstance(v[1], list)
            and all(type(e) is int and e >= 0 for e in v[1]) for layer, v in parts.items()):
        raise ControlError("bad_field", f"layer_parts maps MoE layer numbers to [parts >= 2, "
                           f"[routed part ids]], got {shown(parts)}")
    try:
        held = ServerHoldings.from_message(layers, adapters, parts)
    except ValueError as exc:
        raise ControlError("bad_field", f"layer_experts: {exc}") from None
    return {k: v for k, v in message.items() if k not in HOLDINGS_FIELDS}, held


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
         "report": "a report", "add_experts": "to add experts",
         "drop_experts": "to drop experts", "expert_weights": "an expert's weights",
         "export_weights": "to lend experts' weights", "release_weights": "a weights lease's end",
         "acquire": "the operation lease", "renew": "the operation lease's renewal",
         "record_operation": "an operation's record", "operations": "the operations"}



def _what(op: Any) -> str:
    return _WHAT.get(op, repr(op)) if isinstance(op, str) else repr(op)


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

    def call(self, request: Request):
        """Send ``request``; its reply's record, ``Refused`` if refused, ``TransportError`` if
        the line broke or the reply is not the record the request expects."""
        reply = self.exchange({"op": request.op, **request.to_message()})
        try:
            return request.reply.from_message(reply)
        except (ControlError, TypeError, KeyError) as exc:
            raise TransportError(f"{self.peer} {self.address} sent a malformed reply to "
                                 f"{_what(request.op)}: {exc}") from None

    def exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one JSON object as it is, return the reply's (``call`` is the typed way; this
        is for peers that send what no record allows, as the fuzzer and its tests do)."""
        op = message.get("op")
        try:
            self._file.write(self._pending + (json.dumps(message) + "\n").encode())
            self._pending = b""
            self._file.flush()
            line = self._file.readline(MAX_LINE)
        except OSError as exc:
            raise TransportError(f"{self.peer} {self.address}: {exc}") from exc
        if not line:
            raise TransportError(f"{self.peer} {self.address} closed the connection")
        if line.startswith(b"HTTP/"):
            raise TransportError(f"{self.address} answered in HTTP ({shown(line.strip()[:40])}"
                                 f"): it is a web server, not an sglang-eaas {self.peer}")
        try:
            reply = json.loads(line)
        except ValueError:
            raise TransportError(f"{self.peer} {self.address} sent a malformed reply "
                                 f"({shown(line.strip()[:40])}): is it an sglang-eaas "
                                 f"{self.peer}?") from None
        if not isinstance(reply, dict):
            raise TransportError(f"{self.peer} {self.address} sent a malformed reply")
        if not reply.get("ok"):
            raise Refused(f"{self.peer} {self.address} refused {_what(op)}: "
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
