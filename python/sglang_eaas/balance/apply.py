"""Applying a placement to the live expert tier: adds first, then drops.

From the tier's current ``Holdings`` (the monitor's snapshot: ``Snapshot.holdings``) to a
target, every (server, layer) gets the experts it lacks with ``add_experts`` (read from a server
that holds them now), and only once every add is done do servers ``drop_experts`` what the
target no longer gives them; so every expert keeps a live holder throughout, and clients switch
tables between steps (docs/protocol.md, "Replicas").
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from sglang_eaas.balance.placer import Move, moves
from sglang_eaas.holdings import Holdings
from sglang_eaas.protocol.control import AddExperts, DropExperts, call
from sglang_eaas.protocol.operations import NO_FENCE, Fence


@dataclass
class Applied:
    """What ``apply_placement`` did: the changes, where added weights came from, how long."""

    changes: list[Move] = field(default_factory=list)
    from_peer: int = 0
    from_disk: int = 0
    seconds: float = 0.0


def apply_placement(current: Holdings, target: Holdings, token: str, grace: float = 2.0,
                    say: Callable[[str], None] = lambda line: None,
                    timeout: float = 120.0, done: Applied | None = None,
                    fence: Fence = NO_FENCE) -> Applied:
    """Make the live tier hold ``target``: every add (from a current holder), then every drop,
    each under the operation lease's ``fence`` (checked before each). Raises what a server
    refuses with (``Refused``: e.g. a drop of a last holder) or a lost server's
    ``TransportError``, after the changes before it were made (counted in ``done``, where
    given, as they are made)."""
    began = time.monotonic()
    # servers in only one of them are not placement (joining and leaving are the tier's)
    both = set(current) & set(target)
    done = done if done is not None else Applied()
    done.changes = moves(current.only(both), target.only(both))
    for change in done.changes:
        if not change.adds:
            continue
        holders = current.holders(change.layer)
        by_source: dict[str, list[int]] = defaultdict(list)
        for e in change.adds:
            sources = [s for s in holders.get(e, ()) if s != change.server]
            # spread the reads over the holders: the one least read from so far
            source = min(sources, key=lambda s: (len(by_source.get(s, ())), s), default="")
            by_source[source].append(e)
        for source, experts in by_source.items():
            fence.check()
            added = call(change.server, AddExperts(change.layer, experts, source,
                                                   epoch=fence.epoch), token, timeout)
            done.from_peer += len(added.from_peer)
            done.from_disk += len(added.from_disk)
            say(f"{change.server}: MoE layer {change.layer} +{experts} (from "
                f"{source or 'disk'})")
    for change in done.changes:
        if change.drops:
            fence.check()
            call(change.server, DropExperts(change.layer, list(change.drops), grace=grace,
                                            epoch=fence.epoch), token, timeout)
            say(f"{change.server}: MoE layer {change.layer} -{list(change.drops)}")
    done.seconds = time.monotonic() - began
    return done

