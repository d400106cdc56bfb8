"""bench_esft's report: checkpoint sizes, the tables (serving, memory, rerouting), the goal line
and the chart."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench_lib.esft_live import BASE, Live, Measured
from bench_lib.esft_timing import RerouteTiming
from bench_lib.report import pyplot, save_figure

MIB = 2 ** 20
EXPERTS = "expert servers"  # esft_probes.ROLES' name for them
GOAL_THROUGHPUT, GOAL_SHARE = 0.9, 0.01


@dataclass(frozen=True)
class Checkpoint:
    """Tensor bytes of the checkpoint's safetensors files (their headers' data offsets; the
    headers themselves, a few KB, not counted): routed experts' and everything else's."""

    expert_bytes: int  # all routed experts (``.mlp.experts.`` tensors)
    other_bytes: int  # attention, norms, routers, embeddings, LM head
    per_expert: int  # one routed expert's gate, up and down

    @property
    def total(self) -> int:
        return self.expert_bytes + self.other_bytes


def checkpoint_sizes(model: Path, routed_experts: int) -> Checkpoint:
    expert = other = 0
    for path in sorted(model.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            size = t["data_offsets"][1] - t["data_offsets"][0]
            if ".mlp.experts." in name:
                expert += size
            else:
                other += size
    return Checkpoint(expert, other, expert // routed_experts)


def _mean(x: list[float]) -> float:
    return float(np.mean(x)) if x else float("nan")


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}x" if base > 0 else "-"


def _pooled(runs) -> Measured:
    out = Measured(BASE)
    for r in runs:
        out.tok_s += r.tok_s
        out.tpot_ms += r.tpot_ms
        out.ttft_ms += r.ttft_ms
        out.kernel_us += r.kernel_us
        for role, values in r.cpu_ms.items():
            out.cpu_ms.setdefault(role, []).extend(values)
        out.requests += r.requests
        out.failed += r.failed
        out.first_failure = out.first_failure or r.first_failure
    return out


def _spread(x: list[float]) -> str:
    return f"{(max(x) - min(x)) / _mean(x):.1%}"


def throughput_ratio(live: Live, label: str) -> float:
    """The ESFT runs' mean decode tok/s over their paired base-only runs' mean."""
    return _mean(live.runs[label].tok_s) / _mean(live.base[label].tok_s)


def serving_table(live: Live, args, info, adapters) -> str:
    trained = sum(a.domain != "stdlib" for a in adapters)
    base_all = _pooled(live.base.values())
    lines = [
        f"Serving: `{args.model.name}` in bfloat16 (the checkpoint's dtype, as bench_balance "
        f"serves it; {len(info.moe_layers)} MoE layers, {info.num_experts} experts, "
        f"top-{info.top_k}). Two SGLang servers, each with {args.servers} local expert servers "
        f"(even placement), an embedded monitor and "
        f"{'the radix cache' if args.radix_cache else 'no radix cache (`--disable-radix-cache`)'}"
        f": *base-only* `--eaas`, and `--eaas --eaas-esft` with adapters loaded at runtime "
        "(`POST /load_lora_adapter`). Both stay up; only one serves load at a time. Load: "
        f"{args.concurrency} concurrent streaming requests ({args.prompt_tokens}-token prompts "
        f"as token ids; {args.output_len} tokens each, greedy, ignore_eos) for "
        f"{args.duration:g} s per run, the first 3 s left out (tokens arriving, requests "
        f"sent, TPOT of requests started then), after {args.warmup:g} s of warm-up per "
        "server. For each adapter count N, once the ESFT server has N loaded: "
        f"{args.rounds} pairs of runs, base-only then ESFT back to back (ESFT first in odd "
        "pairs); with N adapters every request names one of them round-robin (1/N of the "
        f"requests each; N = 0: no adapter). Adapters in load order: the {trained} trained ones "
        f"({', '.join(a.name for a in adapters if a.domain != 'stdlib')}), each with openings "
        "of held-out files of its domain, then random ones (`tools.esft random`, seeds 0.., "
        "2 or 3 experts per MoE layer), each with pieces of held-out stdlib sources; the "
        "base-only and N = 0 runs send all those prompts without an adapter. Means over the "
        "runs; spread: (max - min) / mean of the runs; ratios: against the base-only runs "
        "paired with the row's (per pair: min - max); the first row pools every base-only run. "
        "**kernel us**: the expert servers' kernel time per layer call (one server, one MoE "
        "layer of one step: their `expert_load` nanoseconds over their `batches`, read before "
        "and after each run):",
        "",
        "| serving | decode tok/s | spread | vs base-only | per pair | TPOT ms | vs base-only "
        "| TTFT ms | spread | vs base-only | kernel us | vs base-only | requests | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| base-only, all {len(base_all.tok_s)} runs | {_mean(base_all.tok_s):.1f} | "
        f"{_spread(base_all.tok_s)} | - | - | {_mean(base_all.tpot_ms):.1f} | - | "
        f"{_mean(base_all.ttft_ms):.1f} | {_spread(base_all.ttft_ms)} | - | "
        f"{_mean(base_all.kernel_us):.1f} | - | {base_all.requests} | {base_all.failed} |",
    ]
    for label, r in live.runs.items():
        b = live.base[label]
        pairs = [x / y for x, y in zip(r.tok_s, b.tok_s)]
        lines.append(
            f"| ESFT, {label} adapter{'s' * (label != '1')} | {_mean(r.tok_s):.1f} | "
            f"{_spread(r.tok_s)} | {_ratio(_mean(r.tok_s), _mean(b.tok_s))} | "
            f"{min(pairs):.2f}-{max(pairs):.2f} | {_mean(r.tpot_ms):.1f} | "
            f"{_ratio(_mean(r.tpot_ms), _mean(b.tpot_ms))} | {_mean(r.ttft_ms):.1f} | "
            f"{_spread(r.ttft_ms)} | {_ratio(_mean(r.ttft_ms), _mean(b.ttft_ms))} | "
            f"{_mean(r.kernel_us):.1f} | {_ratio(_mean(r.kernel_us), _mean(b.kernel_us))} | "
            f"{r.requests} | {r.failed} |")
    if live.load_seconds:
        lines += ["", f"Adapter loads: {len(live.load_seconds)}, "
                  f"{_mean(live.load_seconds):.2f} s each on average (max "
                  f"{max(live.load_seconds):.2f} s), while no request ran. Check that adapter "
                  "requests use their adapters (greedy, 16 tokens, each adapter's first prompt "
                  f"against the base model's): {live.changed_outputs[0]} of "
                  f"{live.changed_outputs[2]} adapters change the tokens' logprobs, "
                  f"{live.changed_outputs[1]} the tokens."]
    failures = [f"{r.label}: {r.first_failure}" for r in [base_all, *live.runs.values()]
                if r.first_failure]
    if failures:
        lines.append("First failures: " + "; ".join(failures))
    return "\n".join(lines)


def cpu_table(live: Live) -> str:
    """CPU time per 1000 generated tokens, by process, for each row of the serving table."""
    roles = list(next(iter(live.runs.values())).cpu_ms)

    def total(r: Measured) -> float:
        return sum(_mean(r.cpu_ms[role]) for role in roles)

    base_all = _pooled(live.base.values())
    lines = [
        "Where the CPU goes: user + system CPU time per 1000 generated tokens (ms), per "
        "process of the serving deployment (`/proc/PID/stat` before and after each run, all "
        "tokens of the run) and of this load generator; means over the runs. The 2 cores are "
        "busy throughout a run, so the total (about 2 CPU-seconds per second of run) mirrors "
        "throughput; the split shows where the time goes. Last column: the expert servers' CPU "
        "time per token against the paired base-only runs':",
        "",
        "| serving | " + " | ".join(roles) + " | total | expert servers vs base-only |",
        "|---|" + "---:|" * (len(roles) + 2),
        "| base-only, all runs | " + " | ".join(
            f"{_mean(base_all.cpu_ms[role]):.0f}" for role in roles)
        + f" | {total(base_all):.0f} | - |",
    ]
    for label, r in live.runs.items():
        experts = _ratio(_mean(r.cpu_ms[EXPERTS]), _mean(live.base[label].cpu_ms[EXPERTS]))
        lines.append(f"| ESFT, {label} adapter{'s' * (label != '1')} | " + " | ".join(
            f"{_mean(r.cpu_ms[role]):.0f}" for role in roles)
            + f" | {total(r):.0f} | {experts} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class MemoryRow:
    count: int
    adapter_experts: int
    measured: int  # expert servers' weight bytes
    ours: int  # + the attention side's non-expert weights, once
    merged: int
    weave: int
    weave_max: int


def memory_rows(live: Live, ckpt: Checkpoint, counts: list[int], adapters,
                info) -> list[MemoryRow]:
    from sglang_eaas.esft.adapter import load_adapter

    loaded = [load_adapter(a.path, info) for a in adapters]
    rows = []
    for n in counts:
        m = max((a.per_layer_max for a in loaded[:n]), default=0)
        rows.append(MemoryRow(
            n, sum(a.count for a in loaded[:n]), live.weight_bytes[str(n)],
            live.weight_bytes[str(n)] + ckpt.other_bytes, (1 + n) * ckpt.total,
            ckpt.total + n * len(info.moe_layers) * m * ckpt.per_expert, m))
    return rows


def memory_table(rows: list[MemoryRow], live: Live, ckpt: Checkpoint, info) -> str:
    base = live.weight_bytes[BASE]
    lines = [
        "Memory: weights only (no KV cache, activations or process overhead), MiB. "
        f"**expert servers**: the sum of every expert server's `weight_bytes` (its `stats` "
        f"reply), read after each count's loads (base-only server: {base} bytes; "
        f"the checkpoint's routed experts: {ckpt.expert_bytes} bytes, "
        f"{ckpt.per_expert} per expert). **ours**: that plus the checkpoint's non-expert "
        f"tensors ({ckpt.other_bytes} bytes: attention, norms, routers, embeddings, LM head; "
        "SGLang `--eaas` holds those once and no routed expert). **merged**: serving the base "
        "model and each adapter as its own merged checkpoint (`tools.esft merge`): (1 + N) x "
        f"the checkpoint's tensor bytes ({ckpt.total}; files' headers not counted). "
        "**ExpertWeave**: the base model plus each adapter padded to the largest per-layer "
        f"count M among the loaded adapters: N x {len(info.moe_layers)} MoE layers x M "
        "experts; ratios against ours:",
        "",
        "| adapters N | adapter experts | expert servers | of which adapters | ours | merged "
        "| vs ours | ExpertWeave (M) | vs ours |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.count} | {r.adapter_experts} | {r.measured / MIB:.2f} | "
            f"{(r.measured - base) / MIB:.2f} | {r.ours / MIB:.2f} | {r.merged / MIB:.2f} | "
            f"{_ratio(r.merged, r.ours)} | {r.weave / MIB:.2f} ({r.weave_max}) | "
            f"{_ratio(r.weave, r.ours)} |")
    exact = all(r.measured - base == r.adapter_experts * ckpt.per_expert for r in rows)
    lines += ["", "The expert servers' bytes grow by exactly the adapter experts held x "
              f"{ckpt.per_expert} bytes: {'yes' if exact else 'NO'}"
              + ("" if base == ckpt.expert_bytes else
                 f"; base-only holds {base} bytes, not the checkpoint's {ckpt.expert_bytes}")
              + "."]
    return "\n".join(lines)


def reroute_table(t: RerouteTiming, args, info, tpot_ms: float, label: str) -> str:
    layers = len(info.moe_layers)
    whole = t.prepare_us + layers * t.call_us
    rows = [("the op (`esft_reroute.reroute`)", t.op_us, layers, layers * t.op_us),
            ("`AdapterRouting.reroute` (slicing + op)", t.call_us, layers, layers * t.call_us),
            ("`EsftManager.prepare_lora_batch`", t.prepare_us, 1, t.prepare_us),
            ("all of it per step (prepare + calls)", float("nan"), 1, whole)]
    lines = [
        f"Rerouting's share of a decode step: each piece timed in this process (median of 15 "
        f"blocks of 2000 calls; {t.implementation}) at the run's decode batch ({args.concurrency}"
        f" requests, one token each, top-{info.top_k}, {info.num_experts} experts, "
        f"{label} adapters' rows, 3 experts per layer each), times its calls per step "
        f"({layers} MoE layers), over the measured TPOT of the {label}-adapter run "
        f"({tpot_ms:.1f} ms): a product of two measurements, not a profile of the server.",
        "",
        "| what | us per call | calls per step | us per step | share of step time |",
        "|---|---:|---:|---:|---:|",
    ]
    for what, per_call, calls, per_step in rows:
        cell = "-" if np.isnan(per_call) else f"{per_call:.2f}"
        lines.append(f"| {what} | {cell} | {calls} | {per_step:.1f} | "
                     f"{per_step / (tpot_ms * 1e3):.3%} |")
    return "\n".join(lines)


def goal(live: Live, t: RerouteTiming, info, label: str) -> tuple[str, bool]:
    ratio = throughput_ratio(live, label)
    tpot_us = _mean(live.runs[label].tpot_ms) * 1e3
    share = len(info.moe_layers) * t.op_us / tpot_us
    whole = (t.prepare_us + len(info.moe_layers) * t.call_us) / tpot_us
    ok = ratio >= GOAL_THROUGHPUT and share < GOAL_SHARE
    return (f"Goal (issue 13): {label} adapters >= {GOAL_THROUGHPUT}x base-only decode "
            f"throughput; rerouting < {GOAL_SHARE:.0%} of step time: "
            f"{'met' if ok else 'NOT met'} ({ratio:.2f}x; the op {share:.3%} of the "
            f"{label}-adapter TPOT, everything ESFT adds per step in the client "
            f"{whole:.3%})"), ok


def plot(path: Path, live: Live, rows: list[MemoryRow]) -> None:
    plt = pyplot()
    if plt is None:
        return
    counts = [r.count for r in rows]
    xs = range(len(counts))  # evenly spaced, labelled with the counts
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.9), dpi=110)
    for i, (attr, name) in enumerate((("tok_s", "decode tok/s"), ("ttft_ms", "TTFT"),
                                      ("tpot_ms", "TPOT"),
                                      ("kernel_us", "expert kernel per layer call"))):
        runs = [(getattr(live.runs[str(n)], attr), getattr(live.base[str(n)], attr))
                for n in counts]
        per_round = np.array([[x / y for x, y in zip(r, b)] for r, b in runs])
        means = [_mean(r) / _mean(b) for r, b in runs]
        left.plot(xs, means, marker="o", color=f"C{i}", label=f"{name} / base-only")
        for j in range(per_round.shape[1]):
            left.scatter(xs, per_round[:, j], color=f"C{i}", s=10, alpha=0.4)
    left.axhline(1.0, color="grey", linewidth=1)
    left.axhline(GOAL_THROUGHPUT, color="grey", linestyle="--", linewidth=1,
                 label=f"goal: throughput >= {GOAL_THROUGHPUT}x")
    left.set_xlabel("ESFT adapters loaded (requests spread over them)")
    left.set_ylabel("ratio to paired base-only runs (dots: pairs)")
    left.set_title("serving vs base-only --eaas")
    left.legend(fontsize=7)
    for values, name, style in (([r.ours for r in rows], "ours (expert servers + rest)", "-"),
                                ([r.merged for r in rows], "merged checkpoints", "--"),
                                ([r.weave for r in rows], "ExpertWeave padding", ":")):
        right.plot(xs, [v / MIB for v in values], marker="o", linestyle=style, label=name)
    for ax in (left, right):
        ax.set_xticks(list(xs), [str(n) for n in counts])
    right.set_yscale("log")
    right.set_yticks([20, 50, 100, 200, 400], ["20", "50", "100", "200", "400"])
    right.minorticks_off()
    right.set_xlabel("ESFT adapters loaded")
    right.set_ylabel("weights, MiB (log scale)")
    right.set_title("weight memory vs adapters")
    right.legend(fontsize=7)
    save_figure(fig, path)
