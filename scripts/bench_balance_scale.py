"""Benchmark: how much the scaler and placer take off the straggler time of SGLang's EPLB as the
expert tier grows, on the Zipf-skewed traces of ``bench_balance.py`` (issue 12, item 8), offline.

``bench_balance.py`` compares the policies at one size: 4 expert servers (8 of the checkpoint's
32 experts each) and decode steps of 32 requests, what this machine can also serve live. Two
things set how much a placement can gain there, and both change with the deployment: how many
experts share a server (the fewer, the less a server's load averages out, the more skew reaches
the straggler; MoEless's testbed has 8 GPUs, DeepSeek's decode deployment one expert per GPU)
and how many entries a step deals (the more, the less one step's sampling noise, which no
placement removes, and the less the fixed cost per call weighs). This script runs the same
policies (``bench_lib/balance_policies.py``: none, eplb-sglang, eplb, moeless, oracle) on the
same Zipf traces for every ``--servers`` x ``--batches`` pair, with the same memory per layer
(``--memory`` times the experts), measures the straggler time with the expert servers' kernel
on sampled windows (``bench_lib/balance_kernel.py``) and models it for every window (one fit
over all the run's calls), and reports, per setting, how much lower MoEless's straggler time is
than EPLB's as SGLang runs it, with the issue's goal (max/mean <= 1.1, >= 20% lower) per row.
Report: .cache/bench/balance-scale.md and a PNG of the gains.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench_lib.balance_flags import add_placement_flags, check_placement_flags
from bench_lib.report import Report, default_out, pyplot, save_figure, say

GOAL_RATIO, GOAL_GAIN = 1.1, 0.20
POLICIES = ("none", "eplb-sglang", "eplb", "moeless", "oracle")


def numbers(kind):
    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                             f"{kind.__name__}s") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least one value, all > 0")
        return values
    return parse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The default run takes about 4 minutes on 2 CPU cores (placing 64 windows per "
               "trace and setting, and timing the kernel on 8 of them); --servers 4,8 "
               "--batches 32,256 --zipf 1.4 --measure-windows 2 takes under a minute. Run it on "
               "an otherwise idle machine.")
    add_placement_flags(parser)
    parser.add_argument("--servers", type=numbers(int), default=[4, 8, 16],
                        help="expert server counts, comma-separated; default 4,8,16")
    parser.add_argument("--batches", type=numbers(int), default=[32, 128, 256],
                        help="requests per decode step (one token each), comma-separated; "
                             "default 32,128,256")
    parser.add_argument("--zipf", type=numbers(float), default=[1.0, 1.4],
                        help="Zipf exponents s of the traces, comma-separated; default 1.0,1.4 "
                             "(bench_balance's)")
    parser.add_argument("--memory", type=float, default=1.25,
                        help="expert slots per MoE layer over the experts, the same for every "
                             "policy; each server gets ceil(memory x experts / servers); default "
                             "1.25, bench_balance's 4 x 10 slots for 32 experts")
    parser.add_argument("--steps", type=int, default=1024,
                        help="decode steps per trace (the Zipf permutation changes half-way); "
                             "default 1024")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the first Zipf trace (the next ones: +1, +2, ...); "
                             "default 0")
    parser.add_argument("--out", type=Path, default=default_out("balance-scale"),
                        help="markdown report; default .cache/bench/balance-scale.md")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG of the gains; default --out with .png")
    args = parser.parse_args()
    if args.memory < 1:
        parser.error(f"--memory {args.memory:g} cannot hold every expert once (it must be >= 1)")
    check_placement_flags(parser, args)
    if args.steps < 4 * args.window:
        parser.error(f"--steps {args.steps} must give at least 4 windows of {args.window}")
    args.plot = args.plot or args.out.with_suffix(".png")
    return args


@dataclass(frozen=True)
class Row:
    """One trace at one setting: max/mean per window (per step for moeless), straggler time
    (us, measured), and how much lower than a base's each policy's time is (fractions)."""

    servers: int
    slots: int
    trace: str
    batch: int
    entries: int  # per MoE layer per step
    none: float
    sglang: float
    moeless: float
    step: float
    sglang_us: float
    moeless_us: float
    gain: float  # moeless below eplb-sglang, measured
    gain_modelled: float
    bound: float  # oracle below eplb-sglang, measured
    bound_modelled: float
    fresh: float  # moeless below eplb, measured

    @property
    def met(self) -> bool:
        return self.moeless <= GOAL_RATIO and min(self.gain, self.gain_modelled) >= GOAL_GAIN


def setting_row(trace, servers: int, slots: int, outcomes: dict, straggler: dict,
                coef: tuple, window: int) -> Row:
    from bench_lib.balance_report import below

    def ratio(p: str) -> float:
        return float(outcomes[p].ratio[1:].mean())

    def lower(policy: str, base: str) -> tuple[float, float]:
        return below(outcomes, straggler, coef, window, policy, base)

    batch, top_k = trace.ids.shape[2], trace.ids.shape[3]
    return Row(servers, slots, trace.name, batch, batch * top_k, ratio("none"),
               ratio("eplb-sglang"), ratio("moeless"),
               float(outcomes["moeless"].step_ratio()[window:].mean()),
               float(straggler["eplb-sglang"].mean()) * 1e6,
               float(straggler["moeless"].mean()) * 1e6,
               *lower("moeless", "eplb-sglang"), *lower("oracle", "eplb-sglang"),
               lower("moeless", "eplb")[0])


def table(rows: list[Row], experts: int) -> str:
    lines = [
        "| servers | experts / server | slots / server | batch | entries / server / step "
        "| trace | max/mean none | eplb-sglang | moeless | moeless per step "
        "| eplb-sglang us | moeless us | moeless below eplb-sglang, measured | modelled "
        "| oracle below eplb-sglang, measured | modelled | moeless below eplb, measured | goal |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.servers} | {experts / r.servers:g} | {r.slots} | {r.batch} | "
            f"{r.entries / r.servers:g} | {r.trace} | {r.none:.3f} | "
            f"{r.sglang:.3f} | {r.moeless:.3f} | {r.step:.3f} | "
            f"{r.sglang_us:.1f} | {r.moeless_us:.1f} | {r.gain:.1%} | "
            f"{r.gain_modelled:.1%} | {r.bound:.1%} | {r.bound_modelled:.1%} | "
            f"{r.fresh:.1%} | {'met' if r.met else 'not met'} |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    met = [r for r in rows if r.met]
    settings = sorted({(r.servers, r.batch) for r in rows})
    whole = [s for s in settings if all(r.met for r in rows if (r.servers, r.batch) == s)]
    where = ", ".join(f"{n} servers x batch {b}" for n, b in whole) or "no setting"
    return (f"Goal (issue 12: max/mean <= {GOAL_RATIO} and >= {GOAL_GAIN:.0%} lower straggler "
            "time than EPLB as SGLang runs it, measured and modelled both): met in "
            f"{len(met)} of {len(rows)} rows; on every trace at {where}.")


def plot(path: Path, rows: list[Row]) -> None:
    plt = pyplot()
    if plt is None:
        return
    traces = list(dict.fromkeys(r.trace for r in rows))
    batches = sorted({r.batch for r in rows})
    fig, axes = plt.subplots(1, len(traces), figsize=(5.2 * len(traces), 4.2), dpi=110,
                             squeeze=False, sharey=True)
    for ax, name in zip(axes[0], traces):
        for i, batch in enumerate(batches):
            got = sorted((r for r in rows if r.trace == name and r.batch == batch),
                         key=lambda r: r.servers)
            servers = [r.servers for r in got]
            ax.plot(servers, [100 * r.gain for r in got], marker="o", color=f"C{i}",
                    label=f"moeless, batch {batch}")
            ax.plot(servers, [100 * r.bound for r in got], linestyle=":", color=f"C{i}",
                    label=f"oracle, batch {batch}")
        ax.axhline(100 * GOAL_GAIN, color="grey", linestyle="--", linewidth=1,
                   label=f"goal ({GOAL_GAIN:.0%})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r.servers for r in rows}),
                      [str(n) for n in sorted({r.servers for r in rows})])
        ax.set_title(f"{name}: straggler time below eplb-sglang")
        ax.set_xlabel("expert servers (same memory per layer)")
        ax.set_ylabel("% lower than eplb-sglang (measured)")
    save_figure(fig, path, legend_below=4)


def main() -> int:
    args = parse_args()
    from sglang_eaas.balance.scaler import DEFAULT_CV_TARGET
    from sglang_eaas.model_info import MoeModelInfo
    from bench_lib.balance_kernel import Kernels, fit, measure, sample_windows
    from bench_lib.balance_policies import place_trace
    from bench_lib.balance_traces import zipf

    info = MoeModelInfo.from_model_path(args.model)
    cv_target = DEFAULT_CV_TARGET if args.cv_target is None else args.cv_target
    report = Report(args.out)
    kernels = Kernels(args.model, info)
    windows = args.steps // args.window
    runs = []  # (trace, servers, slots, outcomes, measured)
    for batch in args.batches:
        traces = [zipf(s, list(info.moe_layers), info.num_experts, info.top_k, args.steps,
                       batch, info.hidden_size, args.seed + i) for i, s in enumerate(args.zipf)]
        for n in args.servers:
            slots = math.ceil(args.memory * info.num_experts / n)
            servers = [f"local:{i}" for i in range(n)]
            for trace in traces:
                outcomes = place_trace(trace, servers, slots, args.window, args.eplb_period,
                                       cv_target, POLICIES)
                chosen = sample_windows(args.measure_windows, windows,
                                        trace.shift // args.window)
                say(f"{trace.name}, batch {batch}, {n} servers x {slots} slots: placed; "
                    f"timing {len(chosen)} windows")
                runs.append((trace, n, slots, outcomes,
                             measure(kernels, trace, outcomes, chosen, args.window, args.repeat,
                                     lambda line: None)))
    samples = np.concatenate([m.samples for *_, m in runs])
    c, a, b, r2 = fit(samples)
    rows = [setting_row(trace, n, slots, outcomes, m.straggler, (c, a, b), args.window)
            for trace, n, slots, outcomes, m in runs]
    rows.sort(key=lambda r: (r.trace, r.batch, r.servers))
    report.add(
        f"Trained checkpoint `{args.model.name}`'s experts ({info.num_experts} per MoE layer, "
        f"top-{info.top_k}, {len(info.moe_layers)} MoE layers) on synthetic Zipf traces "
        f"(`bench_lib/balance_traces.zipf`, seeds from {args.seed}: the same traces as "
        f"`bench_balance.py` at the same batch) of {args.steps} decode steps, the permutation "
        f"of experts drawn again half-way; a placement per window of {args.window} steps; every "
        f"policy gets ceil({args.memory:g} x {info.num_experts} / servers) expert slots per "
        f"server and layer; CV target {cv_target:g}; *eplb-sglang* rebalances every "
        f"{args.eplb_period} steps and starts from EPLB's placement of the first half (as in "
        f"`bench_balance.py`). Means over windows 1.. and MoE layers: **max/mean**, the busiest "
        "server's tokens over the mean per window (*per step*: in one step); straggler time "
        f"measured with the expert servers' kernel on {args.measure_windows} windows per trace "
        "and setting (the slowest server's call per step and layer, the fastest of "
        f"{args.repeat} repeats), modelled with one fit over the run's calls for every window "
        f"(c = {c * 1e6:.2f} us, a = {a * 1e6:.3f} us per entry, b = {b * 1e6:.3f} us per "
        f"weight set, R^2 = {r2:.2f}); *below*: 1 - time / eplb-sglang's time.")
    report.add(table(rows, info.num_experts))
    report.add(summary(rows))
    plot(args.plot, rows)
    report.add(f"Chart: `{args.plot.name}`.")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
