"""bench_balance's report sections: the setup, the comparison table, the goal, the live part."""

from __future__ import annotations

import numpy as np

from bench_lib.balance_policies import LABELS, Outcome
from bench_lib.balance_traces import MIXES, StepTrace


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}x" if base > 0 else "-"


def shift_size(trace: StepTrace) -> float:
    """Total variation between the two halves' load distributions, mean over MoE layers."""
    halves = [trace.loads[:trace.shift].sum(0), trace.loads[trace.shift:].sum(0)]
    p = [h / h.sum(axis=1, keepdims=True) for h in halves]
    return float((0.5 * np.abs(p[0] - p[1]).sum(axis=1)).mean())


def setup_text(args, info, traces: list[StepTrace], slots: int, cv_target: float) -> str:
    lines = [
        f"Trained checkpoint `{args.model.name}` (Qwen3-MoE, {len(info.moe_layers)} MoE layers, "
        f"{info.num_experts} experts, top-{info.top_k}). Every policy gets {args.servers} expert "
        f"servers x {slots} expert slots per MoE layer ({args.servers * slots} per layer for "
        f"{info.num_experts} experts); a placement per window of {args.window} decode "
        f"step{'s' if args.window != 1 else ''} of {args.batch} requests (one token each), "
        "decided before the window; CV target "
        f"{cv_target:g}. Traces (the mix or the Zipf permutation changes half-way):",
        "",
        "| trace | what | steps | windows | expert max/mean | shift (TV distance of the "
        "halves' loads) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for t in traces:
        if t.kind == "recorded":
            first, second = t.name.split()[-1].split("->")
            what = (f"recorded: {args.requests_per_half} requests of mix {first} "
                    f"({MIXES[first][0]}), then {args.requests_per_half} of {second} "
                    f"({MIXES[second][0]})")
        else:
            what = f"synthetic, seed {args.seed + args.zipf.index(float(t.name.split('=')[1]))}"
        lines.append(f"| {t.name} | {what} | {t.steps} | {t.steps // args.window} | "
                     f"{t.skew:.2f} | {shift_size(t):.3f} |")
    lines += [
        "",
        "Mixes (stdlib packages; files of the predictors' valid and test splits only): "
        + "; ".join(f"{k} = {', '.join(pk)}" for k, (_, pk) in MIXES.items()) + ". "
        "Placements: " + "; ".join(f"**{p}** = {label}" for p, label in LABELS.items()) + ". "
        "EPLB is SGLang's own (`sglang.srt.eplb`), two copies of an expert on one server "
        "counted as SGLang runs them. *eplb-sglang* is EPLB as SGLang runs it by default: a "
        f"rebalance every {args.eplb_period} steps (`--eplb-rebalance-num-iterations`) on the "
        "load since the last one, and before the first one EPLB's placement of the trace's "
        "first half (SGLang in steady state on the first mix: it knows that half's statistics "
        "in advance); so it serves the second half on the first half's statistics, about "
        f"{args.eplb_period // 2} steps on average after a shift. *eplb* is EPLB given every "
        "window's statistics, which SGLang does not do: the strongest EPLB here. The MoEless "
        "rows are the scaler and placer, warm from the previous window's placement. "
        "*predicted* applies the layer-aware predictors "
        "(`d1.safetensors`) to each step's router inputs of the layer before (layer 0: the "
        "previous step's load): that is MoEless's premise that a replica can be ready a layer "
        "ahead; on this system a re-placement takes about a second (bench_faults --fault "
        "replace), so it is the paper's setting, not what this tier can do. Zipf traces have "
        "no router inputs: no *predicted* row.",
    ]
    return "\n".join(lines)


def result_table(traces: list[StepTrace], results: dict, measured: dict,
                 coef: tuple[float, float, float], window: int) -> str:
    c, a, b = coef
    timed = len(next(iter(measured.values())).windows)
    lines = [
        "Per trace and placement, means over windows 1.. (window 0 has no past) and MoE layers: "
        "**max/mean**, the busiest server's tokens over the mean in a window (and in the "
        "first window after the shift) and in a single step (one step's entries dealt "
        "by load over an expert's holders, as the client deals them); **measured**, the MoE "
        "layer's straggler time per decode step (the slowest server's kernel call, each the "
        f"fastest of its timed repeats) over {timed} "
        "timed windows per trace; **modelled**, the fitted model's straggler time over all "
        "windows; weight sets held per layer; replicas loaded per window (moves from the "
        "previous window's placement):",
        "",
        "| trace | placement | max/mean | after shift | per step | measured us | vs eplb-sglang "
        "| vs eplb | vs none | modelled us | vs eplb-sglang | vs eplb | weight sets / layer "
        "| loaded / window |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for t in traces:
        shift = t.shift // window
        m = {p: float(x.mean()) * 1e6 for p, x in measured[t.name].straggler.items()}
        mod = {p: float(o.modelled(c, a, b)[window:].mean()) * 1e6
               for p, o in results[t.name].items()}
        for p, o in results[t.name].items():
            weight_sets = np.mean([placed.replicas() for placed in o.placed[1:]])
            lines.append(
                f"| {t.name} | {p} | {o.ratio[1:].mean():.3f} | {o.ratio[shift].mean():.3f} | "
                f"{o.step_ratio()[window:].mean():.3f} | "
                f"{m[p]:.1f} | {_ratio(m[p], m['eplb-sglang'])} | {_ratio(m[p], m['eplb'])} | "
                f"{_ratio(m[p], m['none'])} | {mod[p]:.1f} | "
                f"{_ratio(mod[p], mod['eplb-sglang'])} | {_ratio(mod[p], mod['eplb'])} | "
                f"{weight_sets:.1f} | {o.adds[1:].mean():.1f} |")
    return "\n".join(lines)


def fit_text(samples: np.ndarray, coef: tuple[float, float, float], r2: float,
             traces: list[StepTrace], results: dict, measured: dict, window: int) -> str:
    """The fitted model, and how far it is from the measurements on the timed windows."""
    c, a, b = coef
    worst = 0.0
    for t in traces:
        m = measured[t.name]
        steps = np.array([w * window + j for w in m.windows for j in range(window)])
        for p, o in results[t.name].items():
            modelled = float(o.modelled(c, a, b)[steps].mean())
            worst = max(worst, abs(modelled / float(m.straggler[p].mean()) - 1))
    return (f"Fit of the straggler model over the {len(samples)} timed calls (one server's "
            f"share of one step's layer): time = c + a x entries + b x active weight sets, "
            f"c = {c * 1e6:.2f} us, a = {a * 1e6:.3f} us per entry, b = {b * 1e6:.3f} us per "
            f"weight set (b / a = {b / a if a else float('nan'):.1f} entries), R^2 = {r2:.2f}. "
            f"On the timed windows the modelled straggler time is within {worst:.1%} of the "
            f"measured one for every trace and placement.")


def below(outcomes: dict[str, Outcome], straggler: dict[str, np.ndarray],
          coef: tuple[float, float, float], window: int, policy: str,
          base: str) -> tuple[float, float]:
    """How much lower ``policy``'s straggler time is than ``base``'s, as a fraction of
    ``base``'s: measured (the timed windows) and modelled (every window but the first)."""
    def modelled(p: str) -> float:
        return float(outcomes[p].modelled(*coef)[window:].mean())

    return (1 - float(straggler[policy].mean()) / float(straggler[base].mean()),
            1 - modelled(policy) / modelled(base))


def goal(traces: list[StepTrace], results: dict, measured: dict,
         coef: tuple[float, float, float], window: int, ratio_max: float,
         gain_min: float) -> str:
    """The goal line and one line per trace: MoEless with the best information this trace
    allows (predicted on recorded traces, window t-1 on Zipf ones) against EPLB as SGLang runs
    it (``eplb-sglang``), and against EPLB every window; the verdict is on the measured time
    against ``eplb-sglang``, on the Zipf-skewed traces (the issue's "skewed traces")."""
    verdicts, lines = [], []
    for t in traces:
        p = "predicted" if "predicted" in results[t.name] else "moeless"
        o: Outcome = results[t.name][p]
        r = float(o.ratio[1:].mean())
        (gain, modelled), (fresh, fresh_modelled) = (
            below(results[t.name], measured[t.name].straggler, coef, window, p, base)
            for base in ("eplb-sglang", "eplb"))
        ok = r <= ratio_max and gain >= gain_min
        if t.kind == "zipf":
            verdicts.append(ok)
        lines.append(f"- {t.name}, {p}: max/mean {r:.3f} ({'<=' if r <= ratio_max else '>'} "
                     f"{ratio_max}); straggler time {gain:.1%} below eplb-sglang's measured "
                     f"({modelled:.1%} modelled), {fresh:.1%} below eplb's ({fresh_modelled:.1%} "
                     f"modelled): {'met' if ok else 'NOT met'}"
                     + ("" if t.kind == "zipf" else " (not a Zipf-skewed trace)"))
    verdict = ("no Zipf-skewed trace in this run" if not verdicts else
               "met" if all(verdicts) else "NOT met")
    head = (f"Goal (issue 12): max/mean <= {ratio_max} and >= {gain_min:.0%} lower straggler "
            f"time than EPLB (as SGLang runs it) on the skewed (Zipf) traces: {verdict}")
    return head + "\n\n" + "\n".join(lines)


def live_table(results, args, trace: StepTrace) -> str:
    """One row per placement: means over the rounds, against ``none``."""
    def mean(x):
        return float(np.mean(x))

    base = next(r for r in results if r.label == "none")
    lines = [
        f"Live, one SGLang `--eaas` server (embedded monitor, {args.servers} local expert "
        f"servers started with the even placement): the placement each policy held for the "
        f"last window of `{trace.name}`, made live with `balance.apply` (EPLB's doubles held "
        f"once: a server here holds an expert once), then {args.live_concurrency} concurrent "
        f"streaming requests ({args.live_prompt_tokens}-token openings of the second mix's "
        f"requests, as text; {args.live_output_len} tokens each, greedy, ignore_eos) for "
        f"{args.live_duration:g} s, the first 3 s left out; {args.live_rounds} rounds over the "
        "placements, every other one in reverse order (replicas loaded and apply time: in the "
        "first round, from the row above); means over the rounds (spread: (max - min) / mean "
        "of a placement's rounds); ratios against *none*:",
        "",
        "| placement | replicas loaded, first round | apply s | decode tok/s | spread | vs none "
        "| TPOT ms | vs none | failed requests |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        tok = mean(r.tok_s)
        spread = (max(r.tok_s) - min(r.tok_s)) / tok if tok else 0.0
        lines.append(f"| {r.label} | {r.moved[0]} | {r.apply_seconds[0]:.2f} | "
                     f"{tok:.1f} | {spread:.1%} | {_ratio(tok, mean(base.tok_s))} | "
                     f"{mean(r.tpot_ms):.1f} | {_ratio(mean(r.tpot_ms), mean(base.tpot_ms))} | "
                     f"{r.failed} |")
    failures = [f"{r.label}: {r.first_failure}" for r in results if r.first_failure]
    lines += ["", "The expert servers and SGLang share 2 cores here, so a busier server mostly "
              "takes CPU time from the others rather than making them wait on idle cores: "
              "per-server balance shows less end to end than it would on separate machines."]
    if failures:
        lines.append("First failures: " + "; ".join(failures))
    return "\n".join(lines)
