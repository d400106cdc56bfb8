"""Benchmark: live expert load balance before and after one rebalance pass (issue 25), measured
by the expert servers' own counters, on the trained checkpoint under SGLang ``--eaas``.

For each prompt mix (``bench_lib/live_balance_prompts.py``: held-out stdlib files, and mixes
outside the training corpus) a fresh tier (``sglang_eaas.deploy.Deployment``): a standalone
monitor, expert servers holding contiguous experts plus the first ``--extra-replicas`` of the
next server's (0-9, 8-17, ... with 4 servers, 32 experts and 2: a placement that already has
the slots the pass may use, so before and after hold the same number of expert copies and the
gain is the placement's, not added memory's) and one SGLang instance (``--eaas --dtype float32
--enable-metrics``) joined through the monitor. The mix's distinct prompts are split in two
halves: the *measured* half runs first (greedy requests, ``--concurrency`` at a time), then the
rebalance's state file is written from the servers' counters, then the *planning* half runs,
then ONE pass of ``python -m sglang_eaas.tools.rebalance --state FILE --slots S`` (so it plans
on the planning half alone, with the slots each server holds), a wait until SGLang's client
uses the new routing table, and the measured half again, whose tokens must equal its first
run's: the pass is judged on traffic it did not plan on.

Per MoE layer, the busiest server's entries over the mean per server: over the whole workload
(the servers' ``expert_load`` counters read before and after it), over ``--poll`` second
intervals (the counters read meanwhile: the mean over intervals of each interval's ratio) and
per exchange (SGLang's ``sglang_eaas_exchange_imbalance`` histogram: one micro-batch's rows of
one MoE layer). Next to the after-placement's measured ratio: the rebalance's plan (its model of
the new placement on the load it planned on), the load measured after on the new placement split
evenly over each expert's holders and split as evenly as its holders allow (the least any
dealing gives over the run), and the bound: the placer's placement made for that load itself
(same slots), split evenly (``bench_lib/live_balance_run.py``). Report:
.cache/bench/live-balance.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from sglang_eaas import cpu_runtime
from sglang_eaas.deploy import DeployError, Deployment, parse_config
from sglang_eaas.model_info import ModelError, MoeModelInfo

from bench_lib.live_balance_prompts import DESCRIBED, MIXES, halves
from bench_lib.live_balance_run import run_mix
from bench_lib.live_balance_report import (GOAL, goal, layer_table, runs_table, setup,
                                           summary_table)
from bench_lib.report import Report, default_out, say

ROOT = Path(__file__).resolve().parent.parent
QUICK = {"requests": 16, "max_new_tokens": 24}
# what a mix's measurement may fail with (a server lost, a request refused, a timeout)
FAILURES = (RuntimeError, TimeoutError, OSError, ValueError, subprocess.TimeoutExpired)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The default run takes about 2 minutes per mix and run on 2 CPU cores (a tier "
        "start, three workloads, a rebalance): about 25 minutes for 4 mixes x 3 runs; --quick "
        "about half. Mixes: " + "; ".join(
            f"{name}: {text}" for name, text in DESCRIBED.items()))
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-moe-stdlib",
                   help="the checkpoint; default models/tiny-moe-stdlib (the trained one)")
    p.add_argument("--mixes", default=",".join(MIXES),
                   help=f"comma-separated prompt mixes of {', '.join(MIXES)}; default all")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per workload; default 32 (16 with --quick)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="requests in flight at once; default 8")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated per request (greedy, ignore_eos); default 64 (24 "
                   "with --quick)")
    p.add_argument("--servers", type=int, default=4,
                   help="expert servers, each holding a contiguous share of the experts; "
                   "default 4")
    p.add_argument("--extra-replicas", type=int, default=2,
                   help="experts each server holds beyond its contiguous share (the next "
                   "server's first ones): the slots the pass may use, held before it too; "
                   "default 2")
    p.add_argument("--poll", type=float, default=2.0,
                   help="seconds between reads of the servers' counters during a workload "
                   "(the short-interval ratio); default 2")
    p.add_argument("--runs", type=int, default=3,
                   help="runs of every mix, each on a fresh tier; the report gives each "
                   "headline cell's median and min-max over them; default 3")
    p.add_argument("--attempts", type=int, default=2,
                   help="tries per mix: one that fails while measuring (e.g. an expert server "
                   "the monitor lost on an overloaded machine: requests get HTTP 503) runs "
                   "again on a fresh tier, and the report says so; default 2")
    p.add_argument("--quick", action="store_true",
                   help="a shorter workload (16 requests of 24 tokens) for a first look")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs" / "bench-live-balance",
                   help="deployment and rebalance logs; default .cache/logs/bench-live-balance")
    p.add_argument("--out", type=Path, default=default_out("live-balance"),
                   help="markdown report; default %(default)s")
    args = p.parse_args()
    for name, value in QUICK.items():
        if getattr(args, name) is None:
            setattr(args, name, value if args.quick else {"requests": 32,
                                                          "max_new_tokens": 64}[name])
    args.mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    unknown = [m for m in args.mixes if m not in MIXES]
    if unknown or not args.mixes:
        p.error(f"--mixes: unknown {', '.join(unknown) or '(none given)'}; known: "
                f"{', '.join(MIXES)}")
    if min(args.requests, args.concurrency, args.max_new_tokens, args.attempts, args.runs) < 1:
        p.error("--requests, --concurrency, --max-new-tokens, --runs and --attempts must be "
                ">= 1")
    if args.extra_replicas < 0:
        p.error(f"--extra-replicas must be >= 0, got {args.extra_replicas}")
    if args.servers < 2:
        p.error(f"--servers must be >= 2 (a balance needs two servers), got {args.servers}")
    if not 0.2 <= args.poll <= 60:
        p.error(f"--poll must be 0.2-60 seconds, got {args.poll}")
    return args


def contiguous(num_experts: int, servers: int, extra: int = 0) -> tuple[list[str], int]:
    """Expert lists (``"A-B"`` or ``"A-B,C-D"``) of ``servers`` servers holding contiguous,
    even shares, each also the first ``extra`` experts of the next server's share (wrapping
    around); and the most experts any server holds (the slots per server)."""
    parts = np.array_split(np.arange(num_experts), servers)
    lists, most = [], 0
    for i, part in enumerate(parts):
        after = [int(e) for e in parts[(i + 1) % servers][:extra] if e not in part]
        spans = [f"{int(part[0])}-{int(part[-1])}"]
        if after:
            spans.append(f"{after[0]}-{after[-1]}" if len(after) > 1 else str(after[0]))
        lists.append(",".join(spans))
        most = max(most, len(part) + len(after))
    return lists, most


def config(args: argparse.Namespace, experts: list[str]) -> dict:
    cpu = ["--device", "cpu"] if cpu_runtime.is_active() else []
    return {"model": str(args.model), "monitor": "standalone",
            "expert_servers": {"experts": experts},
            # no prefix cache: the run after the pass prefills what the run before did
            "sglang": {"args": [*cpu, "--max-total-tokens", "8192", "--dtype", "float32",
                                "--enable-metrics", "--disable-radix-cache"], "eaas": True,
                       "plain": {"count": 1}}}


def one_mix(mix: str, args: argparse.Namespace, info: MoeModelInfo, experts: list[str],
            slots: int):
    """``mix`` on a fresh tier, stopped after."""
    say(f"{mix}: a fresh tier ({args.servers} expert servers: {', '.join(experts)})")
    cfg = parse_config(config(args, experts), f"live-balance-{mix}")
    with Deployment(cfg, args.log_dir / mix, progress=lambda line: say("  " + line)
                    ) as deployment, tempfile.TemporaryDirectory() as tmp:
        return run_mix(deployment, mix, halves(mix, args.requests), args, info,
                       Path(tmp) / "rebalance-state.json", args.log_dir / mix, say, slots)


def main() -> int:
    args = parse_args()
    try:
        info = MoeModelInfo.from_model_path(args.model)
    except ModelError as exc:
        print(f"bench_live_balance: error: --model: {exc}", file=sys.stderr)
        return 2
    if args.servers > info.num_experts:
        print(f"bench_live_balance: error: --servers {args.servers} is more than the model's "
              f"{info.num_experts} experts", file=sys.stderr)
        return 2
    if args.servers + args.extra_replicas > info.num_experts:
        print(f"bench_live_balance: error: --servers {args.servers} and --extra-replicas "
              f"{args.extra_replicas} need more than the model's {info.num_experts} experts",
              file=sys.stderr)
        return 2
    experts, slots = contiguous(info.num_experts, args.servers, args.extra_replicas)
    report = Report(args.out)
    runs, retried = [], []  # runs[i]: run i's MixResult per mix
    for run in range(1, args.runs + 1):
        results = []
        for mix in args.mixes:
            say(f"run {run}/{args.runs}, mix {mix}")
            for attempt in range(1, args.attempts + 1):
                try:
                    results.append(one_mix(mix, args, info, experts, slots))
                    break
                except DeployError as exc:
                    print(f"bench_live_balance: error: {mix}: the tier did not deploy: {exc}",
                          file=sys.stderr)
                    return 1
                except FAILURES as exc:
                    print(f"bench_live_balance: error while measuring {mix} in run {run} (try "
                          f"{attempt} of {args.attempts}): {exc}", file=sys.stderr)
                    if attempt == args.attempts:
                        return 1
                    retried.append(f"`{mix}` in run {run} ran again on a fresh tier after: "
                                   f"{exc}")
        runs.append(results)
    every = [r for results in runs for r in results]
    report.add(setup(args, info, experts, runs[-1]))
    report.add(runs_table(runs))
    report.add(f"Run {len(runs)} of {len(runs)} in detail:")
    report.add(summary_table(runs[-1]))
    report.add(layer_table(runs[-1], info.moe_layers))
    report.add(goal(every, GOAL, len(runs)))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
