"""bench_balance_replay's simulated serving on hand-made routing (no model, no tier): the
servers' entries as the client deals them, the prefix cache, and the real balancer policies
following a shift that moves every entry from one expert to another."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from bench_balance_replay import Replay  # noqa: E402
from bench_lib.request_routing import RequestRouting  # noqa: E402

from sglang_eaas.holdings import Holdings  # noqa: E402

LAYER = 1


def args(**over) -> Namespace:
    base = dict(phases=2, phase_seconds=20.0, concurrency=2, output_len=6, cache_tokens=0,
                decode_step=0.05, prefill_token=0.01, move_replica=0.1, after_shift=10.0)
    return Namespace(**{**base, **over})


def routed_to(expert: int, prompt_len: int = 4, output_len: int = 6) -> RequestRouting:
    """Every token of the request routed to ``expert`` (top-1, one MoE layer)."""
    return RequestRouting(np.full((1, prompt_len, 1), expert, np.int16),
                          np.full((1, output_len, 1), expert, np.int16))


# two servers of three slots each; expert 0 on both, expert 3 on s1 only
HELD = Holdings({"s0": {LAYER: [0, 1, 2]}, "s1": {LAYER: [0, 2, 3]}})


def replay(policy: str, **over) -> Replay:
    routing = {"a": routed_to(0), "b": routed_to(3)}
    lists = {"stdlib-held-out": ["a"], "other-code": ["b"], "prose": ["a"]}
    settings = {"min_entries": 8, "cooldown": 0.0, "settle": 1}
    return Replay(args(**over), routing, lists, HELD, [LAYER], 4, 1, policy, settings, seed=0)


def test_entries_are_dealt_over_the_holders_and_the_interval_measured():
    r = replay("off")
    entries = np.zeros((1, 4))
    entries[0, 0], entries[0, 3] = 10, 4  # expert 0 dealt 7/7 around expert 3's 4 on s1
    served = r.served(HELD, entries)
    assert served.sum() == 14 and sorted(served[0].tolist()) == [7.0, 7.0]
    assert np.isclose(r.measure(np.array([[30.0, 10.0]])), 1.5)
    assert np.isnan(r.measure(np.array([[1.0, 0.0]])))  # fewer than concurrency x top-k


def test_a_prompt_still_cached_prefills_its_last_token_only():
    r = replay("off", cache_tokens=30)
    running = []
    assert not r.cached("a", running)
    r.cache["a"] = 10
    assert r.cached("a", running)
    big = Namespace(routing=routed_to(0, prompt_len=20), prompt="x")
    assert not r.cached("a", [big])  # 20 + 6 running tokens leave 4: "a" is evicted


def test_off_stays_on_one_server_after_the_shift_and_the_balancers_follow_it():
    """Phase one routes everything to expert 0 (held twice: balanced), phase two to expert 3
    (one holder: the busiest server has all of it, 2x the mean). ``off`` stays at 2x after
    the shift; the reactive and hindsight balancers re-place it onto both servers, hindsight
    no later than reactive, and all end balanced."""
    off = replay("off").run()
    before = [ratio for at, ratio in off.intervals if at < 20]
    after = [ratio for at, ratio in off.intervals if at >= 21]
    assert np.allclose(before, 1.0) and np.allclose(after, 2.0)
    assert off.replacements == 0 and off.requests > 0
    outcomes = {p: replay(p).run() for p in ("reactive", "hindsight")}
    for name, out in outcomes.items():
        assert out.replacements >= 1, name
        assert np.allclose([ratio for at, ratio in out.intervals if at >= 35], 1.0), name
        assert out.after < off.after, name
    assert outcomes["hindsight"].after <= outcomes["reactive"].after
