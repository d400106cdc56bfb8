"""bench_live_balance's report: the set-up, a table per mix (mean over MoE layers / worst
layer), a table per MoE layer, and the goal's verdict."""

from __future__ import annotations

import numpy as np

from bench_lib.live_balance_prompts import DESCRIBED
from bench_lib.report import spread

GOAL = 1.1  # issue 25: after the pass, busiest server <= 1.1x the mean


def both(ratios: np.ndarray) -> str:
    """``mean over layers / worst layer``."""
    if np.isnan(ratios).all():
        return "-"
    return f"{np.nanmean(ratios):.2f} / {np.nanmax(ratios):.2f}"


def arrow(before: np.ndarray, after: np.ndarray) -> str:
    return f"{both(before)} → {both(after)}"


def setup(args, info, experts: list[str], results: list) -> str:
    slots = sorted({r.slots for r in results})
    state = " --state FILE"
    lines = [
        f"Checkpoint `{args.model.name}` ({len(info.moe_layers)} MoE layers x "
        f"{info.num_experts} experts, top-{info.top_k}) under SGLang `--eaas --dtype float32 "
        f"--enable-metrics --disable-radix-cache` (so a run again prefills what the run before "
        f"did). Per mix a fresh tier (`sglang_eaas.deploy.Deployment`): a standalone monitor, "
        f"{len(experts)} expert servers holding experts {', '.join(experts)} (contiguous "
        f"shares plus {args.extra_replicas} of the next server's: {', '.join(map(str, slots))} "
        f"slots per MoE layer per server before the pass, the same the pass plans with), one "
        f"SGLang instance joined through the monitor. The mix's distinct prompts are split in "
        f"two halves. Workloads: {args.requests} requests of one half (its prompts in order, "
        f"cycled), {args.concurrency} at a time, {args.max_new_tokens} tokens each (greedy, "
        f"`ignore_eos`), to the instance's `/generate`. In order: the **measured** half; the "
        f"rebalance's state file written from the servers' counters; the **planning** half; "
        f"one `python -m sglang_eaas.tools.rebalance --monitor ADDR{state} --slots S` pass "
        f"(so it plans on the planning half alone); a wait until SGLang's client uses the new "
        "routing table; the measured half again. Before and after are both the measured half, "
        "which the pass never saw, on the same number of expert copies: the change is the "
        "placement's, not added memory's.",
        "",
        "Each ratio is the busiest expert server's entries over the mean per server for one MoE "
        "layer; a cell gives the mean over the MoE layers / the worst layer. **Whole run**: "
        "the servers' own `expert_load` counters read before and after the workload. "
        f"**{args.poll:g} s intervals**: the counters read every {args.poll:g} s during it, "
        "the mean over the intervals of each interval's ratio (intervals with fewer than "
        f"{args.concurrency * info.top_k} entries in a layer, one full decode step's, left "
        "out). **Per exchange**: SGLang's `sglang_eaas_exchange_imbalance` histogram, its mean "
        "(sum / count) over the workload's exchanges (prefill and decode batches: one "
        "micro-batch's rows of one MoE layer). **Plan**: the rebalance's own model of its "
        "placement on the load it planned on (each expert's entries split evenly over its "
        "holders). Then the load measured after the pass (entries per expert over the whole "
        "run) on the placement after it: **even split**, each expert's entries split evenly over "
        "its holders (`balance.evaluate.layer_load`, fractional: the placer's model; the "
        "measured ratio against it is what dealing by load adds over an even split); **best "
        "split**, split as evenly over the servers as the holders allow (a linear program over "
        "the run's totals: no dealing of the steps can do better over the run, so the measured "
        "whole-run ratio is at least this). **Bound**: the placer's own placement made from "
        "scratch for that measured load (`balance.placer.balance_model`, the same slots), "
        "split evenly: what a placement with these slots reaches on it (it sees the measured "
        "half; the pass did not).",
        "",
        "Mixes: " + "; ".join(f"`{r.mix}`: {DESCRIBED[r.mix]}" for r in results) + ".",
    ]
    return "\n".join(lines)


def runs_table(runs: list[list]) -> str:
    """The headline cells over the runs (each on a fresh tier): per mix, the median and min-max
    over the runs of the mean over MoE layers (the worst layer's too, after the pass)."""
    lines = [f"Over {len(runs)} runs (median [min-max] of the runs; each cell the mean over the "
             "MoE layers unless it says worst layer):", "",
             "| mix | whole run before | whole run after | after, worst layer | short intervals "
             "before | after | per exchange before | after | tokens identical in every run |",
             "|---|" + "---:|" * 7 + "---|"]
    for mix in dict.fromkeys(r.mix for results in runs for r in results):
        of = [r for results in runs for r in results if r.mix == mix]

        def cell(get, worst=False) -> str:
            return spread([float(np.nanmax(get(r)) if worst else np.nanmean(get(r)))
                           for r in of], ".2f")
        same = "yes" if not any(r.differing for r in of) else "NO"
        lines.append(f"| {mix} ({len(of)} runs) | {cell(lambda r: r.before.window)} | "
                     f"{cell(lambda r: r.after.window)} | "
                     f"{cell(lambda r: r.after.window, worst=True)} | "
                     f"{cell(lambda r: r.before.intervals)} | "
                     f"{cell(lambda r: r.after.intervals)} | "
                     f"{cell(lambda r: r.before.exchange)} | {cell(lambda r: r.after.exchange)} "
                     f"| {same} |")
    return "\n".join(lines)


def summary_table(results: list) -> str:
    lines = ["| mix | planning half, before (whole run) | measured half, whole run: before → "
             "after | short intervals: before → after | per exchange: before → after | plan | "
             "even split | best split | bound | replicas | tokens identical |",
             "|---|" + "---:|" * 9 + "---|"]
    for r in results:
        b, a = r.before, r.after
        plan = np.array([r.rebalanced.planned.get(layer, np.nan)
                         for layer in sorted(r.rebalanced.planned)] or [np.nan])
        same = "yes" if not r.differing else f"NO ({r.differing} of {len(b.outputs)} differ)"
        lines.append(f"| {r.mix} | {both(r.planned_on.window)} | "
                     f"{arrow(b.window, a.window)} | "
                     f"{arrow(b.intervals, a.intervals)} | {arrow(b.exchange, a.exchange)} | "
                     f"{both(plan)} | {both(r.even)} | {both(r.best)} | {both(r.bound)} | "
                     f"{r.replicas} | {same} |")
    runs = [f"- `{r.mix}`: measured half {r.before.seconds:.0f} s before, {r.after.seconds:.0f} s "
            f"after ({r.before.polls} and {r.after.polls} intervals), planning half "
            f"{r.planned_on.seconds:.0f} s; SGLang on the new table "
            f"{r.table_wait:.1f} s after the pass; entries a server computed after the pass for "
            f"an expert it no longer held: {r.stale}" for r in results]
    return "\n".join(lines) + "\n\n" + "\n".join(runs)


def layer_table(results: list, layers) -> str:
    lines = ["| mix | MoE layer | whole run before | after | intervals before | after | per "
             "exchange before | after | rebalance: modelled → plan | even split | best split | "
             "bound |", "|---|---:|" + "---:|" * 10]
    for r in results:
        for i, layer in enumerate(layers):
            b, a = r.before, r.after
            modelled, planned = (r.rebalanced.modelled.get(layer), r.rebalanced.planned.get(layer))
            plan = (f"{modelled:.2f} → {planned:.2f}" if modelled is not None
                    and planned is not None else "-")
            lines.append(f"| {r.mix} | {layer} | {b.window[i]:.2f} | {a.window[i]:.2f} | "
                         f"{b.intervals[i]:.2f} | {a.intervals[i]:.2f} | {b.exchange[i]:.2f} | "
                         f"{a.exchange[i]:.2f} | {plan} | {r.even[i]:.2f} | {r.best[i]:.2f} | "
                         f"{r.bound[i]:.2f} |")
    return "\n".join(lines)


def goal(results: list, target: float, runs: int = 1) -> str:
    worst = max(((r.after.window[i], r.mix, i, r.best[i], r.bound[i]) for r in results
                 for i in range(len(r.after.window))), key=lambda t: t[0])
    every = all((r.after.window <= target + 1e-9).all() for r in results)
    means: dict[str, float] = {}  # per mix, the worst run's mean over layers
    for r in results:
        means[r.mix] = max(means.get(r.mix, 0.0), float(np.nanmean(r.after.window)))
    on_mean = all(m <= target + 1e-9 for m in means.values())
    bounded = [f"{r.mix} MoE layer {i} ({r.bound[i]:.2f}x)" for r in results
               for i in range(len(r.bound)) if r.bound[i] > target + 1e-9]
    differ = sum(r.differing for r in results)
    text = [
        f"Goal (issue 25): after the pass, the busiest server at most {target:.1f}x the mean "
        "over the whole workload (the servers' counters)"
        + (f", in every one of {runs} runs (the worst run quoted)" if runs > 1 else ""),
        f"- on every MoE layer of every mix: **{'met' if every else 'NOT met'}** (worst: "
        f"{worst[1]} MoE layer {worst[2]} at {worst[0]:.2f}x; there the best split of the "
        f"placement is {worst[3]:.2f}x, the bound {worst[4]:.2f}x)",
        f"- on the mean over the MoE layers of every mix: **{'met' if on_mean else 'NOT met'}** "
        "(" + ", ".join(f"{m} {v:.2f}x" for m, v in means.items()) + ")",
        "- layers whose bound itself is above it (these slots cannot reach it on that load): "
        + (", ".join(bounded) if bounded else "none"),
        "- greedy tokens the same before and after the pass: "
        + ("**yes**, every request of every mix" if not differ
           else f"**NO**: {differ} requests differ"),
    ]
    return "\n".join(text)
