"""The failure detector's default timings, every member's and monitor's (docs/fault-tolerance.md,
"Suspected, then lost")."""

# A member without a heartbeat for SUSPECT_TIMEOUT is suspected (clients prefer its experts' other
# holders), for LOSS_TIMEOUT lost; a dead process is lost at once (its connections close) and a
# hung server at a client's result timeout, so the loss timeout only bounds what nothing else
# sees (a partition from the monitor alone, a member nobody sends to).
HEARTBEAT = 0.3  # seconds between heartbeats
SUSPECT_TIMEOUT = 1.0  # seconds without one before the member is suspected
LOSS_TIMEOUT = 10.0  # seconds without one before the member is lost


def suspect_timeout(loss: float, given: float | None = None) -> float:
    """The suspect timeout of a monitor losing members after ``loss`` seconds: ``given``, else
    ``SUSPECT_TIMEOUT`` or ``loss`` if that is shorter (one stage)."""
    return given if given is not None else min(SUSPECT_TIMEOUT, loss)
