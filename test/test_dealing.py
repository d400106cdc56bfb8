"""Replicated experts' entries dealt by load (``dealing``): the C++ op the client runs
(``ExpertRouting.assign``), the NumPy fallback and the per-server counts an offline evaluation
computes from counts (``layer_load(whole_tokens=True)``) all equal an independent reference
written from the rule in docs/balancing.md; and what the rule is for: the servers' counts of
one exchange as even as the holdings allow, with no holder favoured. (The device path's torch
ops and Triton kernel: test_device_step.py.)"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from sglang_eaas.balance.evaluate import layer_load
from sglang_eaas.dealing import deal_entries_numpy
from sglang_eaas.placement import NO_HOLDER, ExpertRouting


def reference(ids: np.ndarray, server_experts: list[list[int]]) -> np.ndarray:
    """The rule, entry by entry on plain lists: single holders first; then rounds over the
    replicated experts that have entries, most entries first (ids ascending among equals), each
    handing its next entry to the holder with the fewest so far (ties: the first from (sum of
    valid ids + expert) mod replicas on, cyclically); an expert's entries in (token, k) order
    go where its dealt entries went, in the order they were dealt."""
    flat = [int(x) for x in ids.reshape(-1)]
    holders = defaultdict(list)
    for server, experts in enumerate(server_experts):
        for e in experts:
            holders[e].append(server)
    load = [0] * len(server_experts)
    for e in flat:
        if e >= 0 and len(holders[e]) == 1:
            load[holders[e][0]] += 1
    offset = sum(e for e in flat if e >= 0)
    left = {e: flat.count(e) for e in set(flat) if e >= 0 and len(holders[e]) > 1}
    queue = defaultdict(list)
    while any(left.values()):
        for e in sorted(left, key=lambda e: (-flat.count(e), e)):
            if left[e]:
                h = holders[e]
                start = (offset + e) % len(h)
                j = min(range(len(h)), key=lambda j: (load[h[j]], (j - start) % len(h)))
                queue[e].append(h[j])
                load[h[j]] += 1
                left[e] -= 1
    out = []
    for e in flat:
        if e < 0:
            out.append(-1)
        elif not holders[e]:
            out.append(NO_HOLDER)
        elif len(holders[e]) == 1:
            out.append(holders[e][0])
        else:
            out.append(queue[e].pop(0))
    return np.array(out, dtype=np.int64).reshape(ids.shape)


def _random_case(rng: np.random.Generator):
    experts, servers = int(rng.integers(4, 40)), int(rng.integers(2, 7))
    placement = [sorted(rng.choice(experts, size=int(rng.integers(1, experts)), replace=False)
                        .tolist()) for _ in range(servers)]
    placement[0] = sorted(set(placement[0]) | set(range(experts)) - {
        e for held in placement[1:] for e in held})  # every expert somewhere
    tokens, top_k = int(rng.integers(1, 65)), int(rng.integers(1, min(experts, 8) + 1))
    ids = np.stack([rng.choice(experts, size=top_k, replace=False) for _ in range(tokens)])
    ids[rng.random(ids.shape) < 0.1] = -1
    return placement, experts, ids


@pytest.mark.parametrize("seed", range(40))
def test_every_implementation_equals_the_reference(seed):
    placement, experts, ids = _random_case(np.random.default_rng(seed))
    routing = ExpertRouting(placement, experts)
    want = reference(ids, placement)
    assert np.array_equal(routing.assign(ids), want)  # the C++ op
    assert np.array_equal(routing.assign(ids.astype(np.int32)), want)
    assert np.array_equal(deal_entries_numpy(ids, routing.table, routing.replicas,
                                             len(placement)), want)
    counts = np.bincount(ids[ids >= 0], minlength=experts)
    dealt = layer_load({f"s{i}": held for i, held in enumerate(placement)}, counts,
                       whole_tokens=True)
    assert dealt.tokens.tolist() == np.bincount(want[want >= 0], minlength=len(placement)).tolist()
    active = [len({e for e, s in zip(ids.ravel(), want.ravel()) if s == i})
              for i in range(len(placement))]
    assert dealt.active.tolist() == active


def test_an_expert_no_server_holds_gets_no_holder_and_counts_nowhere():
    routing = ExpertRouting([[0, 1], [1]], 3, allow_missing=True)
    ids = np.array([[2, 1], [1, 0], [2, -1]])
    assert routing.assign(ids).tolist() == reference(ids, [[0, 1], [1]]).tolist()
    assert (routing.assign(ids)[ids == 2] == NO_HOLDER).all()
    with pytest.raises(ValueError, match="expert id 3 .* not below 3"):
        routing.assign(np.array([[3, 0]]))


def test_a_replicated_experts_entries_go_where_the_load_is_least():
    """Expert 0 (server 0 only) has 7 entries, expert 1 (on all three) 8: expert 1's go to
    servers 1 and 2, leaving 7 / 5 / 5, where round-robin from the first holder gave 10 / 3 /
    3 (the issue's case, at any batch size)."""
    routing = ExpertRouting([[0, 1], [1, 2], [1, 3]], 4)
    ids = np.array([[1, 0]] * 7 + [[2, 3], [-1, 1]])
    servers = routing.assign(ids)
    assert (servers[:7, 1] == 0).all() and servers[8, 0] == -1
    assert np.bincount(servers[servers >= 0], minlength=3).tolist() == [7, 5, 5]
    assert np.array_equal(routing.assign(ids), servers)  # the same ids, the same answer


def test_a_lone_entry_is_not_always_the_first_holders():
    """A decode step's single entry of a hot replicated expert, with both holders equally
    loaded: over many steps (different other experts) it lands on each holder about half the
    time; round-robin from the first holder sent every one to server 0."""
    routing = ExpertRouting([[0, 1, 2, 3], [0, 4, 5, 6, 7]], 8)  # expert 0 on both
    rng = np.random.default_rng(0)
    landed = Counter()
    for _ in range(400):
        a, b = rng.choice(np.arange(1, 4)), rng.choice(np.arange(4, 8))
        step = np.array([[0, a, b]])  # one each: expert 0 decides the balance
        landed[int(routing.assign(step)[0, 0])] += 1
    assert 150 < landed[0] < 250 and landed[0] + landed[1] == 400


def _round_robin(ids: np.ndarray, routing: ExpertRouting) -> np.ndarray:
    """The rule before dealing by load: an expert's entries alternate over its holders from
    the first, in (token, k) order, in every exchange."""
    flat, seen, out = ids.reshape(-1), Counter(), []
    for e in flat.tolist():
        out.append(int(routing.table[e, seen[e] % routing.replicas[e]]))
        seen[e] += 1
    return np.array(out)


@pytest.mark.parametrize("case", ["ring", "hot experts replicated"])
def test_an_exchange_is_never_less_even_than_round_robin_and_far_more_on_average(case):
    """Zipf-skewed top-4 exchanges of 1-64 tokens over four servers: every expert on two
    neighbours of a ring, or contiguous experts with the hottest eight replicated once (what a
    rebalance makes). The busiest server never has more entries than under round-robin, and
    its excess over the mean is at most half round-robin's on average."""
    if case == "ring":
        experts, placement = 16, [[e for e in range(16) if s in (e % 4, (e + 1) % 4)]
                                  for s in range(4)]
    else:
        experts = 32
        placement = [list(range(8 * s, 8 * s + 8)) + extra
                     for s, extra in enumerate([[24, 25], [0, 1], [2, 8], [9, 16]])]
    routing = ExpertRouting(placement, experts)
    rng = np.random.default_rng(1)
    popularity = 1 / np.arange(1, experts + 1)
    excess = {"dealt": [], "round-robin": []}
    for _ in range(300):
        ids = np.stack([rng.choice(experts, 4, replace=False, p=popularity / popularity.sum())
                        for _ in range(int(rng.integers(1, 65)))])
        dealt = np.bincount(routing.assign(ids).ravel(), minlength=4)
        old = np.bincount(_round_robin(ids, routing), minlength=4)
        assert dealt.max() <= old.max(), (ids, dealt, old)
        excess["dealt"].append(dealt.max() / dealt.mean() - 1)
        excess["round-robin"].append(old.max() / old.mean() - 1)
    assert np.mean(excess["dealt"]) <= np.mean(excess["round-robin"]) / 2, excess
