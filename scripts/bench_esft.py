"""Benchmark: ESFT adapters served over the expert servers (issue 13, item 8): decode
throughput, TPOT and TTFT of a mixed workload with 0, 1, 5 and 20 adapters loaded at runtime
against base-only serving, the expert servers' weight memory against merged checkpoints and
ExpertWeave's padding, and rerouting's share of a decode step.

One run: the trained checkpoint (models/tiny-moe-stdlib) with its 3 trained adapters plus
random ones (``python -m sglang_eaas.tools.esft random``, written to --adapter-dir) up to the
largest count; prompts of each adapter's domain (``bench_lib/esft_workload.py``). SGLang
``--eaas`` (base-only) and SGLang ``--eaas --eaas-esft`` (adapters loaded with ``POST
/load_lora_adapter``) serve the same closed loop of streaming requests in pairs of runs back to
back, one server at a time (``bench_lib/esft_live.py``); the expert servers' weight bytes are
read after each load. Then the rerouting op, ``AdapterRouting.reroute`` and the per-step batch
preparation are timed in this process (``bench_lib/esft_timing.py``). Report:
.cache/bench/esft.md and a PNG.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_lib.report import Report, default_out, say

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The default run takes about 10 minutes on 2 CPU cores (two server starts, then "
        "4 adapter counts x 5 pairs of 12 s runs); --rounds 1 --duration 8 --warmup 3 takes "
        "about 2. Run it on an otherwise idle machine.")
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-moe-stdlib",
                   help="the trained checkpoint, with its adapters in MODEL/adapters/; default "
                   "models/tiny-moe-stdlib")
    p.add_argument("--adapters", default="0,1,5,20",
                   help="adapter counts to serve, increasing, comma-separated; default 0,1,5,20 "
                   "(the trained adapters first, then random ones)")
    p.add_argument("--adapter-dir", type=Path, default=ROOT / ".cache" / "esft-adapters",
                   help="where the random adapters are written; default .cache/esft-adapters")
    p.add_argument("--servers", type=int, default=2,
                   help="local expert servers of both deployments (even placement); default 2")
    p.add_argument("--rounds", type=int, default=5,
                   help="pairs of runs (base-only, ESFT; ESFT first in odd pairs) per adapter "
                   "count; default 5")
    p.add_argument("--duration", type=float, default=12.0,
                   help="seconds of load per run (the first 3 left out); default 12")
    p.add_argument("--warmup", type=float, default=10.0,
                   help="seconds of load after each server start, not measured; default 10")
    p.add_argument("--concurrency", type=int, default=16,
                   help="concurrent streaming requests (the decode batch); default 16")
    p.add_argument("--prompt-tokens", type=int, default=48,
                   help="tokens per prompt; default 48")
    p.add_argument("--output-len", type=int, default=64,
                   help="tokens generated per request (ignore_eos); default 64")
    p.add_argument("--prompts-per-adapter", type=int, default=8,
                   help="distinct prompts of each adapter's domain; default 8")
    p.add_argument("--radix-cache", action="store_true",
                   help="keep SGLang's radix cache (off by default: prompts repeat, and runs with "
                   "fewer adapters have fewer distinct prompt-adapter pairs, so cache hits would "
                   "favour them)")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs",
                   help="where the server logs go (bench-esft-base.log, bench-esft.log); "
                   "default .cache/logs")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown report; default .cache/bench/esft.md")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of the ratios and memory against adapters; default --out with .png")
    args = p.parse_args()
    args.out = args.out or default_out("esft")
    args.plot = args.plot or args.out.with_suffix(".png")
    try:
        args.adapters = [int(x) for x in args.adapters.split(",") if x.strip()]
    except ValueError:
        p.error("--adapters takes whole numbers separated by commas, e.g. 0,1,5,20")
    if not args.adapters or args.adapters != sorted(set(args.adapters)) or args.adapters[0] < 0:
        p.error("--adapters must be increasing counts >= 0")
    if args.adapters[-1] < 1:
        p.error("--adapters needs a count >= 1 (the goal is about the largest)")
    if min(args.servers, args.rounds, args.concurrency, args.prompt_tokens,
           args.prompts_per_adapter) < 1 or args.output_len < 2:
        p.error("--servers, --rounds, --concurrency, --prompt-tokens and --prompts-per-adapter "
                "must be >= 1, --output-len >= 2")
    if args.duration <= 5 or args.warmup < 0:
        p.error("--duration must be > 5 (3 s are left out) and --warmup >= 0")
    return args


def main() -> int:
    args = parse_args()
    from transformers import AutoTokenizer

    from sglang_eaas.model_info import MoeModelInfo
    from bench_lib import esft_report as R
    from bench_lib.esft_live import run_live
    from bench_lib.esft_timing import time_reroute
    from bench_lib.esft_workload import make_adapters, prompts_per_adapter

    info = MoeModelInfo.from_model_path(args.model)
    report = Report(args.out)
    adapters = make_adapters(args.model, args.adapter_dir, args.adapters[-1], say)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = prompts_per_adapter(adapters, tokenizer, args.prompt_tokens,
                                  args.prompts_per_adapter)
    say(f"{len(adapters)} adapters, {args.prompts_per_adapter} prompts each")
    live = run_live(args.model, adapters, prompts, args, say)
    label = str(args.adapters[-1])
    say(f"timing the rerouting in this process ({args.concurrency} tokens, {label} adapters)")
    timing = time_reroute(list(info.moe_layers), info.num_experts, info.top_k,
                          args.concurrency, args.adapters[-1])
    ckpt = R.checkpoint_sizes(args.model, len(info.moe_layers) * info.num_experts)
    rows = R.memory_rows(live, ckpt, args.adapters, adapters, info)
    report.add(R.serving_table(live, args, info, adapters))
    report.add(R.cpu_table(live))
    report.add(R.memory_table(rows, live, ckpt, info))
    tpot = R._mean(live.runs[label].tpot_ms)
    report.add(R.reroute_table(timing, args, info, tpot, label))
    text, _ = R.goal(live, timing, info, label)
    report.add(text)
    report.add("The expert servers, SGLang and this load generator share 2 cores here: "
               "what ESFT costs in the attention client (rerouting, batch preparation) or the "
               "servers (more distinct experts per step) takes CPU time from the others. "
               f"Server logs: {', '.join(f'`{p.relative_to(ROOT)}`' for p in live.logs)}.")
    R.plot(args.plot, live, rows)
    report.add(f"Chart: `{args.plot.name}`.")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
