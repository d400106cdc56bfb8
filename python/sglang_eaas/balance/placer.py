"""Which servers hold the replicas of one MoE layer: MoEless's Algorithm 2, with warm reuse
bounded by balance, and the whole model (scaler + placer on every layer).

A layer's placement is ``{server: sorted experts}``; a model's is a ``Holdings``. Capacity is
counted in expert slots per MoE layer per server: a server may hold at most ``slots`` experts of
each layer (each distinct; one slot is one expert's weights). docs/balancing.md, "Placer", says
why and how.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from sglang_eaas.balance.scaler import DEFAULT_CV_TARGET, scale_layer
from sglang_eaas.holdings import Holdings
from sglang_eaas.placement import PlacementError

LayerPlacement = Mapping[str, Sequence[int]]  # server -> experts of one MoE layer

# How much more (relative) the busiest server may carry than in a placement from scratch, for
# a layer to be left as it is (``balance_model``) or placed warm (``place_layer``).
DEFAULT_WARM_SLACK = 0.05


@dataclass(frozen=True)
class Move:
    """What one server loads (``adds``) and frees (``drops``) in one MoE layer."""

    layer: int
    server: str
    adds: tuple[int, ...]
    drops: tuple[int, ...]


def place_layer(replicas: np.ndarray, load: np.ndarray, servers: Sequence[str], slots: int,
                previous: LayerPlacement | None = None,
                warm_slack: float = DEFAULT_WARM_SLACK) -> dict[str, list[int]]:
    """``{server: sorted experts}`` for every server of ``servers`` (stable ids).

    ``replicas``: ``[E]`` replica counts (``1 .. len(servers)``); ``load``: ``[E]`` tokens per
    expert (split evenly over its replicas); ``slots``: experts of this layer one server may hold;
    ``previous``: the layer's current placement (servers not in ``servers`` are ignored).

    Replicas go most loaded first (per-replica load, then expert id) to the least loaded server
    (tokens, then experts held, then order in ``servers``) that has room and no copy of the
    expert. Candidates: from scratch, then improved by moving or swapping replicas off the
    busiest server while that lowers it (``_refine``); warm (a replica goes to a server that
    held the expert in ``previous`` whenever one has room), as is and refined just enough;
    warm only where that server stays within the bound, as is and refined just enough. The
    bound: ``1 + warm_slack`` times the scratch candidate's busiest server, but never above
    what ``previous`` gives on ``load`` (with its own replicas) unless scratch is above that
    too: re-placing must not make the layer worse than leaving it. Of the candidates within the
    bound, the one with the fewest changes from ``previous`` wins (ties: the earlier), so an
    unchanged input gives ``previous`` back.
    """
    replicas = np.asarray(replicas, dtype=np.int64)
    load = np.asarray(load, dtype=np.float64)
    num_experts, num_servers = len(load), len(servers)
    if replicas.shape != load.shape or load.ndim != 1:
        raise ValueError(f"replicas {replicas.shape} and load {load.shape} must be [E] vectors")
    if num_servers < 1 or len(set(servers)) != num_servers:
        raise PlacementError(f"servers must be distinct and at least one, got {list(servers)}")
    if num_experts > num_servers * slots:
        raise PlacementError(f"{num_servers} servers of {slots} slots per layer cannot hold "
                             f"each of the {num_experts} experts once")
    if (replicas < 1).any() or (replicas > num_servers).any():
        raise PlacementError(f"replica counts must be in 1..{num_servers} (one per server)")
    if replicas.sum() > num_servers * slots:
        raise PlacementError(f"{replicas.sum()} replicas do not fit {num_servers} servers of "
                             f"{slots} slots per layer")
    warm = [set(previous.get(s, ())) if previous else set() for s in servers]
    if any(e < 0 or e >= num_experts for held in warm for e in held):
        raise PlacementError(f"the previous placement names experts outside 0..{num_experts - 1}")
    per_replica = load / replicas
    order = sorted(range(num_experts), key=lambda e: (-per_replica[e], e))
    items = [e for e in order for _ in range(replicas[e])]

    scratch = _refine(_greedy(items, per_replica, num_servers, slots, None, None), per_replica,
                      slots)
    # never worse than the previous placement already is under these loads, nor than scratch
    best_known = _busiest(scratch, per_replica)
    bound = min(best_known * (1 + warm_slack), max(best_known, _as_was(warm, load)))
    bound *= 1 + 1e-9
    candidates = [scratch]
    if previous:
        for limit in (None, bound):
            kept = _greedy(items, per_replica, num_servers, slots, warm, limit)
            candidates += [kept, _refine([set(h) for h in kept], per_replica, slots, bound)]
    fit = [c for c in candidates if _busiest(c, per_replica) <= bound]
    best = min(fit, key=lambda c: sum(len(h ^ w) for h, w in zip(c, warm)))
    return {s: sorted(held) for s, held in zip(servers, best)}


def _as_was(warm: list[set[int]], load: np.ndarray) -> float:
    """The busiest server's tokens if the previous placement stayed (infinite if it leaves an
    expert with load unplaced)."""
    holders = _holders(warm, len(load))
    if ((holders == 0) & (load > 0)).any():
        return float("inf")
    return _busiest(warm, np.divide(load, holders, out=np.zeros_like(load), where=holders > 0))


def _busiest(held: list[set[int]], per_replica: np.ndarray) -> float:
    return max(float(sum(per_replica[e] for e in h)) for h in held)


def _greedy(items: list[int], per_replica: np.ndarray, num_servers: int, slots: int,
            warm: list[set[int]] | None, bound: float | None) -> list[set[int]]:
    """Each item (an expert id, once per replica, in placing order) to a server; see
    ``place_layer``. ``bound``: a warm server is used only if it stays at most this loaded."""
    held: list[set[int]] = [set() for _ in range(num_servers)]
    tokens = [0.0] * num_servers

    def key(s: int) -> tuple[float, int, int]:
        return (tokens[s], len(held[s]), s)

    for e in items:
        w = float(per_replica[e])
        open_ = [s for s in range(num_servers) if len(held[s]) < slots and e not in held[s]]
        hot = [s for s in open_ if warm and e in warm[s]
               and (bound is None or tokens[s] + w <= bound)]
        if hot or open_:
            target = min(hot or open_, key=key)
        else:
            target = _make_room(e, held, tokens, per_replica, slots)
        held[target].add(e)
        tokens[target] += w
    return held


def _make_room(e: int, held: list[set[int]], tokens: list[float], per_replica: np.ndarray,
               slots: int) -> int:
    """Every server with room already holds ``e``: move another expert ``f`` from a full
    server ``t`` without ``e`` to a server ``s`` with room that lacks ``f``; returns ``t``.

    With one ``slots`` for all servers such a move exists: ``s`` holds ``e`` and fewer than
    ``slots`` experts, ``t`` holds ``slots`` without ``e``, so ``t`` has experts ``s`` lacks.
    """
    w = float(per_replica[e])
    best: tuple[float, int, int, int] | None = None
    for s in (s for s in range(len(held)) if len(held[s]) < slots):
        for t in (t for t in range(len(held)) if e not in held[t]):
            for f in sorted(held[t] - held[s]):
                moved = float(per_replica[f])
                worst = max(tokens[s] + moved, tokens[t] - moved + w)
                if best is None or worst < best[0]:
                    best = (worst, s, t, f)
    assert best is not None, "the replica counts fit the slots, so a swap must exist"
    _, s, t, f = best
    held[t].discard(f)
    held[s].add(f)
    moved = float(per_replica[f])
    tokens[t] -= moved
    tokens[s] += moved
    return t


def _refine(held: list[set[int]], per_replica: np.ndarray, slots: int,
            enough: float | None = None, max_rounds: int = 1000) -> list[set[int]]:
    """Lower the busiest server by moving one of its replicas to another server, or swapping one
    for a lighter replica there, while that strictly lowers the busier of the two (each step
    lowers the sum of squared server loads, so this ends) and, if given, until the busiest
    carries at most ``enough``. Keeps slots and distinctness; changes ``held``."""
    tokens = [float(sum(per_replica[e] for e in h)) for h in held]
    for _ in range(max_rounds):
        b = max(range(len(held)), key=lambda s: (tokens[s], -s))
        if enough is not None and tokens[b] <= enough:
            break
        best: tuple[float, int, int, int] | None = None  # (pair max after, t, e, f or -1)
        for e in sorted(held[b]):
            w = float(per_replica[e])
            for t in range(len(held)):
                if t == b or e in held[t]:
                    continue
                options = [-1] if len(held[t]) < slots else []
                options += [f for f in sorted(held[t] - held[b]) if per_replica[f] < w]
                for f in options:
                    d = w - (float(per_replica[f]) if f >= 0 else 0.0)
                    after = max(tokens[b] - d, tokens[t] + d)
                    if after < tokens[b] * (1 - 1e-9) and (best is None or after < best[0]):
                        best = (after, t, e, f)
        if best is None:
            break
        _, t, e, f = best
        d = float(per_replica[e]) - (float(per_replica[f]) if f >= 0 else 0.0)
        held[b].discard(e)
        held[t].add(e)
        if f >= 0:
            held[t].discard(f)
            held[b].add(f)
        tokens[b] -= d
        tokens[t] += d
    return held


def balance_model(loads: np.ndarray, layers: Sequence[int], servers: Sequence[str], slots: int,
                  previous: Holdings | None = None, cv_target: float = DEFAULT_CV_TARGET,
                  slots_total: int | None = None,
                  warm_slack: float = DEFAULT_WARM_SLACK) -> Holdings:
    """Scale and place every MoE layer: every server of ``servers`` and its experts there.

    ``loads``: ``[L, E]`` tokens per (layer, expert), rows in the order of ``layers``;
    ``slots``: experts of one layer a server may hold; ``slots_total``: optionally, experts of
    all layers together a server may hold, split evenly over the layers (each layer then gets
    ``min(slots, slots_total // L)``); ``previous``: the current model placement (warm reuse).
    A layer whose previous placement still fits and whose busiest server is within
    ``1 + warm_slack`` of a placement from scratch is kept as it is (``_keeps``): small load
    changes move nothing. Otherwise ``place_layer`` places it, warm from ``previous``.
    """
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2 or loads.shape[0] != len(layers):
        raise ValueError(f"loads must be [layers={len(layers)}, experts], got {loads.shape}")
    if slots_total is not None:
        slots = min(slots, slots_total // max(1, len(layers)))
    num_experts = loads.shape[1]
    if num_experts > len(servers) * slots:
        raise PlacementError(f"{len(servers)} servers of {slots} slots per layer cannot hold "
                             f"each of the {num_experts} experts once")
    out: dict[str, dict[int, list[int]]] = {s: {} for s in servers}
    for row, layer in enumerate(layers):
        replicas = scale_layer(loads[row], len(servers), len(servers) * slots - num_experts,
                               cv_target)
        before = ({s: held[layer] for s, held in previous.items() if layer in held}
                  if previous else None)
        fresh = place_layer(replicas, loads[row], servers, slots)
        if before and _keeps(before, fresh, loads[row], servers, slots, warm_slack):
            placed = {s: sorted(before.get(s, ())) for s in servers}
        else:
            placed = place_layer(replicas, loads[row], servers, slots, before, warm_slack)
        for s, experts in placed.items():
            out[s][layer] = experts
    return Holdings(out)


def _keeps(before: LayerPlacement, fresh: LayerPlacement, load: np.ndarray,
           servers: Sequence[str], slots: int, warm_slack: float) -> bool:
    """Whether the layer stays as it is: ``before`` fits (only ``servers``, at most ``slots``
    each, every expert held) and its busiest server carries at most ``1 + warm_slack`` times
    what ``fresh``'s (placed from scratch) does, each with its own replicas, under ``load``."""
    if any(not 0 <= e < len(load) for held in before.values() for e in held):
        raise PlacementError(f"the previous placement names experts outside "
                             f"0..{len(load) - 1}")
    gone = set(before) - set(servers)
    if any(before[s] for s in gone) or any(len(set(e)) > slots for e in before.values()):
        return False
    was = [set(before.get(s, ())) for s in servers]
    if (_holders(was, len(load)) == 0).any():
        return False
    now = _as_was([set(fresh[s]) for s in servers], load)
    return _as_was(was, load) <= now * (1 + warm_slack) * (1 + 1e-9)


def _holders(held: list[set[int]], num_experts: int) -> np.ndarray:
    """``[E]``: how many of ``held`` hold each expert."""
    counts = np.zeros(num_experts, dtype=np.int64)
    for h in held:
        counts[list(h)] += 1
    return counts


def moves(old: Holdings, new: Holdings) -> list[Move]:
    """Per (layer, server), what ``new`` adds and drops relative to ``old`` (a server in only
    one of them adds or drops all it holds there); empty when they hold the same."""
    found = []
    for server in sorted(set(old) | set(new)):
        was, now = old.get(server, {}), new.get(server, {})
        for layer in sorted(set(was) | set(now)):
            have, want = set(was.get(layer, ())), set(now.get(layer, ()))
            if have != want:
                found.append(Move(layer, server, tuple(sorted(want - have)),
                                  tuple(sorted(have - want))))
    return sorted(found, key=lambda m: (m.layer, m.server))
