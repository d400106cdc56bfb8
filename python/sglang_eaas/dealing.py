"""Dealing one exchange's top-k entries to the expert servers that hold their experts, by load.

An exchange is one call of the client's routing: one chunk of one micro-batch's rows of one MoE
layer, ``[T, K]`` expert ids. An expert with one holder sends it all its entries; the entries of
a replicated expert are dealt so that the servers' entry counts for the exchange come out as even
as the holdings allow (docs/balancing.md, "Dealing replicated experts"):

1. count: each valid entry (id >= 0) of a single-holder expert counts for its holder;
2. deal, in rounds: the replicated experts (``r > 1`` holders) with entries, in order of count
   (most first, then ascending id); in round ``q`` each of them with more than ``q`` entries
   deals its ``q``-th entry to its holder with the fewest entries so far; a tie goes to the first
   in the rotated order ``start, start + 1, ...`` (mod ``r``), ``start = (sum of the exchange's
   valid ids + e) mod r``: a lone entry does not always land on the first holder, and no state
   is kept between calls, so every attention rank, retry and CUDA graph replay deals the same
   ids the same way. (Rounds rather than one expert's entries all at once: an expert dealt
   early would otherwise fill the servers a later one has no alternative to.)
3. place: an expert's ``q``-th entry in flat (token, k) order goes where its ``q``-th dealt
   entry went.

So the per-server counts are a function of the per-expert counts alone (``deal_counts``):
what an offline evaluation of one step's load (``balance.evaluate.layer_load`` with
``whole_tokens``) computes is exactly what the client sends. Three implementations follow this
text and are compared by the tests against an independent one: the C++ op
(``sgl_kernel_ext.cpu_ops.deal_entries``, the host path), NumPy here (where that library cannot
be built), and the device path's torch ops with a Triton kernel
(``sgl_kernel_ext.deal_entries_kernel``).
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

NO_HOLDER = -2  # the server index of an entry whose expert no server holds

# Why the C++ op cannot be used in this process (its build failed), else None: tried once.
_cpu_unavailable: str | None = None


def exchange_offset(counts: np.ndarray) -> int:
    """The tie-break rotation of an exchange with ``counts [E]`` entries per expert: the sum of
    its valid ids."""
    return int(np.dot(np.arange(counts.size, dtype=np.int64), counts))


def deal_counts(counts: np.ndarray, holders: np.ndarray, replicas: np.ndarray,
                num_servers: int, offset: int) -> dict[int, list[int]]:
    """Steps 1-2 on ``counts [E]`` (entries per expert): replicated expert ``e`` -> the holder
    columns (of ``holders[e]``) its 0th, 1st, ... entries are dealt to; experts with one holder
    or no entry are not in it. ``holders [E, W]`` int64 (``NO_HOLDER`` for an expert no server
    holds), ``replicas [E]``; ``offset``: ``exchange_offset(counts)``."""
    counts = np.asarray(counts, dtype=np.int64)
    single = (replicas == 1) & (holders[:, 0] >= 0)
    load = np.bincount(holders[single, 0], weights=counts[single],
                       minlength=num_servers).astype(np.int64).tolist()
    order = sorted(np.flatnonzero((replicas > 1) & (counts > 0)).tolist(),
                   key=lambda e: (-int(counts[e]), e))
    dealt: dict[int, list[int]] = {e: [] for e in order}
    rows = {e: holders[e, :int(replicas[e])].tolist() for e in order}
    for q in range(int(counts[order[0]]) if order else 0):
        for e in order:
            if counts[e] <= q:
                break
            row = rows[e]
            start = (int(offset) + e) % len(row)
            best = min(range(len(row)),  # min keeps the first of equals: the rotated order
                       key=lambda j: (load[row[j]], (j - start) % len(row)))
            dealt[e].append(best)
            load[row[best]] += 1
    return dealt


def deal_entries(ids: np.ndarray, holders: np.ndarray, replicas: np.ndarray,
                 num_servers: int, holders_t=None, replicas_t=None) -> np.ndarray:
    """``ids`` (any shape, < 0: no entry) -> int64 server indices in its shape (-1 for no
    entry, ``NO_HOLDER`` for an expert no server holds), dealt by the rule above: the C++ op,
    or NumPy where it cannot be built (logged once). ``holders_t``/``replicas_t``: the same
    tables as torch tensors sharing their memory, made once by the caller (each call would
    otherwise wrap them again)."""
    global _cpu_unavailable
    if _cpu_unavailable is None:
        import torch
        from sgl_kernel_ext import cpu_ops

        try:
            return cpu_ops.deal_entries(
                torch.from_numpy(np.ascontiguousarray(ids)),
                torch.from_numpy(holders) if holders_t is None else holders_t,
                torch.from_numpy(replicas) if replicas_t is None else replicas_t,
                num_servers).numpy()
        except cpu_ops.KernelUnavailable as exc:  # one sentence already
            _cpu_unavailable = str(exc)
            logger.warning("expert entries are dealt by NumPy in this process: %s", exc)
    return deal_entries_numpy(ids, holders, replicas, num_servers)


def deal_entries_numpy(ids: np.ndarray, holders: np.ndarray, replicas: np.ndarray,
                       num_servers: int) -> np.ndarray:
    """``deal_entries`` in NumPy (steps 1-2 by ``deal_counts``, step 3 vectorised)."""
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    valid = flat >= 0
    experts = flat[valid]
    if experts.size and experts.max() >= holders.shape[0]:
        raise ValueError(f"expert id {int(experts.max())} is not below {holders.shape[0]} (the "
                         "routing table's experts)")
    counts = np.bincount(experts, minlength=holders.shape[0])
    first = np.cumsum(counts) - counts  # expert e's dealt entries: dealt[first[e] + q]
    dealt = np.zeros(experts.size, dtype=np.int64)
    for e, columns in deal_counts(counts, holders, replicas, num_servers,
                                  exchange_offset(counts)).items():
        dealt[first[e]:first[e] + len(columns)] = holders[e, columns]
    order = np.argsort(experts, kind="stable")  # each entry's rank among its expert's entries
    rank = np.empty_like(experts)
    ranked = experts[order]
    rank[order] = np.arange(experts.size) - np.searchsorted(ranked, ranked)
    out = np.full(flat.shape, -1, dtype=np.int64)
    out[valid] = np.where(replicas[experts] > 1, dealt[first[experts] + rank],
                          holders[experts, 0])
    return out.reshape(np.shape(ids))
