"""A resize's placement: the tier's holdings over another set of servers, with the fewest moves.

Per MoE layer, every model expert keeps as many replicas as it has now (at least one, at most
one per server), and the replicas are spread evenly by count: every server of the new set ends
with ``floor`` or ``ceil`` of (replicas / servers). Within that, the plan moves as few replicas
as it can: a server that stays keeps what it holds up to its share, and only the replicas of
servers that go and the excess of servers over their share are placed anew, each on the
emptiest server of the new set that lacks that expert. Scaling out N -> M thus adds to the new
servers exactly their share and nothing else; scaling in moves only what the leaving servers
held (and evens out what that leaves). The placement is load-blind: the balancer
(docs/balancing.md) re-places by load afterwards. ESFT adapter experts stay where they are on
servers that stay; a leaving server's are placed again by the ESFT registrar (docs/esft.md).
"""

from __future__ import annotations

from typing import Sequence

from sglang_eaas.holdings import Holdings, ServerHoldings


class PlanError(ValueError):
    """The new set of servers cannot hold the tier (no servers, or a server named twice)."""


def resize_holdings(current: Holdings, servers: Sequence[str], num_experts: int,
                    replicas_of: Holdings | None = None) -> Holdings:
    """``current`` (the live tier's holdings, model experts and adapters) re-placed over
    ``servers`` (staying ones and new ones; a current server not named leaves), each expert
    with as many replicas as in ``replicas_of`` (by default ``current``; a resize that lost a
    server gives the holdings from before the loss, so the lost replicas are made again)."""
    if not servers or len(set(servers)) != len(servers):
        raise PlanError(f"a resize places over distinct servers, got {list(servers)}")
    layers = current.layers()
    model = current.model_experts(num_experts)
    counted = (replicas_of or current).model_experts(num_experts)
    out: dict[str, dict[int, list[int]]] = {s: {} for s in servers}
    for layer in layers:
        for s, experts in place_layer(model.layer(layer), servers, num_experts,
                                      counted.layer(layer)).items():
            out[s][layer] = experts
    for s, held in current.items():  # adapter experts stay with a staying server
        if s in out:
            for layer, physical in held.adapters.items():
                out[s][layer] = sorted({*out[s].get(layer, ()), *physical})
    return Holdings({s: ServerHoldings(held, current[s].adapters if s in current else None)
                     for s, held in out.items()})


def place_layer(current: dict[str, Sequence[int]], servers: Sequence[str], num_experts: int,
                replicas_of: dict[str, Sequence[int]] | None = None) -> dict[str, list[int]]:
    """One layer: ``current`` (server -> experts) re-placed over ``servers``, each expert with
    as many replicas as ``replicas_of`` (by default ``current``) gives it."""
    replicas = [0] * num_experts
    for experts in (current if replicas_of is None else replicas_of).values():
        for e in experts:
            replicas[e] += 1
    replicas = [min(max(r, 1), len(servers)) for r in replicas]
    total = sum(replicas)
    base, extra = divmod(total, len(servers))
    # the servers that hold the most now keep the larger shares (fewer moves)
    order = sorted(servers, key=lambda s: -len(current.get(s, ())))
    share = {s: base + (1 if i < extra else 0) for i, s in enumerate(order)}
    held: dict[str, list[int]] = {s: [] for s in servers}
    left = list(replicas)  # replicas of each expert still to place
    given_up = [0] * num_experts  # replicas of each expert a staying server let go
    for s in order:  # keep what a staying server holds, up to its share
        # over its share, it lets go of the experts let go least so far: the replicas to
        # place anew are then of many experts, which the new servers can take (one each)
        mine = sorted((e for e in current.get(s, ()) if left[e] > 0),
                      key=lambda e: (-given_up[e], e))
        for e in mine[:share[s]]:
            held[s].append(e)
            left[e] -= 1
        for e in mine[share[s]:]:
            given_up[e] += 1
    # the rest: experts with the most replicas left first, each on the emptiest server (by
    # room left in its share) that lacks it
    for e in sorted(range(num_experts), key=lambda e: -left[e]):
        for _ in range(left[e]):
            candidates = [s for s in servers if e not in held[s]]
            s = max(candidates, key=lambda s: (share[s] - len(held[s]), -order.index(s)))
            held[s].append(e)
    return {s: sorted(ids) for s, ids in held.items()}


def moved(current: Holdings, target: Holdings) -> int:
    """Replicas ``target`` adds (model and adapter experts): the fill's size in experts."""
    return sum(len(set(held.get(layer, ())) - set(current.get(s, {}).get(layer, ())))
               for s, held in target.items() for layer in held)
