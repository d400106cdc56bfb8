"""How many replicas each expert of one MoE layer gets: MoEless's Algorithm 1, with guards.

The rule (docs/balancing.md, "Scaler"): start with one replica per expert; repeatedly give one
more replica to the straggler, the expert whose per-replica load (load / replicas) is highest
(ties: the lowest expert id), until the layer is balanced or a stop rule says more replicas
cannot help. The differences from the paper, each because the paper's rule misbehaves:

- the coefficient of variation (CV, std / mean) is taken over the replicas of experts with load
  only: zero-load experts are replicas no split can even out, so with them the CV stays high
  until the memory cap is spent (the zero-load guard); they never get a second replica;
- a replica heavier than one server's fair share (layer load / servers) forces some server over
  the mean whatever the placement, so splitting goes on while one exists, even if the CV target
  is met (a layer with one hot expert and the rest idle has CV 0 over its loaded experts);
- an expert has at most one replica per server, and splitting stops when the straggler has one
  on every server, when the layer's extra slots are spent, or when the split would not lower the
  CV and the straggler is within the fair share already.
"""

from __future__ import annotations

import numpy as np

# CV target of per-replica load. MoEless uses 0.2 (its section 6.4: lowest layer time among 0.2
# .. 1.0). docs/balancing.md shows why it is kept: with one replica per server at most, the
# fair-share rule does the heavy lifting and the target mostly decides how much finer to split.
DEFAULT_CV_TARGET = 0.2


def replica_cv(load: np.ndarray, replicas: np.ndarray) -> float:
    """CV (std / mean) of per-replica load over the replicas of experts with load > 0.

    ``load``: ``[E]`` tokens per expert (>= 0); ``replicas``: ``[E]`` replica counts (>= 1).
    Expert ``e`` counts as ``replicas[e]`` replicas of ``load[e] / replicas[e]`` tokens each.
    0.0 when no expert has load.
    """
    active = load > 0
    if not active.any():
        return 0.0
    counts = replicas[active].astype(np.float64)
    per_replica = load[active] / counts
    mean = load[active].sum() / counts.sum()
    var = float((counts * (per_replica - mean) ** 2).sum() / counts.sum())
    return float(np.sqrt(max(var, 0.0)) / mean)


def scale_layer(load: np.ndarray, num_servers: int, extra_slots: int,
                cv_target: float = DEFAULT_CV_TARGET) -> np.ndarray:
    """Replica counts ``[E]`` int64 (each in ``1 .. num_servers``) for one MoE layer.

    ``load``: ``[E]`` tokens per expert, measured or predicted (any real >= 0);
    ``num_servers``: the expert servers the layer is placed on (an expert gets at most one
    replica per server); ``extra_slots``: how many replicas beyond one per expert the layer may
    have (its memory cap: slots of all servers minus ``E``); ``cv_target``: stop once the CV of
    per-replica load (``replica_cv``) is at most this and no replica exceeds the fair share.
    """
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 1 or not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be a 1-D vector of finite numbers >= 0")
    if num_servers < 1 or extra_slots < 0 or not cv_target >= 0:
        raise ValueError(f"need num_servers >= 1, extra_slots >= 0 and cv_target >= 0, got "
                         f"{num_servers}, {extra_slots}, {cv_target}")
    replicas = np.ones(load.shape, dtype=np.int64)
    fair_share = load.sum() / num_servers
    cv = replica_cv(load, replicas)
    for _ in range(extra_slots):
        per_replica = load / replicas
        straggler = int(np.argmax(per_replica))  # the first of equals: the lowest id
        heaviest = per_replica[straggler]
        if heaviest <= 0:  # no expert has load: nothing to split
            break
        over_share = heaviest > fair_share * (1 + 1e-12)
        if (cv <= cv_target and not over_share) or replicas[straggler] >= num_servers:
            break
        replicas[straggler] += 1
        new_cv = replica_cv(load, replicas)
        if new_cv >= cv and not over_share:  # the split makes the layer no more even
            replicas[straggler] -= 1
            break
        cv = new_cv
    return replicas
