"""The flags of every tool that changes the tier through the tier controller (docs/elastic.md,
"The tier controller"): ``--wait S``, to wait for the operation holding the tier instead of
being refused, and ``--id ID``, an operation id that a retry repeats; checked with the
operation lease's ttl (``SGLANG_EAAS_OPERATION_LEASE``) before anything starts."""

from __future__ import annotations

import argparse

from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.operations import MAX_WAIT, check_id, lease_ttl


def add(parser: argparse.ArgumentParser, refused: str, with_id: bool = True) -> None:
    """``--wait`` (``refused``: what happens without it) and, ``with_id``, ``--id``."""
    parser.add_argument("--wait", type=float, default=0.0, metavar="S",
                        help="if another operation holds the tier (a resize, a switch, a "
                        f"rebalance, ...), wait up to S seconds for it to end (at most "
                        f"{MAX_WAIT:.0f}; default 0: {refused})")
    if with_id:
        parser.add_argument("--id", default="",
                            help="operation id (1-64 letters, digits, '_.:-'): asking again "
                            "with the same id returns that operation instead of starting "
                            "another (default: a fresh one)")


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` (exit status 2, one sentence) for a bad ``--wait``, ``--id`` or
    ``SGLANG_EAAS_OPERATION_LEASE``."""
    if not 0 <= args.wait <= MAX_WAIT:
        parser.error(f"--wait is 0-{MAX_WAIT:.0f} seconds, got {args.wait}")
    if getattr(args, "id", ""):
        try:
            check_id(args.id)
        except ControlError as exc:
            parser.error(f"--id: {exc}")
    try:
        lease_ttl()
    except ValueError as exc:
        parser.error(str(exc))
