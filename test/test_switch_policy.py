"""The EP/TP cost model and the policy of ``--eaas-layout auto`` on synthetic load traces
(issue 22, docs/switching.md): one switch per real change of regime, none for +-10% noise,
none within the dwell; the fit recovers the constants that made its samples."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_eaas.elastic.layout_cost import LayerCost, Sample, crossover_tokens, fit, zipf_counts
from sglang_eaas.elastic.layout_policy import EP, TP, LayoutChooser, LayoutPolicy, window_of

EXPERTS, TOP_K, LAYERS = 32, 4, 4
PLACEMENT = [list(range(16)), list(range(16, 32))]
# made up, not fitted: TP pays its per-entry cost twice, EP has a straggler when few tokens
# and hot experts put most entries on the first server
COST = LayerCost(client_us=50, message_us=30, entry_us=8.0, width_entry_us=1.0, expert_us=400,
                 parallel=2.0)
SKEW = 0.5  # the first server's experts get 65% of the entries


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def trace(tokens: list[float], skew: float, noise: float, seed: int = 0):
    """One load window per entry of ``tokens`` (mean tokens per step), entries spread with Zipf
    ``skew``, each count times a uniform factor in [1 - noise, 1 + noise]."""
    rng = np.random.default_rng(seed)
    for t in tokens:
        base = zipf_counts(t * TOP_K * 10, EXPERTS, skew)  # 10 steps per window
        counts = np.stack([base * rng.uniform(1 - noise, 1 + noise, EXPERTS)
                           for _ in range(LAYERS)])
        yield window_of(np.rint(counts).astype(np.int64), steps=10)


def run(chooser: LayoutChooser, clock: Clock, windows, period: float = 5.0,
        start: float = 0.0) -> list[tuple]:
    """The decisions over ``windows`` (one every ``period`` seconds from ``start``), each made
    at once."""
    made = []
    for i, window in enumerate(windows):
        clock.now = start + i * period
        decision = chooser.window(window)
        if decision is not None:
            made.append((i, decision.to))
            chooser.switched(decision.to)
    return made


def test_the_model_puts_ep_ahead_with_many_tokens_and_tp_with_few_hot_ones():
    few, many = zipf_counts(2 * TOP_K, EXPERTS, SKEW), zipf_counts(256 * TOP_K, EXPERTS, SKEW)
    assert COST.tp_us(few, 2) < COST.ep_us(few, PLACEMENT)
    assert COST.ep_us(many, PLACEMENT) < COST.tp_us(many, 2)
    crossing = crossover_tokens(COST, TOP_K, EXPERTS, 2, PLACEMENT, skew=SKEW)
    assert 2 < crossing < 256


def test_a_rollout_switches_once_to_tp_when_its_long_tail_begins_and_never_for_noise():
    clock = Clock()
    chooser = LayoutChooser(LayoutPolicy(margin=0.1, patience=2, dwell=30.0), COST, TOP_K, 2,
                            PLACEMENT, EP, clock)
    head, tail = [128.0] * 20, [2.0] * 20  # many sequences, then a few long ones
    made = run(chooser, clock, trace(head + tail, skew=SKEW, noise=0.1))
    assert made == [(21, TP)]  # the second window of the tail (patience 2)
    assert chooser.layout == TP
    # a new head (a new batch of prompts) brings it back, once
    made = run(chooser, clock, trace([128.0] * 10, skew=SKEW, noise=0.1, seed=1),
               start=clock.now + 60)
    assert [to for _, to in made] == [EP]


def _crossing() -> float:
    """Tokens per step where the model predicts EP and TP equal (bisection)."""
    low, high = 1.0, 256.0
    for _ in range(40):
        mid = (low + high) / 2
        counts = zipf_counts(mid * TOP_K, EXPERTS, SKEW)
        low, high = ((mid, high) if COST.tp_us(counts, 2) < COST.ep_us(counts, PLACEMENT)
                     else (low, mid))
    return low


def test_noise_around_the_crossover_never_switches():
    crossing = _crossing()
    assert crossing == pytest.approx(crossover_tokens(COST, TOP_K, EXPERTS, 2, PLACEMENT,
                                                      skew=SKEW), rel=0.25)
    tokens = list(crossing * np.random.default_rng(3).uniform(0.9, 1.1, 200))  # +-10%
    for start in (EP, TP):
        clock = Clock()
        chooser = LayoutChooser(LayoutPolicy(dwell=0.0), COST, TOP_K, 2, PLACEMENT, start, clock)
        assert run(chooser, clock, trace(tokens, skew=SKEW, noise=0.1)) == []
        # the same trace without the hysteresis flips back and forth: it is at the crossover
        eager = LayoutChooser(LayoutPolicy(margin=1e-4, patience=1, dwell=0.0), COST, TOP_K, 2,
                              PLACEMENT, start, clock)
        assert len(run(eager, clock, trace(tokens, skew=SKEW, noise=0.1))) > 10


def test_regimes_that_flip_faster_than_the_dwell_switch_at_most_once_per_dwell():
    clock = Clock()
    chooser = LayoutChooser(LayoutPolicy(margin=0.1, patience=1, dwell=30.0), COST, TOP_K, 2,
                            PLACEMENT, EP, clock)
    tokens = ([2.0] * 2 + [256.0] * 2) * 10  # a regime every 10 s, windows every 5 s
    made = run(chooser, clock, trace(tokens, skew=SKEW, noise=0.0))
    times = [i * 5.0 for i, _ in made]
    assert made and all(b - a >= 30.0 for a, b in zip(times, times[1:]))
    assert [to for _, to in made] == [TP, EP] * (len(made) // 2) + [TP] * (len(made) % 2)


def test_the_fit_recovers_the_constants_that_made_its_samples():
    rng = np.random.default_rng(0)
    samples = []
    for tokens in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for skew in (0.0, 1.0, 2.0):
            counts = zipf_counts(tokens * TOP_K, EXPERTS, skew)
            ep = [(float(counts[e].sum()), float((counts[e] > 0.5).sum())) for e in PLACEMENT]
            tp = [(float(counts.sum()), float((counts > 0.5).sum()))] * 2
            for servers, width in ((ep, 1.0), (tp, 0.5)):
                exact = COST.layer_us(servers, width)
                samples.append(Sample(tuple(servers), width, exact * rng.uniform(0.98, 1.02)))
    fitted = fit(samples, cores=2, fitted_by={"by": "test"})
    for s in samples:
        assert fitted.layer_us(s.servers, s.width) == pytest.approx(s.measured_us, rel=0.05)
    assert fitted.fitted_by["by"] == "test" and fitted.fitted_by["worst_relative_error"] < 0.05
    assert fitted.parallel == pytest.approx(COST.parallel, rel=0.1)


def test_a_cost_file_is_read_back_and_a_bad_one_refused(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(COST.to_json())
    assert LayerCost.load(path) == COST
    path.write_text("{\"client_us\": 1}")
    with pytest.raises(ValueError, match="is not a layer cost model written by"):
        LayerCost.load(path)
    with pytest.raises(ValueError, match="layout policy out of range"):
        LayoutPolicy(margin=0.0)


def test_the_layout_flags_are_checked_in_one_sentence(tmp_path):
    from argparse import Namespace

    from sglang_eaas.config import layout_settings

    def flags(**given):
        values = {"eaas_layout": None, "eaas_layout_margin": None, "eaas_layout_patience": None,
                  "eaas_layout_dwell": None, "eaas_layout_cost": None}
        return Namespace(**{**values, **given})

    assert layout_settings(flags()) is None and layout_settings(flags(eaas_layout="ep")) is None
    assert layout_settings(flags(eaas_layout="tp")).mode == "tp"
    auto = layout_settings(flags(eaas_layout="auto", eaas_layout_dwell=5.0))
    assert auto.policy.dwell == 5.0 and auto.cost.fitted_by["command"].startswith(
        "python scripts/bench_switch.py")  # the packaged fit, and who made it
    with pytest.raises(ValueError, match="only apply with --eaas-layout auto"):
        layout_settings(flags(eaas_layout="tp", eaas_layout_margin=0.2))
    with pytest.raises(ValueError, match="--eaas-layout-margin must be in"):
        layout_settings(flags(eaas_layout="auto", eaas_layout_margin=1.5))
    bad = tmp_path / "cost.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="--eaas-layout-cost: .* is not a layer cost model"):
        layout_settings(flags(eaas_layout="auto", eaas_layout_cost=bad))
