"""What dealing replicated experts by load costs and buys per exchange (issue 25, item 1).

    python scripts/bench_dealing.py [--repeats N] [--exchanges N] [--out FILE]

One exchange is one call of the client's routing (``ExpertRouting.assign``): a batch's ``[T, K]``
expert ids of one MoE layer -> a server per entry. Two ways of dealing a replicated expert's
entries are compared in the same run, on the same placements and ids:

* **round-robin**: the assignment before this change (placement.py at 9767961, copied below as
  ``round_robin``): an expert's entries alternate over its holders from the first, in every
  exchange;
* **by load**: ``sglang_eaas.dealing`` (docs/balancing.md, "Dealing replicated experts"), as the
  client runs it: the C++ op (``sgl_kernel_ext.cpu_ops.deal_entries``), and its NumPy fallback.

Placements are the scaler and placer's (``balance_model``) for a Zipf(1) load, as a rebalance
makes them: the trained checkpoint's size (32 experts, top-4, 4 servers x 10 slots) and a
DeepSeek-V3-sized layer (256 experts, top-8, 16 servers x 20 slots). Ids are Zipf(1) top-k
draws. Reported: microseconds per call (the median of ``--repeats`` timed calls, after a warm-up)
at batch 1-64, and over ``--exchanges`` random exchanges per batch size the busiest server's
entries over the mean (the mean over exchanges, and the lower bound no dealing can beat: the
entries the busiest server must take, ``max(ceil(N / S), any server's single-holder entries)``
over the mean). The op has no SIMD path: the same code runs with and without AVX512-BF16.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from sglang_eaas.balance.placer import balance_model
from sglang_eaas.dealing import deal_entries_numpy
from sglang_eaas.placement import ExpertRouting

from bench_lib.report import Report, default_out, say

BATCHES = (1, 4, 8, 16, 32, 64)
SHAPES = {  # name: (experts, top-k, servers, slots per server)
    "32 experts, top-4, 4 servers x 10 slots": (32, 4, 4, 10),
    "256 experts, top-8, 16 servers x 20 slots": (256, 8, 16, 20),
}


def round_robin(routing: ExpertRouting, expert_ids: np.ndarray) -> np.ndarray:
    """``ExpertRouting.assign`` as it was before dealing by load (placement.py at 9767961)."""
    flat = expert_ids.reshape(-1)
    valid = flat >= 0
    ids = flat[valid]
    server = np.full(flat.shape, -1, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    rank = np.empty_like(ids)
    rank[order] = np.arange(ids.size) - np.searchsorted(sorted_ids, sorted_ids)
    server[valid] = routing.table[ids, rank % routing.replicas[ids]]
    return server.reshape(expert_ids.shape)


def zipf_ids(rng: np.random.Generator, experts: int, top_k: int, tokens: int,
             popularity: np.ndarray) -> np.ndarray:
    return np.stack([rng.choice(experts, top_k, replace=False, p=popularity)
                     for _ in range(tokens)])


def placed(experts: int, top_k: int, servers: int, slots: int, rng) -> ExpertRouting:
    """The scaler and placer's placement of one layer for 4096 tokens of Zipf(1) load."""
    popularity = 1 / np.arange(1, experts + 1)
    popularity = rng.permutation(popularity / popularity.sum())
    load = np.bincount(zipf_ids(rng, experts, top_k, 4096, popularity).ravel(),
                       minlength=experts)
    names = [f"s{i}" for i in range(servers)]
    holdings = balance_model(load[None, :], [0], names, slots)
    routing = ExpertRouting([list(holdings[name].get(0, [])) for name in names], experts)
    return routing, popularity


def per_call_us(call, repeats: int) -> float:
    for _ in range(20):
        call()
    times = []
    for _ in range(repeats):
        began = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - began)
    return statistics.median(times) / 1e3


def busiest_over_mean(servers: np.ndarray, count: int) -> float:
    per_server = np.bincount(servers[servers >= 0], minlength=count)
    return per_server.max() / per_server.mean()


def bound(routing: ExpertRouting, ids: np.ndarray) -> float:
    """The busiest server's entries no dealing avoids, over the mean."""
    flat = ids[ids >= 0]
    single = routing.replicas[flat] == 1
    forced = np.bincount(routing.table[flat[single], 0], minlength=routing.num_servers)
    least = max(-(-flat.size // routing.num_servers), int(forced.max()))
    return least / (flat.size / routing.num_servers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench_dealing.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2000,
                   help="timed calls per (shape, batch, way), median reported (default 2000)")
    p.add_argument("--exchanges", type=int, default=300,
                   help="random exchanges per (shape, batch) for the balance figures "
                   "(default 300)")
    p.add_argument("--out", default=str(default_out("dealing")),
                   help="the report's markdown file (default .cache/bench/dealing.md)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.exchanges < 1:
        p.error("--repeats and --exchanges must be >= 1")
    report = Report(Path(args.out))
    rng = np.random.default_rng(0)
    rows, balance = [], []
    for shape, (experts, top_k, servers, slots) in SHAPES.items():
        routing, popularity = placed(experts, top_k, servers, slots, rng)
        replicated = int((routing.replicas > 1).sum())
        say(f"{shape}: {replicated} experts replicated by the placer")
        for batch in BATCHES:
            ids = zipf_ids(rng, experts, top_k, batch, popularity)
            old = per_call_us(lambda: round_robin(routing, ids), args.repeats)
            new = per_call_us(lambda: routing.assign(ids), args.repeats)
            fallback = per_call_us(lambda: deal_entries_numpy(
                ids, routing.table, routing.replicas, servers), max(50, args.repeats // 20))
            rows.append(f"| {shape} | {batch} | {batch * top_k} | {old:.1f} | {new:.1f} | "
                        f"{new - old:+.1f} | {new / old:.2f}x | {fallback:.1f} |")
            ratios = {"rr": [], "load": [], "bound": []}
            for _ in range(args.exchanges):
                step = zipf_ids(rng, experts, top_k, batch, popularity)
                ratios["rr"].append(busiest_over_mean(round_robin(routing, step), servers))
                ratios["load"].append(busiest_over_mean(routing.assign(step), servers))
                ratios["bound"].append(bound(routing, step))
            rr, load, least = (float(np.mean(ratios[k])) for k in ("rr", "load", "bound"))
            balance.append(f"| {shape} | {batch} | {rr:.3f} | {load:.3f} | {least:.3f} | "
                           f"{(load - 1) / (rr - 1) if rr > 1 else 1:.2f} |")
            say(f"  batch {batch}: {old:.1f} -> {new:.1f} us; busiest/mean {rr:.3f} -> {load:.3f}")
    report.add("Microseconds per exchange (`ExpertRouting.assign`, one MoE layer's ids of one "
               f"batch), the median of {args.repeats} calls; the NumPy fallback (used only where "
               "the C++ library cannot be built) over fewer calls:\n\n"
               "| placement | batch | entries | round-robin us | by load (C++) us | "
               "difference us | ratio | by load (NumPy fallback) us |\n"
               "|---|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows))
    report.add(f"Busiest server's entries over the mean, the mean over {args.exchanges} Zipf(1) "
               "exchanges per batch size; *bound*: what the busiest server must take whatever "
               "the dealing (ceil(entries / servers), or a server's single-holder entries if "
               "more); *excess kept*: (by load - 1) / (round-robin - 1):\n\n"
               "| placement | batch | round-robin | by load | bound | excess kept |\n"
               "|---|---:|---:|---:|---:|---:|\n" + "\n".join(balance))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
