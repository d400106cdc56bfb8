"""bench_live_balance's arithmetic (no tier started): the busiest server over the mean per layer,
the mean over poll intervals, the per-exchange mean from /metrics text, the least any split of
a placement gives, and both forms of the rebalance's per-layer line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench_lib import live_balance_measure as M  # noqa: E402
from bench_lib.live_balance_run import best_split  # noqa: E402
from bench_lib.live_balance_tier import parse  # noqa: E402


def test_busiest_over_mean_counts_every_server_and_says_nan_for_no_entries():
    per_server = np.array([[6, 0, 2], [2, 0, 2], [0, 0, 2], [0, 0, 2]])  # [servers, layers]
    ratio = M.busiest_over_mean(per_server)
    assert ratio[0] == 3.0 and np.isnan(ratio[1]) and ratio[2] == 1.0


def test_interval_ratio_is_the_mean_of_the_intervals_with_enough_entries():
    zero = np.zeros((2, 1, 2), dtype=np.int64)  # [servers, layers, experts]
    a = zero + np.array([[[4, 0]], [[0, 4]]])  # 4 and 4: 1.0
    b = a + np.array([[[6, 0]], [[0, 2]]])  # 6 and 2: 1.5
    c = b + np.array([[[1, 0]], [[0, 0]]])  # 1 entry: below min_entries, left out
    assert M.interval_ratio([zero, a, b, c], min_entries=4)[0] == pytest.approx(1.25)


def test_exchange_means_read_the_histogram_per_layer():
    text = (
        "# HELP sglang_eaas_exchange_imbalance x\n# TYPE sglang_eaas_exchange_imbalance "
        "histogram\n"
        'sglang_eaas_exchange_imbalance_bucket{layer="1",le="+Inf",rank="0"} 4.0\n'
        'sglang_eaas_exchange_imbalance_count{layer="1",rank="0"} 4.0\n'
        'sglang_eaas_exchange_imbalance_sum{layer="1",rank="0"} 6.0\n'
        'sglang_eaas_exchange_imbalance_count{layer="2",rank="0"} 1.0\n'
        'sglang_eaas_exchange_imbalance_sum{layer="2",rank="0"} 1.0\n')
    before = np.array([[2.0, 1.0], [2.0, 1.0]])  # sums, counts per layer (1, 2)
    ratio = M.exchange_ratio(before, M.exchange_means(text, [1, 2]))
    assert ratio[0] == 2.0 and np.isnan(ratio[1])  # (6 - 2) / (4 - 2); no new exchange


def test_best_split_uses_the_replicas_to_even_the_servers():
    load = np.array([10.0, 10.0, 0.0])
    # expert 1 on both servers: all of it to b evens them
    assert best_split({"a": (0, 1), "b": (1,)}, load) == pytest.approx(1.0)
    # nothing to move: 15 and 5
    assert best_split({"a": (0, 2), "b": (1,)}, np.array([15.0, 5.0, 0.0])) == pytest.approx(1.5)
    # a holds both, b holds only expert 1: b can take at most 10 of 30
    assert best_split({"a": (0, 1), "b": (1,)}, np.array([20.0, 10.0, 0.0])) == pytest.approx(
        20 / 15)


def test_rebalance_lines_in_both_forms():
    new = parse("rebalance: 4 expert servers, 10 slots per MoE layer each, 99 entries\n"
                "  MoE layer 3: busiest server measured 1.68x the mean, modelled 1.60x -> plan "
                "1.04x (7 replicas to add)\n")
    assert (new.slots, new.measured, new.modelled, new.planned, new.adds) == (
        10, {3: 1.68}, {3: 1.60}, {3: 1.04}, {3: 7})
    old = parse("  MoE layer 0: busiest server 1.50x the mean -> 1.05x (3 replicas to add)\n")
    assert (old.slots, old.measured, old.modelled, old.planned, old.adds) == (
        None, {}, {0: 1.50}, {0: 1.05}, {0: 3})


def test_the_placement_before_holds_the_slots_the_pass_plans_with():
    from bench_live_balance import contiguous

    from sglang_eaas.placement import parse_expert_list

    lists, slots = contiguous(32, 4, 2)
    held = [parse_expert_list(spec, 32) for spec in lists]
    assert slots == 10 and all(len(h) == 10 for h in held)
    assert held[3] == [0, 1, *range(24, 32)]  # wraps around to the first server's share
    assert sorted(set(sum(held, []))) == list(range(32))  # every expert held
    assert contiguous(32, 4, 0) == (["0-7", "8-15", "16-23", "24-31"], 8)


def test_the_pass_is_measured_on_prompts_it_did_not_plan_on():
    from bench_lib.live_balance_prompts import MIXES, halves

    for mix in MIXES:
        plan, measured = halves(mix, 12)
        assert len(plan) == len(measured) == 12
        assert not set(plan) & set(measured), mix


def test_the_runs_table_gives_each_mix_the_median_and_range_of_its_runs():
    from types import SimpleNamespace

    from bench_lib.live_balance_report import goal, runs_table

    def result(mix, before, after, differing=0):
        def phase(ratios):
            same = np.array(ratios)
            return SimpleNamespace(window=same, intervals=same, exchange=same)

        return SimpleNamespace(mix=mix, before=phase(before), after=phase(after),
                               differing=differing, best=np.ones(2), bound=np.ones(2))

    runs = [[result("prose", [1.2, 1.4], [1.0, 1.1])],
            [result("prose", [1.1, 1.3], [1.0, 1.3])],
            [result("prose", [1.5, 1.5], [1.05, 1.05], differing=1)]]
    row = runs_table(runs).splitlines()[-1].split(" | ")
    # before: means 1.3, 1.2, 1.5; after: 1.05, 1.15, 1.05; after's worst layer: 1.1, 1.3, 1.05
    assert row[1:4] == ["1.30 [1.20-1.50]", "1.05 [1.05-1.15]", "1.10 [1.05-1.30]"]
    assert row[-1] == "NO |"
    verdict = goal([r for results in runs for r in results], 1.1, 3)
    assert "in every one of 3 runs" in verdict and "prose 1.15x" in verdict  # the worst run's
    assert "NOT met** (worst: prose MoE layer 1 at 1.30x" in verdict
