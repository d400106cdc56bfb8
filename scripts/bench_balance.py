"""Benchmark: expert load balancing (issue 12, item 8): no balancing, SGLang's EPLB (at SGLang's
cadence and every window) and MoEless's scaler and placer (on past, predicted and actual load)
on the same memory, on decode traces whose load shifts half-way, then each placement live under
SGLang ``--eaas``.

Traces (``bench_lib/balance_traces.py``): recorded from the trained checkpoint
(models/tiny-moe-stdlib) over one prompt mix then another (``--shifts``; mixes are groups of
stdlib packages), and synthetic Zipf-skewed ones (``--zipf``), in windows of ``--window``
decode steps of ``--batch`` requests. Policies (``bench_lib/balance_policies.py``): ``--servers``
x ``--slots`` expert slots per MoE layer each; the placement for window t is decided before it.
Per policy and trace: the busiest server's tokens over the mean, the MoE layer's straggler time
measured with the expert servers' kernel on each server's share for a sample of windows
(``bench_lib/balance_kernel.py``) and modelled for all windows with a, b fitted to those
measurements, and replicas loaded per window. Then (``bench_lib/balance_live.py``) one SGLang
``--eaas`` deployment with N local expert servers serves the first recorded trace's
second-half mix under each policy's placement, made live with ``balance.apply``. Report:
.cache/bench/balance.md and a PNG of max/mean per window.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench_lib.balance_flags import add_placement_flags, check_placement_flags
from bench_lib.balance_policies import LABELS, POLICIES, place_trace
from bench_lib.balance_traces import MIXES, REQUEST_TOKENS, StepTrace
from bench_lib.report import Report, default_out, pyplot, save_figure, say

ROOT = Path(__file__).resolve().parent.parent
GOAL_RATIO, GOAL_GAIN = 1.1, 0.20


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The default run takes about 8 minutes on 2 CPU cores (recording, the offline "
        "comparison with kernel timings, one SGLang start, 3 rounds of five 20 s live runs); "
        "--no-live --measure-windows 2 --zipf 1.2 --shifts A:B takes about a minute. Run it on "
        "an otherwise idle machine. Mixes: " + "; ".join(
            f"{k} = {name} ({', '.join(pk)})" for k, (name, pk) in MIXES.items()))
    add_placement_flags(p)
    p.add_argument("--predictors", type=Path, default=None,
                   help="its layer-aware predictors (distance 1); default "
                   "MODEL/predictors/d1.safetensors")
    p.add_argument("--shifts", default="A:B,C:A",
                   help="recorded traces, comma-separated, each FIRST:SECOND: requests of mix "
                   "FIRST, then of SECOND (mixes in the epilog); default A:B,C:A; '' for none")
    p.add_argument("--zipf", default="1.0,1.4",
                   help="synthetic traces: Zipf exponents s, comma-separated; default 1.0,1.4; "
                   "'' for none")
    p.add_argument("--requests-per-half", type=int, default=64,
                   help="requests of each mix (a multiple of --batch; each gives 256 decode "
                   "steps' tokens); default 64")
    p.add_argument("--batch", type=int, default=32,
                   help="requests per decode step (one token each); default 32, the "
                   "predictors' step size")
    p.add_argument("--servers", type=int, default=4, help="expert servers; default 4")
    p.add_argument("--slots", type=int, default=None,
                   help="expert slots per MoE layer per server, the same for every policy; "
                   "default experts / servers + 2")
    p.add_argument("--seed", type=int, default=0, help="seed of the Zipf traces; default 0")
    p.add_argument("--no-live", action="store_true",
                   help="skip the live part (no SGLang server is started)")
    p.add_argument("--live-duration", type=float, default=20.0,
                   help="seconds of load per placement in the live part; default 20")
    p.add_argument("--live-rounds", type=int, default=3,
                   help="rounds over the placements in the live part, every other one in "
                   "reverse order; default 3")
    p.add_argument("--live-concurrency", type=int, default=16,
                   help="concurrent streaming requests in the live part; default 16")
    p.add_argument("--live-prompt-tokens", type=int, default=48,
                   help="live prompts: this many tokens of each second-half request, as text; "
                   "default 48")
    p.add_argument("--live-output-len", type=int, default=64,
                   help="tokens generated per live request (ignore_eos); default 64")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs",
                   help="where the server log goes; default .cache/logs")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown report; default .cache/bench/balance.md")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of max/mean per window; default --out with .png")
    args = p.parse_args()
    check_placement_flags(p, args)
    args.out = args.out or default_out("balance")
    args.plot = args.plot or args.out.with_suffix(".png")
    args.predictors = args.predictors or args.model / "predictors" / "d1.safetensors"
    try:
        args.shifts = [tuple(s.split(":")) for s in args.shifts.split(",") if s.strip()]
        args.zipf = floats(args.zipf)
    except ValueError:
        p.error("--zipf takes numbers separated by commas, e.g. 1.0,1.4")
    if any(len(s) != 2 or not set(s) <= set(MIXES) for s in args.shifts):
        p.error(f"--shifts takes FIRST:SECOND pairs of the mixes {', '.join(MIXES)}")
    if not args.shifts and not args.zipf:
        p.error("nothing to compare: give --shifts or --zipf")
    if args.batch < 1 or args.requests_per_half < args.batch or args.requests_per_half % args.batch:
        p.error("--requests-per-half must be a positive multiple of --batch")
    if args.window < 1 or (2 * args.requests_per_half // args.batch * REQUEST_TOKENS
                           < 4 * args.window):
        p.error("--window must be >= 1 and leave at least 4 windows in a trace")
    if args.slots is not None and args.slots < 1:
        p.error("--slots must be >= 1")
    if args.servers < 1:
        p.error("--servers must be >= 1")
    if (min(args.live_concurrency, args.live_prompt_tokens, args.live_rounds) < 1
            or args.live_output_len < 2 or args.live_duration <= 5):
        p.error("the --live-* numbers must be >= 1 (--live-output-len >= 2, --live-duration > 5)")
    return args


def load_traces(args, info) -> list[StepTrace]:
    """The recorded traces (``--shifts``), then the Zipf ones, all of the same steps."""
    import torch

    from sglang_eaas.balance import traces as T
    from sglang_eaas.balance.predictor import PredictorSet
    from bench_lib import balance_traces as B

    steps = 2 * args.requests_per_half // args.batch * REQUEST_TOKENS
    out = []
    if args.shifts:
        from transformers import AutoTokenizer

        torch.set_num_threads(2)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        predictors = PredictorSet.load(args.predictors)
        model = T.load_model(args.model)
        requests = T.stdlib_requests(tokenizer, REQUEST_TOKENS, B.CHUNKS_PER_FILE)
        for first, second in args.shifts:
            say(f"recording mix {first} then {second} ({args.requests_per_half} requests each)")
            out.append(B.recorded(model, requests, predictors, first, second,
                                  args.requests_per_half, args.batch,
                                  log=lambda line: say("  " + line)))
        args.tokenizer = tokenizer
    for i, s in enumerate(args.zipf):
        out.append(B.zipf(s, list(info.moe_layers), info.num_experts, info.top_k, steps,
                          args.batch, info.hidden_size, args.seed + i))
    return out


def live_section(args, trace: StepTrace, outcomes: dict, servers: list[str]) -> str:
    """Each policy's placement for ``trace``'s last window, live under SGLang, and the table."""
    from bench_lib.balance_live import run_live
    from bench_lib.balance_policies import even
    from bench_lib.balance_report import live_table

    first = even(servers, trace.layers, trace.num_experts).holdings
    order = [(p, o.placed[-1].holdings) for p, o in outcomes.items()]
    prompts = [args.tokenizer.decode(list(ids[:args.live_prompt_tokens]))
               for ids in trace.prompts]
    results = run_live(args.model, first, order, prompts, args, say)
    return live_table(results, args, trace)


def plot(path: Path, traces: list[StepTrace], results: dict, window: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    shown = [next(t for t in traces if t.kind == kind) for kind in ("recorded", "zipf")
             if any(t.kind == kind for t in traces)]
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4.4), dpi=110,
                             squeeze=False)
    for ax, trace in zip(axes[0], shown):
        for policy, out in results[trace.name].items():
            per_window = out.ratio.mean(axis=1)
            ax.plot(range(1, len(per_window)), per_window[1:], label=LABELS[policy],
                    linewidth=1.2, color=f"C{POLICIES.index(policy)}")
        ax.axvline(trace.shift / window, color="grey", linestyle="--", linewidth=1,
                   label="mix shift")
        ax.set_title(f"{trace.name}: {window}-step windows")
        ax.set_xlabel("window")
        ax.set_ylabel("busiest server / mean (mean over MoE layers)")
    save_figure(fig, path, legend_below=3)


def main() -> int:
    args = parse_args()
    from sglang_eaas.balance.scaler import DEFAULT_CV_TARGET
    from sglang_eaas.model_info import MoeModelInfo
    from bench_lib.balance_kernel import Kernels, fit, measure, sample_windows
    from bench_lib.balance_report import fit_text, goal, result_table, setup_text

    info = MoeModelInfo.from_model_path(args.model)
    slots = args.slots or info.num_experts // args.servers + 2
    cv_target = DEFAULT_CV_TARGET if args.cv_target is None else args.cv_target
    if args.servers * slots < info.num_experts:
        print(f"bench_balance: error: --servers {args.servers} x --slots {slots} cannot hold "
              f"the model's {info.num_experts} experts once", file=sys.stderr)
        return 2
    report = Report(args.out)
    servers = [f"local:{i}" for i in range(args.servers)]
    try:
        traces = load_traces(args, info)
    except ValueError as exc:  # a predictors file that is not one, a mix with too few requests
        print(f"bench_balance: error: {exc}", file=sys.stderr)
        return 2
    kernels = Kernels(args.model, info)
    results, measured = {}, {}
    for trace in traces:
        results[trace.name] = place_trace(trace, servers, slots, args.window,
                                          args.eplb_period, cv_target)
        windows = trace.steps // args.window
        say(f"{trace.name}: {windows} windows placed by {', '.join(results[trace.name])}")
        chosen = sample_windows(args.measure_windows, windows, trace.shift // args.window)
        measured[trace.name] = measure(kernels, trace, results[trace.name], chosen,
                                       args.window, args.repeat, say)
    samples = np.concatenate([m.samples for m in measured.values()])
    c, a, b, r2 = fit(samples)
    report.add(setup_text(args, info, traces, slots, cv_target))
    report.add(result_table(traces, results, measured, (c, a, b), args.window))
    report.add(fit_text(samples, (c, a, b), r2, traces, results, measured, args.window))
    report.add(goal(traces, results, measured, (c, a, b), args.window, GOAL_RATIO,
                    GOAL_GAIN))
    plot(args.plot, traces, results, args.window)
    recorded = [t for t in traces if t.kind == "recorded"]
    if args.no_live or not recorded:
        report.add("Live part: not run (" + ("--no-live" if args.no_live else
                                             "no recorded trace for its prompts") + ").")
    else:
        report.add(live_section(args, recorded[0], results[recorded[0].name], servers))
    report.add(f"Chart: `{args.plot.name}`.")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
