"""bench_live_balance's one mix on a fresh tier: the measured half of the mix's prompts before,
the planning half (the state file written right before it, so the pass plans on it alone), one
rebalance pass, the measured half again after, and what each measured (``MixResult``).

After the workload under the new placement, the load it measured (entries per (MoE layer,
expert), summed over the servers) is evaluated three ways:

* ``even``: the live placement with each expert's entries split evenly over its holders
  (``balance.evaluate.layer_load``, fractional: the placer's model);
* ``best``: the live placement with the entries split as evenly over the servers as its holders
  allow (a linear program over the whole run's counts): no per-step dealing can do better over
  the run, so the measured ratio is at least this;
* ``bound``: the placer's own placement made from scratch for that load
  (``balance.placer.balance_model``, the slots the rebalance planned with), split evenly: what a
  placement with those slots reaches on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from sglang_eaas.balance.evaluate import layer_load
from sglang_eaas.balance.live import tier_holdings
from sglang_eaas.balance.placer import balance_model
from sglang_eaas.balance.server_load import read_counters, write_state
from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import current_snapshot
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.tools.rebalance import default_slots

from bench_lib import live_balance_measure as M
from bench_lib.live_balance_tier import Rebalanced, rebalance, workload

SETTLE = 3.0  # seconds the client's table epoch must stay put after the rebalance
TABLE_TIMEOUT = 120.0


@dataclass
class Phase:
    """One workload: per MoE layer the busiest server over the mean over the whole run, over
    short intervals and per exchange; entries per (server, layer, expert); the tokens."""

    window: np.ndarray  # [L]
    intervals: np.ndarray  # [L]
    exchange: np.ndarray  # [L]
    entries: np.ndarray  # [S, L, E]
    outputs: list[list[int]]
    seconds: float
    polls: int


@dataclass
class MixResult:
    mix: str
    before: Phase  # the measured half, on the placement before the pass
    after: Phase  # the measured half again, after it
    planned_on: Phase  # the planning half, before the pass: what the pass saw
    rebalanced: Rebalanced
    slots: int
    even: np.ndarray  # [L] the live placement, the after-load split evenly over holders
    best: np.ndarray  # [L] the live placement, the after-load split as evenly as it allows
    bound: np.ndarray  # [L] the placer's placement for the after-load, split evenly
    replicas: int  # experts held more than once after the pass (all layers)
    stale: int  # after-run entries a server computed for an expert it no longer held
    table_wait: float

    @property
    def differing(self) -> int:
        """Requests whose tokens after the pass differ from before it."""
        return sum(a != b for a, b in zip(self.before.outputs, self.after.outputs))


def run_mix(deployment, mix: str, halves: tuple[list[str], list[str]], args,
            info: MoeModelInfo, state: Path, log_dir: Path, say: Callable[[str], None],
            slots: int) -> MixResult:
    """``halves``: (the prompts to plan on, the prompts to measure on); ``slots``: the
    rebalance's ``--slots`` (what each server holds before it: the same memory after)."""
    plan_prompts, prompts = halves
    url = next(e.address for e in deployment.endpoints() if e.name.startswith("plain"))
    addresses = [c.address for c in deployment.expert_servers]
    token, monitor = deployment.token, deployment.monitor_url
    layers, E = list(info.moe_layers), info.num_experts

    def phase(label: str, prompts: list[str]) -> Phase:
        say(f"  {mix}: {label}: {len(prompts)} requests, {args.concurrency} at a time, "
            f"{args.max_new_tokens} tokens each")
        read = lambda: M.read_counters(addresses, token, layers, E)  # noqa: E731
        hist0 = M.exchange_means(M.metrics_text(url), layers)
        began, poller = time.monotonic(), M.Poller(read, args.poll).start()
        try:
            outputs = workload(url, prompts, args.max_new_tokens, args.concurrency, say)
        except BaseException:
            poller.cancel()
            raise
        readings, seconds = poller.stop(), time.monotonic() - began
        hist1 = M.exchange_means(M.metrics_text(url), layers)
        entries = readings[-1] - readings[0]
        done = Phase(M.busiest_over_mean(entries.sum(axis=2)),
                     M.interval_ratio(readings, args.concurrency * info.top_k),
                     M.exchange_ratio(hist0, hist1), entries, outputs, seconds,
                     len(readings) - 1)
        say(f"  {mix}: {label}: {seconds:.0f} s; busiest server / mean per MoE layer: "
            + ", ".join(f"{r:.2f}" for r in done.window))
        return done

    before = phase("measured half, before the rebalance", prompts)
    counters, silent = read_counters(addresses, token)
    if silent:
        raise RuntimeError(f"servers did not give their counters: {silent}")
    write_state(state, monitor, counters)  # the pass plans on what comes after this
    planned_on = phase("planning half, before the rebalance", plan_prompts)
    current = tier_holdings(current_snapshot(monitor, token))[0]
    epoch = M.table_epoch(M.metrics_text(url))
    say(f"  {mix}: one rebalance pass, planned on the planning half")
    rebalanced = rebalance(monitor, token, state, log_dir / "rebalance.log", say, slots)
    waited = 0.0
    if sum(rebalanced.adds.values()):
        waited = M.wait_for_table(url, epoch, SETTLE, TABLE_TIMEOUT)
        say(f"  {mix}: SGLang's client uses the new table ({waited:.1f} s)")
    live = tier_holdings(current_snapshot(monitor, token))[0].only(addresses)
    if set(live) != set(addresses):
        raise RuntimeError(f"the monitor's servers {sorted(live)} are not the deployment's "
                           f"{addresses}")
    after = phase("measured half, after the rebalance", prompts)
    slots = rebalanced.slots or default_slots(current, E)
    load = after.entries.sum(axis=0).astype(np.float64)  # [L, E]
    oracle = balance_model(load, layers, addresses, slots)
    return MixResult(
        mix, before, after, planned_on, rebalanced, slots,
        np.array([layer_load(live.layer(layer), load[i]).max_over_mean
                  for i, layer in enumerate(layers)]),
        np.array([best_split(live.layer(layer), load[i]) for i, layer in enumerate(layers)]),
        np.array([layer_load(oracle.layer(layer), load[i]).max_over_mean
                  for i, layer in enumerate(layers)]),
        replicas(live, layers), stale(after.entries, live, addresses, layers), waited)


def best_split(placement: dict[str, tuple[int, ...]], load: np.ndarray) -> float:
    """The least busiest-server-over-mean any split of ``load`` ([E] entries) over each
    expert's holders in ``placement`` gives: minimise T with every server's entries <= T."""
    from scipy.optimize import linprog

    servers = list(placement)
    pairs = [(s, e) for s, server in enumerate(servers) for e in placement[server] if load[e]]
    if not pairs:
        return float("nan")
    experts = sorted({e for _, e in pairs})
    equal = np.zeros((len(experts), len(pairs) + 1))
    upper = np.zeros((len(servers), len(pairs) + 1))
    for k, (s, e) in enumerate(pairs):
        equal[experts.index(e), k] = 1.0
        upper[s, k] = 1.0
    upper[:, -1] = -1.0
    cost = np.zeros(len(pairs) + 1)
    cost[-1] = 1.0
    found = linprog(cost, A_ub=upper, b_ub=np.zeros(len(servers)), A_eq=equal,
                    b_eq=load[experts], bounds=(0, None), method="highs")
    if not found.success:
        raise RuntimeError(f"the best split's linear program failed: {found.message}")
    return float(found.x[-1] / (load.sum() / len(servers)))


def replicas(holdings: Holdings, layers: list[int]) -> int:
    """Replicas beyond one holder per expert, over ``layers``."""
    return sum(len(held) - 1 for layer in layers
               for held in holdings.holders(layer).values() if held)


def stale(entries: np.ndarray, live: Holdings, addresses: list[str], layers: list[int]) -> int:
    """Entries in ``entries`` ([S, L, E]) of experts the server did not hold in ``live``."""
    found = 0
    for i, layer in enumerate(layers):
        placed = live.layer(layer)
        for s, address in enumerate(addresses):
            held = np.zeros(entries.shape[2], dtype=bool)
            held[list(placed.get(address, ()))] = True
            found += int(entries[s, i, ~held].sum())
    return found
