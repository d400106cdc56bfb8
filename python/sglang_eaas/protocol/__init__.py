"""The slot protocol between attention clients and expert servers (docs/protocol.md).

Every (client, server) pair owns one *slot* in the server's region: a state flag, a request
header, a request payload, a result header and a result payload. Only the client writes
requests and reads results; the server only reads requests, writes results and flips the flag.
"""

from sglang_eaas.protocol.flags import Actor, ProtocolError, SlotState, check_transition
from sglang_eaas.protocol.header import HeaderError, RequestHeader, ResultHeader, ResultStatus
from sglang_eaas.protocol.layout import RegionLayout, SlotLayout

__all__ = [
    "Actor", "HeaderError", "ProtocolError", "RegionLayout", "RequestHeader", "ResultHeader",
    "ResultStatus", "SlotLayout", "SlotState", "check_transition",
]
