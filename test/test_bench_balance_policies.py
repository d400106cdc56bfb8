"""bench_balance's EPLB at SGLang's cadence: the placement it holds in each window is SGLang's
EPLB of the right steps (the first half before its first rebalance, then the steps since the
last rebalance), and it changes only at the window after a rebalance step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench_lib.balance_policies import eplb_every, place_trace  # noqa: E402

LAYERS, SERVERS, SLOTS, EXPERTS = [0, 1], ["a", "b", "c"], 4, 8


def _steps(seed: int, steps: int) -> np.ndarray:
    """``[S, L, E]`` step loads whose hot expert moves from 0 to 5 half-way, with noise."""
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 4, size=(steps, len(LAYERS), EXPERTS))
    loads[:steps // 2, :, 0] += 20
    loads[steps // 2:, :, 5] += 20
    return loads


def _copies(placed, expert: int) -> int:
    """Physical copies of ``expert`` in layer 0 over all servers."""
    return sum((placed.copies or {}).get(s, {}).get(0, {}).get(expert, 1)
               for s in SERVERS if expert in placed.holdings[s][0])


def test_eplb_every_rebalances_on_the_last_period_from_the_next_window():
    loads = _steps(0, 96)  # shift at 48; period 40; windows of 8
    placed = eplb_every(loads, shift=48, period=40, window=8, layers=LAYERS, servers=SERVERS,
                        slots=SLOTS)
    assert len(placed) == 12
    # before step 40: the first half's plan, where expert 0 is hot and gets the spare slots
    assert all(p is placed[0] for p in placed[:5])
    assert _copies(placed[0], 0) > 1 and _copies(placed[0], 5) == 1
    # the rebalance at step 40 (steps 0..40: still the first mix) holds from window 5 (step 40)
    assert placed[5] is not placed[4] and all(p is placed[5] for p in placed[5:10])
    assert _copies(placed[5], 0) > 1
    # the one at step 80 plans on steps 40..80, mostly the second mix: expert 5 is now hot
    assert placed[10] is not placed[9] and placed[11] is placed[10]
    assert _copies(placed[10], 5) > 1
    # every plan fills every slot of every server and holds every expert
    for p in (placed[0], placed[5], placed[10]):
        for layer in LAYERS:
            held = set()
            for s in SERVERS:
                per = (p.copies or {}).get(s, {}).get(layer, {})
                assert sum(per.get(e, 1) for e in p.holdings[s][layer]) == SLOTS
                held |= set(p.holdings[s][layer])
            assert held == set(range(EXPERTS))


def test_eplb_every_a_rebalance_mid_window_takes_effect_at_the_next_window():
    loads = _steps(1, 64)
    placed = eplb_every(loads, shift=32, period=20, window=8, layers=LAYERS, servers=SERVERS,
                        slots=SLOTS)
    # rebalances at steps 20, 40 and 60 hold from the windows starting at 24 (window 3), 40
    # (window 5) and 64 (past the trace's last window, which starts at 56)
    changes = [t for t in range(1, len(placed)) if placed[t] is not placed[t - 1]]
    assert changes == [3, 5]


def test_place_trace_runs_every_policy_but_predicted_on_a_trace_without_predictor_load():
    from bench_lib.balance_traces import zipf

    trace = zipf(1.2, LAYERS, EXPERTS, top_k=2, steps=64, batch=8, hidden=16, seed=3)
    out = place_trace(trace, SERVERS, SLOTS, window=8, eplb_period=1000, cv_target=0.2)
    assert list(out) == ["none", "eplb-sglang", "eplb", "moeless", "oracle"]
    for policy, o in out.items():
        assert len(o.placed) == 8 and o.ratio.shape == (8, len(LAYERS)), policy
        # every step's entries are all dealt: the servers' shares add up to batch x top-k
        assert (o.tokens.sum(axis=2) == 8 * 2).all(), policy
    # the oracle plans on each window's own load: never less balanced than none, on average
    assert out["oracle"].ratio[1:].mean() < out["none"].ratio[1:].mean()


def test_below_is_one_minus_the_time_over_the_base_time_measured_and_modelled():
    from bench_lib.balance_policies import Outcome
    from bench_lib.balance_report import below

    def fake(tokens):  # [steps=4, layers=1, servers=2]; no weight-set cost below (b = 0)
        tokens = np.array(tokens, dtype=float).reshape(4, 1, 2)
        return Outcome("x", [], np.ones((2, 1)), tokens, np.zeros_like(tokens), np.zeros(2))

    outcomes = {"base": fake([[9, 1], [9, 1], [6, 4], [6, 4]]),
                "ours": fake([[9, 1], [9, 1], [5, 5], [5, 5]])}
    straggler = {"base": np.array([4.0, 4.0]), "ours": np.array([3.0, 3.0])}
    measured, modelled = below(outcomes, straggler, (1.0, 1.0, 0.0), 2, "ours", "base")
    assert measured == 0.25
    # windows of 2 steps, the first left out: steps 2 and 3, 1 + max(entries) = 7 against 6
    assert abs(modelled - (1 - 6 / 7)) < 1e-12
