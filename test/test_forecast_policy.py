"""The forecast's bookkeeping against an independent count, and the balancer's policy on
synthetic traces whose mix shifts (no tier started)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_eaas.balance.forecast import (RECENT_DECAY, RoutingBook, StepRequest, load_overlap,
                                          requests_of_step)
from sglang_eaas.balance.placer import balance_model
from sglang_eaas.balance.policy import BalancePolicy, BalanceSettings, within_budget
from sglang_eaas.balance.live import plan
from sglang_eaas.holdings import Holdings

LAYERS, E, K = (1, 3), 16, 3


def step_ids(rng, rows):
    """[rows, K] distinct expert ids per row, with some -1 (no expert) entries."""
    ids = np.stack([rng.permutation(E)[:K] for _ in range(rows)])
    ids[rng.random(ids.shape) < 0.05] = -1
    return ids


def _one_entry_steps(book: RoutingBook):
    """A step function for ``book``: every row of the step's requests one entry on
    ``expert`` in every layer (-1: none)."""

    def step(requests: list[StepRequest], expert: int) -> None:
        rows = sum(r.rows for r in requests)
        ids = np.full((rows, K), -1)
        ids[:, 0] = expert
        for layer in LAYERS:
            book.note(layer, ids)
        book.end_step(requests)

    return step


def test_profiles_and_decode_entries_equal_a_count_row_by_row():
    rng = np.random.default_rng(0)
    book = RoutingBook(LAYERS, E, K)
    expected: dict[str, np.ndarray] = {}  # per request, [L, E] counted one entry at a time
    prompt: dict[str, np.ndarray] = {}  # the same, prefill rows only
    decoded = np.zeros((len(LAYERS), E), dtype=np.int64)
    recent: dict[str, np.ndarray] = {}  # per request, its decode rows, older ones decayed
    steps = [
        # a prefill of a (5 rows) and b (3), in two micro-batches split mid-b
        [StepRequest("a", 5, False, 10), StepRequest("b", 3, False, 4)],
        # a mixed step: a and b decode, c prefills 4 rows, then 2 rows of padding
        [StepRequest("a", 1, True, 9), StepRequest("b", 1, True, 3),
         StepRequest("c", 4, False, 6)],
        [StepRequest("a", 1, True, 8), StepRequest("b", 1, True, 0, finished=True),
         StepRequest("c", 1, True, 5)],
    ]
    for requests in steps:
        rows = sum(r.rows for r in requests)
        this_step = {r.key: np.zeros((len(LAYERS), E)) for r in requests}
        for i, layer in enumerate(LAYERS):
            ids = step_ids(rng, rows + 2)  # 2 padding rows past the requests'
            split = rows // 2 + 1
            book.note(layer, ids[split:], row_offset=split)  # the second micro-batch first
            book.note(layer, ids[:split], row_offset=0)
            row = 0
            for r in requests:
                for t in range(row, row + r.rows):
                    for e in ids[t]:
                        if e >= 0:
                            expected.setdefault(r.key, np.zeros((len(LAYERS), E), np.int64))
                            expected[r.key][i, e] += 1
                            this_step[r.key][i, e] += 1
                            if r.decode:
                                decoded[i, e] += 1
                            else:
                                prompt.setdefault(r.key, np.zeros((len(LAYERS), E), np.int64))
                                prompt[r.key][i, e] += 1
                row += r.rows
        for r in requests:
            if r.decode:
                recent[r.key] = recent.get(r.key, 0.0) * RECENT_DECAY + this_step[r.key]
        book.end_step(requests)
    assert book.profile("b") is None  # finished
    for key in ("a", "c"):
        assert (book.profile(key) == expected[key]).all(), key
    got, decode_steps = book.take_decoded()
    assert (got == decoded).all() and decode_steps == 2
    assert book.take_decoded()[0].sum() == 0  # reset
    # the forecast of the next 6 steps, 6 * 2 * K entries per layer: the starters' spread S is
    # how the requests that started (a, b and c; b has ended) spread their decode rows, each
    # weighed by its decode rows over FULL_ROWS (a 2, b 2, c 1); a (8 tokens left) keeps 6 * K
    # and c (5 left) 5 * K of them, spread as its own decode rows (the older weighing
    # RECENT_DECAY less) in proportion to its rows over FULL_ROWS and as S for the rest; the
    # last K (a request to start) as S
    from sglang_eaas.balance.forecast import FULL_ROWS

    rows = {"a": 2, "b": 2, "c": 1}
    own = {key: (expected[key] - prompt[key]) / (expected[key] - prompt[key]).sum(
        axis=1, keepdims=True) for key in rows}
    starters = sum(rows[key] / FULL_ROWS * own[key] for key in rows) / (
        sum(rows.values()) / FULL_ROWS)

    def kept(key):
        w = rows[key] / FULL_ROWS
        return w * recent[key] / recent[key].sum(axis=1, keepdims=True) + (1 - w) * starters

    assert np.allclose(book.forecast(6), 6 * K * kept("a") + 5 * K * kept("c") + K * starters)
    assert book.unattributed == 0


def test_the_requests_to_come_look_like_those_that_started_in_the_last_window():
    """After the mix shifts, the forecast's requests-to-come are spread as the prompts of the
    requests that started over the last ``steps`` steps, not older ones; where fewer than
    ``RECENT_ARRIVALS`` started then, as the latest ``RECENT_ARRIVALS``."""
    from sglang_eaas.balance.forecast import RECENT_ARRIVALS

    book = RoutingBook(LAYERS, E, K)

    step = _one_entry_steps(book)

    starts = {}  # request -> the step of its first decode
    for i, expert in enumerate([0] * 8 + [1] * RECENT_ARRIVALS):  # the mix shifts to expert 1
        step([StepRequest(f"r{i}", 2, False, 1)], expert)  # a 2-row prompt on `expert`
        step([StepRequest(f"r{i}", 1, True, 0, finished=True)], -1)  # one token, and it ends
        starts[f"r{i}"] = book.steps
    step([StepRequest("running", 1, False, 100)], -1)  # running, no entries yet

    def expected(steps: int) -> np.ndarray:  # all of it requests to come: steps * K entries
        recent = [k for k, s in starts.items() if s > book.steps - steps]
        if len(recent) < RECENT_ARRIVALS:
            recent = list(starts)[-RECENT_ARRIVALS:]
        share = np.zeros((len(LAYERS), E))
        share[:, 1] = sum(int(k[1:]) >= 8 for k in recent) / len(recent)  # the new mix's
        share[:, 0] = 1 - share[:, 1]
        return steps * K * share

    assert np.allclose(book.forecast(8), expected(8))  # the new mix only
    assert expected(8)[0, 0] == 0 and expected(8)[0, 1] == 8 * K
    assert np.allclose(book.forecast(2), expected(2))  # one started: the latest 4, all new
    assert np.allclose(book.forecast(16), expected(16))  # 4 old and 4 new
    assert expected(16)[0, 0] == expected(16)[0, 1] == 8 * K
    # the prompts to come: 2 entries per layer for each prompt started in the window, spread
    # as the requests to come
    for steps in (2, 8, 16):
        started = sum(s > book.steps - steps for s in starts.values())
        assert started == {2: 1, 8: 4, 16: 8}[steps]
        assert np.allclose(book.coming_prefill(steps),
                           2 * started * expected(steps) / (steps * K))
    assert book.coming_prefill(1).sum() == 0  # none started in the last step


def test_the_decode_to_come_is_spread_as_the_decode_of_the_newest_starters():
    """Once the requests that started over the last ``steps`` steps (at least the latest
    ``RECENT_ARRIVALS``, ended ones too) have decoded, the window's ``steps * running * K``
    decode entries are spread as their decode rows spread theirs, not as prompts."""
    from sglang_eaas.balance.forecast import RECENT_ARRIVALS

    book = RoutingBook(LAYERS, E, K)

    step = _one_entry_steps(book)

    starts = {}
    for i, expert in enumerate([0] * 8 + [1] * RECENT_ARRIVALS):  # the decode mix shifts
        step([StepRequest(f"r{i}", 3, False, 2)], 5)  # every prompt on expert 5
        step([StepRequest(f"r{i}", 1, True, 1)], expert)
        starts[i] = book.steps
        step([StepRequest(f"r{i}", 1, True, 0, finished=True)], expert)
    step([StepRequest("running", 1, False, 100)], -1)  # one running, not decoding yet

    def expected(steps: int) -> np.ndarray:
        recent = [i for i, s in starts.items() if s > book.steps - steps]
        if len(recent) < RECENT_ARRIVALS:
            recent = list(starts)[-RECENT_ARRIVALS:]
        out = np.zeros((len(LAYERS), E))
        out[:, 1] = steps * K * sum(i >= 8 for i in recent) / len(recent)
        out[:, 0] = steps * K - out[:, 1]
        return out

    assert np.allclose(book.forecast(3), expected(3))  # the latest 4: the new decode only
    assert expected(3)[0, 1] == 3 * K and expected(3)[0, 5] == 0  # not the prompts' expert
    assert np.allclose(book.forecast(30), expected(30))  # 6 old and 4 new starters
    assert 0 < expected(30)[0, 1] < expected(30)[0, 0]


def test_each_starter_counts_alike_once_it_decoded_full_rows():
    """A starter's decode counts in proportion to its decode rows up to ``FULL_ROWS``, then in
    full, whatever it decoded past that: after a shift, the new mix's starters (a few rows
    each) are not outweighed by the old mix's (many rows each)."""
    from sglang_eaas.balance.forecast import FULL_ROWS, RECENT_ARRIVALS

    book = RoutingBook(LAYERS, E, K)
    step = _one_entry_steps(book)
    old, new = 4 * FULL_ROWS, 2  # decode rows of the old starter and of each new one
    step([StepRequest("old", 3, False, 99)], 5)
    for i in range(old):
        step([StepRequest("old", 1, True, 99 - i)], 0)
    for i in range(RECENT_ARRIVALS - 1):
        step([StepRequest(f"new{i}", 3, False, 99)], 5)
    for i in range(new):
        step([StepRequest(f"new{j}", 1, True, 99 - i) for j in range(RECENT_ARRIVALS - 1)]
             + [StepRequest("old", 1, True, 99 - old - i)], 1)
    # the old one has decoded old + new rows on experts 0 then 1; each new one new rows on 1
    weight_old, weight_new = 1.0, new / FULL_ROWS
    share_old_on_1 = new / (old + new)
    on_1 = (weight_old * share_old_on_1 + (RECENT_ARRIVALS - 1) * weight_new) / (
        weight_old + (RECENT_ARRIVALS - 1) * weight_new)
    got = book.forecast(10)
    # each running request keeps its 10 * K: the old one spread as its own rows, the newest
    # two (on 1) weighing 1 and RECENT_DECAY, the older ones (on 0) RECENT_DECAY^2 and less;
    # each new one weight_new of it on its own expert 1 and the rest as the starters' spread
    old_on_1 = (1 + RECENT_DECAY) / sum(RECENT_DECAY ** j for j in range(old + new))
    on_1_kept = 10 * K * (old_on_1 + (RECENT_ARRIVALS - 1) * (weight_new + (1 - weight_new)
                                                               * on_1))
    total = 10 * RECENT_ARRIVALS * K
    assert np.allclose(got[:, 1], on_1_kept) and np.allclose(got[:, 0], total - on_1_kept)
    pooled = ((RECENT_ARRIVALS - 1) * new + new) / ((RECENT_ARRIVALS - 1) * new + old + new)
    assert on_1 > pooled + 0.2  # rows pooled would keep the old mix's share


def test_a_running_request_keeps_its_own_experts_for_the_tokens_it_has_left():
    """Right after a shift: an old request with 3 tokens left decodes on expert 0, the newest
    starters on expert 1. The next 10 steps of the one running request: its 3 on its own
    expert, the 7 of the request that will replace it on the starters'."""
    from sglang_eaas.balance.forecast import FULL_ROWS, RECENT_ARRIVALS

    book = RoutingBook(LAYERS, E, K)
    step = _one_entry_steps(book)
    step([StepRequest("old", 3, False, 3 + FULL_ROWS)], 5)
    for i in range(FULL_ROWS):
        step([StepRequest("old", 1, True, 3 + FULL_ROWS - 1 - i)], 0)
    for n in range(RECENT_ARRIVALS):  # the new mix's requests: prefill, decode, end
        step([StepRequest(f"new{n}", 3, False, FULL_ROWS)], 5)
        for i in range(FULL_ROWS):
            step([StepRequest(f"new{n}", 1, True, FULL_ROWS - 1 - i, finished=i == FULL_ROWS - 1)],
                 1)
    got = book.forecast(RECENT_ARRIVALS * (FULL_ROWS + 1))  # the new ones only as starters
    assert book.running == 1
    want = np.zeros((len(LAYERS), E))
    steps = RECENT_ARRIVALS * (FULL_ROWS + 1)
    want[:, 0] = 3 * K
    want[:, 1] = (steps - 3) * K
    assert np.allclose(got, want)


def test_rows_that_do_not_tile_the_step_are_left_out_and_counted():
    book = RoutingBook(LAYERS, E, K)
    ids = np.zeros((4, K), dtype=np.int64)
    book.note(LAYERS[0], ids, row_offset=1)  # a gap at row 0
    book.end_step([StepRequest("a", 4, False, 5)])
    assert book.unattributed == 1 and book.profile("a").sum() == 0


def test_requests_of_a_batch_say_which_rows_decode():
    class Req:
        def __init__(self, rid, out, limit, done=False):
            self.rid, self.output_ids, self.done = rid, [0] * out, done
            self.sampling_params = type("S", (), {"max_new_tokens": limit})()

        def finished(self):
            return self.done

    reqs = [Req("x", 0, 8), Req("y", 3, 8), Req("z", 5, 6, done=True)]
    mixed = requests_of_step(reqs, True, [7, 1, 1])
    assert [(r.rows, r.decode, r.remaining, r.finished) for r in mixed] == [
        (7, False, 8, False), (1, True, 5, False), (1, True, 1, True)]
    assert all(r.decode and r.rows == 1 for r in requests_of_step(reqs, False, None))
    with pytest.raises(ValueError, match="3 requests but 2"):
        requests_of_step(reqs, True, [1, 1])


def test_overlap_is_one_for_equal_shapes_and_nan_without_entries():
    a = np.array([[1.0, 3.0], [0.0, 0.0]])
    out = load_overlap(2 * a, a)
    assert out[0] == 1.0 and np.isnan(out[1])
    assert load_overlap(np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]]))[0] == 0.0


# -- the policy on synthetic traces ------------------------------------------------------------
SERVERS = ["s0", "s1", "s2", "s3"]
SLOTS = 5  # 16 experts over 4 servers: 4 each, one spare slot


def mix(hot: int) -> np.ndarray:
    """[L, E] expected shares: a Zipf-like load whose 4 hottest experts start at ``hot``."""
    ranks = (np.arange(E) - hot) % E
    share = 1.0 / (1 + ranks) ** 1.1
    return np.tile(share / share.sum(), (len(LAYERS), 1))


def sample(rng, shares: np.ndarray, entries: int) -> np.ndarray:
    return np.stack([rng.multinomial(entries, row) for row in shares]).astype(np.float64)


def fitted(shares: np.ndarray) -> Holdings:
    return balance_model(shares * 1000, LAYERS, SERVERS, SLOTS)


def run(policy, trace, holdings, rng, entries=4000, horizon=1):
    """Looks once a second over ``trace`` (the mix of each second); the estimate is the sum of
    the last ``horizon`` seconds' samples. Returns the seconds at which it acted."""
    acts, recent = [], []
    for t, shares in enumerate(trace):
        recent = (recent + [sample(rng, shares, entries // horizon)])[-horizon:]
        look, chosen = policy.look(float(t), sum(recent), holdings, SLOTS)
        assert look is policy.looks[-1] and look.act == (chosen is not None)
        if chosen is not None:
            holdings = chosen.target
            policy.acted(float(t))
            acts.append(t)
    return acts, holdings


def test_no_decision_under_noise_or_with_too_few_entries():
    rng = np.random.default_rng(1)
    settings = BalanceSettings("predictive")
    held = fitted(mix(0))
    acts, _ = run(BalancePolicy(settings, LAYERS), [mix(0)] * 200, held, rng)
    assert acts == []
    # an imbalanced placement, but 100 entries a look: below min_entries, never acted on
    contiguous = Holdings.uniform({s: range(4 * i, 4 * i + 4) for i, s in enumerate(SERVERS)},
                                  LAYERS)
    policy = BalancePolicy(settings, LAYERS)
    acts, _ = run(policy, [mix(0)] * 20, contiguous, rng, entries=100)
    assert acts == [] and "too little load" in policy.looks[-1].why


@pytest.mark.parametrize("horizon", [1, 5])  # a forecast's switch; counters' sliding window
def test_one_re_placement_per_shift(horizon):
    rng = np.random.default_rng(2)
    trace = [mix(0)] * 30 + [mix(6)] * 30 + [mix(11)] * 30
    policy = BalancePolicy(BalanceSettings("predictive", cooldown=10), LAYERS)
    acts, held = run(policy, trace, fitted(mix(0)), rng, horizon=horizon)
    assert len(acts) == 2, policy.looks
    assert 30 < acts[0] <= 30 + horizon + 2 and 60 < acts[1] <= 60 + horizon + 2, acts
    # the placement it ends on fits the last mix
    assert max(plan(held, mix(11) * 1000, LAYERS, SLOTS).before) <= 1.15


def test_a_shift_within_the_cooldown_ends_it_and_noise_does_not():
    """A new mix 8 s after a re-placement, with a 30 s cooldown: the policy re-places for it
    once, seconds after the shift (its estimate overlaps the last plan's load by about 0.35,
    below ``shift``), not at the cooldown's end; the noise of one mix (overlap about 0.97) ends
    no cooldown, so there is no third re-placement. With ``shift`` 0 the cooldown holds."""
    contiguous = Holdings.uniform({s: range(4 * i, 4 * i + 4) for i, s in enumerate(SERVERS)},
                                  LAYERS)
    trace = [mix(0)] * 10 + [mix(8)] * 40
    policy = BalancePolicy(BalanceSettings("predictive", cooldown=30), LAYERS)
    acts, held = run(policy, trace, contiguous, np.random.default_rng(4))
    assert len(acts) == 2 and acts[0] < 10 and 10 < acts[1] <= 10 + 4, acts
    assert "the mix shifted" in next(look.why for look in policy.looks if look.act
                                     and look.at == acts[1])
    assert max(plan(held, mix(8) * 1000, LAYERS, SLOTS).before) <= 1.15
    held_on = BalancePolicy(BalanceSettings("predictive", cooldown=30, shift=0), LAYERS)
    acts, _ = run(held_on, trace, contiguous, np.random.default_rng(4))
    assert len(acts) == 2 and acts[1] >= acts[0] + 30, acts


def test_a_plan_over_budget_keeps_the_layers_that_gain_most():
    current = Holdings.uniform({s: range(4 * i, 4 * i + 4) for i, s in enumerate(SERVERS)},
                               LAYERS)
    load = mix(0) * 1000
    load[1] = mix(8)[1] * 1000 * 0.5 + mix(0)[1] * 500  # layer 3 less imbalanced
    made = plan(current, load, LAYERS, SLOTS)
    adds = {layer: sum(len(m.adds) for m in made.moves if m.layer == layer) for layer in LAYERS}
    cut = within_budget(made, adds[1])
    assert {m.layer for m in cut.moves} == {1}  # layer 1 gains most and fits the budget
    assert cut.after[0] == made.after[0] and cut.after[1] == made.before[1]
    assert within_budget(made, 10 ** 6) is made


def test_no_re_placement_when_what_gains_is_over_budget():
    """A plan whose every gaining layer adds more replicas than the budget is not acted on
    (cut to the budget, it would move nothing and gain nothing)."""
    contiguous = Holdings.uniform({s: range(4 * i, 4 * i + 4) for i, s in enumerate(SERVERS)},
                                  LAYERS)
    made = plan(contiguous, mix(0) * 1000, LAYERS, SLOTS)
    adds = [sum(len(m.adds) for m in made.moves if m.layer == layer) for layer in LAYERS]
    assert max(made.before) - max(made.after) > 0.5 and min(adds) > 4, adds
    policy = BalancePolicy(BalanceSettings("predictive", budget=2), LAYERS)
    acts, _ = run(policy, [mix(0)] * 10, contiguous, np.random.default_rng(3))
    assert acts == [] and policy.looks[-1].why.startswith(
        "no plan within the budget of 2 added replicas"), policy.looks[-1]
    policy = BalancePolicy(BalanceSettings("predictive", budget=max(adds) + 4), LAYERS)
    acts, _ = run(policy, [mix(0)] * 10, contiguous, np.random.default_rng(3))
    assert acts  # with room for a layer's replicas it acts


def test_a_complete_step_ends_the_requests_it_does_not_hold():
    import torch

    book = RoutingBook(LAYERS, E, K)
    for layer in LAYERS:
        book.note(layer, torch.zeros((3, K), dtype=torch.int64))  # the device path's tensors
    book.end_step([StepRequest("a", 2, False, 5), StepRequest("b", 1, False, 5)])
    assert book.running == 2 and book.profile("a")[0, 0] == 2 * K
    for layer in LAYERS:
        book.note(layer, np.ones((1, K), dtype=np.int64))
    book.end_step([StepRequest("a", 1, True, 4)])  # a prefill step would not end b...
    assert book.running == 2
    for layer in LAYERS:
        book.note(layer, np.ones((1, K), dtype=np.int64))
    book.end_step([StepRequest("a", 1, True, 3)], complete=True)  # one decode step without b:
    assert book.running == 2  # b may have just prefilled (the overlap scheduler merges late)
    for layer in LAYERS:
        book.note(layer, np.ones((1, K), dtype=np.int64))
    book.end_step([StepRequest("a", 1, True, 2)], complete=True)  # ...two in a row: ended
    assert book.running == 1 and book.profile("b") is None


def test_the_balance_flags_are_checked_in_one_sentence():
    from argparse import ArgumentParser

    from sglang_eaas.config import add_cli_args, balance_settings

    parser = ArgumentParser()
    add_cli_args(parser)

    def settings(*argv):
        return balance_settings(parser.parse_args(list(argv)))

    assert settings() is None and settings("--eaas-balance", "off") is None
    got = settings("--eaas-balance", "predictive", "--eaas-balance-cooldown", "3",
                   "--eaas-balance-slots", "12")
    assert (got.mode, got.cooldown, got.slots, got.trigger, got.shift) == (
        "predictive", 3.0, 12, 1.15, 0.8)
    with pytest.raises(ValueError, match="--eaas-balance-horizon only apply with --eaas-balance "
                       "reactive or predictive"):
        settings("--eaas-balance-horizon", "2")
    with pytest.raises(ValueError, match="--eaas-balance-trigger >= 1"):
        settings("--eaas-balance", "reactive", "--eaas-balance-trigger", "0.9")
    with pytest.raises(ValueError, match="--eaas-balance-shift within 0-1"):
        settings("--eaas-balance", "reactive", "--eaas-balance-shift", "1.5")


def test_knowing_the_running_requests_future_counts_its_next_rows_exactly(tmp_path):
    """The measured bound's estimate (balance/known_futures.py): request "old" made FULL_ROWS
    decode rows and has 3 tokens left; its recorded rows route to experts 10-12 before row
    FULL_ROWS and to 7-9 from it, so its next 3 rows are 3 entries on each of 7, 8 and 9 in
    every layer; the rest of the window (and "other", whose key has no recording) is spread as
    the starters', all on expert 1."""
    from sglang_eaas.balance.forecast import FULL_ROWS, RECENT_ARRIVALS
    from sglang_eaas.balance.known_futures import KnownFutures

    rows = np.array([[10, 11, 12]] * FULL_ROWS + [[7, 8, 9]] * 5)  # [O, K]
    np.savez(tmp_path / "f.npz", k1=np.stack([rows] * len(LAYERS)).astype(np.int16))
    known = KnownFutures.load(tmp_path / "f.npz", len(LAYERS), E)
    book = RoutingBook(LAYERS, E, K)
    step = _one_entry_steps(book)
    for key in ("k1:old", "other"):
        step([StepRequest(key, 3, False, 3 + FULL_ROWS)], 5)
        for i in range(FULL_ROWS):
            step([StepRequest(key, 1, True, 3 + FULL_ROWS - 1 - i)], 0)
    for n in range(RECENT_ARRIVALS):
        step([StepRequest(f"new{n}", 3, False, FULL_ROWS)], 5)
        for i in range(FULL_ROWS):
            step([StepRequest(f"new{n}", 1, True, FULL_ROWS - 1 - i,
                              finished=i == FULL_ROWS - 1)], 1)
    steps = 10
    got = book.forecast_knowing(steps, known.entries)
    want = np.zeros((len(LAYERS), E))
    want[:, [7, 8, 9]] = 3
    want[:, 1] = steps * 2 * K - 9
    assert book.running == 2 and np.allclose(got, want)
    with pytest.raises(ValueError, match="not \\[2 MoE layers"):
        np.savez(tmp_path / "bad.npz", k=np.zeros((3, 4, K), dtype=np.int16))
        KnownFutures.load(tmp_path / "bad.npz", len(LAYERS), E)
