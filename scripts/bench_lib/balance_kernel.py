"""bench_balance's measured MoE-layer time: the expert servers' kernel on each server's share.

For one decode step and MoE layer under a placement, each server gets what the client would
send it: ``ExpertRouting`` deals a replicated expert's entries by load over its holders (an
EPLB double on one server counts as two holders there, each its own weight set, as SGLang runs
it), and a server gets the tokens with an entry on it, those entries as its local rows. Its time
is one ``weighted_expert_sum`` (the fast kernel, 1 thread) over the trained checkpoint's
experts it holds (their weights copied out per server, as a server loads them); the step's
layer time is the max over servers (the straggler); a server with no entry is not called.
Every call is timed ``repeat`` times, the repeats interleaved over the policies, and its fastest
time counts: other processes on the shared cores only ever add time, and the medians scattered
so much that the placements' differences drowned in them (R^2 of the fit below 0.5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from sglang_eaas.expert_server.compute import weighted_expert_sum
from sglang_eaas.expert_server.experts import LayerExperts, load_experts
from sglang_eaas.placement import ExpertRouting

from bench_lib.balance_policies import Outcome, Placed
from bench_lib.balance_traces import StepTrace


@dataclass(frozen=True)
class Call:
    """One server's share of one step's layer: ``hidden [n, H]``, ``rows [n * K]`` local rows
    (-1: not here), ``weights [n, K]`` float32; ``entries`` and ``active`` weight sets."""

    layer: LayerExperts
    hidden: torch.Tensor
    rows: torch.Tensor
    weights: torch.Tensor
    entries: int
    active: int


class Kernels:
    """The checkpoint's experts, and each server's weight sets of a layer (cached)."""

    def __init__(self, model, info, dtype: torch.dtype = torch.bfloat16):
        self.all = load_experts(model, info, list(range(info.num_experts)), dtype)
        self.num_experts = info.num_experts
        self._cache: dict[tuple[int, tuple[int, ...]], LayerExperts] = {}

    def weights(self, layer: int, physical: tuple[int, ...]) -> LayerExperts:
        """Rows ``physical`` (global ids, a double twice) of ``layer``'s experts."""
        key = (layer, physical)
        if key not in self._cache:
            whole = self.all[layer]
            rows = whole.local_index[list(physical)]
            index = torch.full((self.num_experts,), -1, dtype=torch.long)
            for row, e in reversed(list(enumerate(physical))):
                index[e] = row
            self._cache[key] = LayerExperts(whole.w13[rows].contiguous(),
                                            whole.w2[rows].contiguous(), index)
        return self._cache[key]


@dataclass(frozen=True)
class Routing:
    """One layer's placement as the client deals it: ``table`` over holders (one per plane of
    each server), ``owner [P]`` their server, ``row [P, E]`` the local row there (-1)."""

    table: ExpertRouting
    owner: np.ndarray
    row: np.ndarray
    layers: list[LayerExperts]  # per server


def routing(kernels: Kernels, placed: Placed, layer: int) -> Routing:
    planes, owner, rows, per_server = [], [], [], []
    for i, server in enumerate(placed.holdings):
        offset, physical = 0, []
        for plane in placed.physical(server, layer):
            row = np.full(kernels.num_experts, -1, dtype=np.int64)
            row[plane] = offset + np.arange(len(plane))
            planes.append(plane)
            owner.append(i)
            rows.append(row)
            offset += len(plane)
            physical += plane
        per_server.append(kernels.weights(layer, tuple(physical)))
    return Routing(ExpertRouting(planes, kernels.num_experts), np.array(owner), np.stack(rows),
                   per_server)


def calls(route: Routing, ids: torch.Tensor, hidden: torch.Tensor) -> list[Call]:
    """The servers' calls for one step's ``ids [T, K]`` and inputs ``hidden [T, H]``."""
    ids_np = ids.numpy()
    holder = route.table.assign(ids_np)
    server = route.owner[holder]
    local = route.row[holder, ids_np]
    out = []
    for i, layer in enumerate(route.layers):
        mask = server == i
        picked = np.flatnonzero(mask.any(axis=1))
        if not len(picked):
            continue
        rows = np.where(mask, local, -1)[picked]
        weights = torch.full((len(picked), ids.shape[1]), 1.0 / ids.shape[1])
        out.append(Call(layer, hidden[torch.from_numpy(picked)].contiguous(),
                        torch.from_numpy(rows.reshape(-1)), weights, int(mask.sum()),
                        len(np.unique(rows[rows >= 0]))))
    return out


@dataclass
class Measured:
    """``straggler[policy] [windows, W, L]`` seconds; ``samples [n, 3]``: every call's entries,
    active weight sets and seconds (for the fit)."""

    windows: list[int]
    straggler: dict[str, np.ndarray]
    samples: np.ndarray


def time_calls(groups: dict[str, list[Call]], repeat: int) -> dict[str, list[float]]:
    """Seconds per call (the fastest of ``repeat``), each repeat starting at the next policy so
    that none always runs first, on colder caches."""
    timed = {p: [[] for _ in group] for p, group in groups.items()}
    names = list(groups)
    for rep in range(repeat):
        for p in names[rep % len(names):] + names[:rep % len(names)]:
            for c, call in enumerate(groups[p]):
                began = time.perf_counter()
                weighted_expert_sum(call.layer, call.hidden, call.rows, call.weights)
                timed[p][c].append(time.perf_counter() - began)
    return {p: [min(x) for x in per] for p, per in timed.items()}


def sample_windows(count: int, windows: int, shift: int) -> list[int]:
    """``count`` windows spread over 1 .. windows - 1, the one nearest the shift moved to the
    first window after it."""
    spread = np.linspace(1, windows - 1, count).round().astype(int)
    spread[np.argmin(np.abs(spread - shift))] = shift
    return sorted(set(spread.tolist()))


def measure(kernels: Kernels, trace: StepTrace, outcomes: dict[str, Outcome],
            windows: list[int], window: int, repeat: int,
            say: Callable[[str], None]) -> Measured:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = len(trace.layers)
    straggler = {p: np.zeros((len(windows), window, rows)) for p in outcomes}
    samples = []
    try:
        for w, t in enumerate(windows):
            routes = {p: [routing(kernels, o.placed[t], layer) for layer in trace.layers]
                      for p, o in outcomes.items()}
            for j, step in enumerate(range(t * window, (t + 1) * window)):
                for r in range(rows):
                    hidden = trace.inputs[step, r]
                    groups = {p: calls(routes[p][r], trace.ids[step, r], hidden)
                              for p in outcomes}
                    timed = time_calls(groups, repeat)
                    for p, group in groups.items():
                        straggler[p][w, j, r] = max(timed[p], default=0.0)
                        samples += [(c.entries, c.active, m) for c, m in zip(group, timed[p])]
            say(f"  {trace.name}: timed window {t} ({w + 1}/{len(windows)})")
    finally:
        torch.set_num_threads(threads)
    return Measured(windows, straggler, np.array(samples))


def fit(samples: np.ndarray) -> tuple[float, float, float, float]:
    """``c, a, b`` (seconds) of ``time = c + a * entries + b * active`` by non-negative least
    squares over the measured calls, and R^2."""
    from scipy.optimize import nnls

    x = np.column_stack([np.ones(len(samples)), samples[:, 0], samples[:, 1]])
    y = samples[:, 2]
    coef, _ = nnls(x, y)
    residual = y - x @ coef
    r2 = 1.0 - float(residual @ residual) / float(((y - y.mean()) ** 2).sum())
    return float(coef[0]), float(coef[1]), float(coef[2]), r2
