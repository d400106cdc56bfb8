"""What the tier controller refuses before an operation starts: each bound one sentence
(``Refusal``), checked by the front end that takes the request (HTTP 400, exit status 1 or 2)
and again by the driver once it holds the lease (the tier may have changed meanwhile).

* a resize or a rebalance: no layer in TP (they place whole experts: switch to EP first);
* a resize: at least one server, at most what the placement can use (every active server must
  hold something in every MoE layer: ``placement_limit``) and at most ``--eaas-max-servers``;
  a scale-out needs standby servers or a launcher for the servers it adds;
* a retirement: named servers that serve in the tier, and a tier left with one active server;
* a switch: a model some server serves, parts the group can hold and the experts can be cut
  into (``elastic/switch.py`` checks them: ``SwitchError``).
"""

from __future__ import annotations

from typing import Sequence

from sglang_eaas.controller.end_state import layouts_of
from sglang_eaas.holdings import Holdings
from sglang_eaas.protocol.monitor import Snapshot

MAX_RETIRE = 64  # servers one retirement names at most


class Refusal(ValueError):
    """An operation refused before it started: one sentence."""


def placement_limit(holdings: Holdings, num_experts: int) -> int:
    """The most active servers a resize's placement gives something in every MoE layer: the
    fewest expert replicas of any layer (each expert counted at least once; a server past
    that would hold nothing there)."""
    fewest = None
    for layer in holdings.layers():
        replicas = [0] * num_experts
        for ids in holdings.layer(layer).values():
            for e in ids:
                if e < num_experts:
                    replicas[e] += 1
        total = sum(max(r, 1) for r in replicas)
        fewest = total if fewest is None else min(fewest, total)
    return fewest if fewest is not None else num_experts


def check_whole_experts(holdings: Holdings, num_experts: int, what: str) -> None:
    """``Refusal`` where a MoE layer is in TP: ``what`` (a resize, a rebalance) places whole
    experts."""
    tp = sorted(layer for layer, parts in layouts_of(holdings, num_experts).items() if parts > 1)
    if tp:
        raise Refusal(f"MoE layers {tp} are in TP and {what} places whole experts: switch "
                      "them to EP first (python -m sglang_eaas.tools.switch --to ep)")


def check_resize(servers: int, snapshot: Snapshot, fingerprint: str | None, num_experts: int,
                 max_servers: int | None, launcher: bool, retire: Sequence[str] = ()) -> None:
    """``Refusal`` unless a resize to ``servers`` active servers (``retire`` leaving) can be
    made on the tier of ``snapshot``."""
    if type(servers) is not int or servers < 1:
        raise Refusal(f"a tier keeps at least one active expert server: servers must be >= 1, "
                      f"not {servers!r}")
    holdings = snapshot.holdings(fingerprint)
    if not holdings:
        raise Refusal("no expert server of the tier serves this model")
    check_whole_experts(holdings, num_experts, "a resize")
    limit = placement_limit(holdings, num_experts)
    if servers > limit:
        raise Refusal(f"{servers} active expert servers are more than the placement can use: "
                      f"each MoE layer has at most {limit} expert replicas, so "
                      f"{servers - limit} servers would hold nothing")
    if max_servers is not None and servers > max_servers:
        raise Refusal(f"{servers} active expert servers are more than --eaas-max-servers "
                      f"{max_servers}")
    active, standby = snapshot.active_and_standby(fingerprint)
    if len(retire) > MAX_RETIRE:
        raise Refusal(f"a retirement names at most {MAX_RETIRE} servers, not {len(retire)}")
    unknown = [s for s in retire if s not in active and s not in standby]
    if unknown:
        raise Refusal(f"expert servers {unknown} do not serve in the tier (serving: "
                      f"{sorted(active + standby)})")
    staying = [s for s in active if s not in retire]
    if not staying:
        raise Refusal("retiring every active expert server would leave no expert held")
    spare = len([s for s in standby if s not in retire])
    if servers > len(staying) + spare and not launcher:
        raise Refusal(f"{servers} active expert servers need {servers - len(staying) - spare} "
                      f"more than the tier has (active {len(staying)}, standby {spare}) and no "
                      "launcher starts servers here: start standby servers (python -m "
                      "sglang_eaas.expert_server --standby) first")
