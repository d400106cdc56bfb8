"""The 1-byte slot state flag and who may move it where."""

from __future__ import annotations

import enum


class SlotState(enum.IntEnum):
    EMPTY = 0  # the client may write a request
    CLIENT_WRITE_DONE = 1  # a complete request is published; the server may read it
    SERVER_DONE = 2  # the result is published; the client may read it
    OFFLINE = 3  # no live client owns the slot


class Actor(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class ProtocolError(RuntimeError):
    """An illegal state transition or a malformed message."""


_S = SlotState
# (actor, from, to): the only moves the protocol allows.
LEGAL_TRANSITIONS: frozenset[tuple[Actor, SlotState, SlotState]] = frozenset(
    {
        (Actor.CLIENT, _S.EMPTY, _S.CLIENT_WRITE_DONE),  # publish a request
        (Actor.CLIENT, _S.SERVER_DONE, _S.CLIENT_WRITE_DONE),  # result consumed, next request
        (Actor.CLIENT, _S.SERVER_DONE, _S.EMPTY),  # result consumed, idle
        (Actor.CLIENT, _S.EMPTY, _S.OFFLINE),  # orderly leave
        (Actor.CLIENT, _S.SERVER_DONE, _S.OFFLINE),
        (Actor.SERVER, _S.CLIENT_WRITE_DONE, _S.SERVER_DONE),  # publish a result (or rejection)
        (Actor.SERVER, _S.OFFLINE, _S.EMPTY),  # hand the slot to a newly joined client
        # The server reclaims the slot of a client it has found dead, whatever the state.
        (Actor.SERVER, _S.EMPTY, _S.OFFLINE),
        (Actor.SERVER, _S.CLIENT_WRITE_DONE, _S.OFFLINE),
        (Actor.SERVER, _S.SERVER_DONE, _S.OFFLINE),
    }
)


def check_transition(actor: Actor, current: int, new: SlotState) -> None:
    """Raise ``ProtocolError`` unless ``actor`` may move a slot from ``current`` to ``new``."""
    try:
        current_state = SlotState(current)
    except ValueError:
        raise ProtocolError(f"slot flag holds {current}, which is not a SlotState") from None
    if (actor, current_state, new) not in LEGAL_TRANSITIONS:
        raise ProtocolError(
            f"{actor.value} may not move a slot from {current_state.name} to {new.name}"
        )
