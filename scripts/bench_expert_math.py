"""Benchmark: an MoE layer's expert math on the expert server's CPU kernels, against SGLang's.

On the generated bench checkpoint (32 experts of hidden 1024 and intermediate 512, top-4,
bfloat16), in one run and in this process:

1. This machine's copy bandwidth: one thread copying a 256 MiB buffer with torch (GB/s of
   buffer copied), the roofline the expert math is measured against: at decode batch sizes a
   layer must read every active expert's weights once.
2. Per batch size and thread count, the same layer inputs (random top-4 routing, all experts
   held by this process, cycling through the MoE layers so the weights come from memory):
   SGLang's ``moe_forward_native`` (its CPU MoE), ``weighted_expert_sum`` with
   ``kernel="reference"`` (SGLang's op order, bit for bit) and with ``kernel="fast"`` (the C++
   grouped kernel, shrink on and off). Milliseconds per layer (medians), the fast kernel's
   speedup over ``moe_forward_native``, and its streamed-weight bandwidth: the bytes of the
   active experts' weights divided by its time, also as a fraction of the copy bandwidth.
3. Scaling with total experts: a layer of 256 experts of the same sizes with 8 of them active
   against a layer of 8 experts, all 8 active, the same rows per expert; the fast kernel with
   shrink on (and off, for the ablation); the ratio should stay near 1.

Every implementation is checked against ``moe_forward_native`` before it is timed (reference:
equal; fast: within bfloat16 rounding; shrink off: equal to shrink on).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from sgl_kernel_ext import cpu_ops
from sglang_eaas.expert_server.compute import weighted_expert_sum
from sglang_eaas.expert_server.experts import LayerExperts, load_experts
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model

from bench_lib.layer_math import Batch, Budget, LayerMath, make_batches
from bench_lib.report import ROOT, Report, default_out, say

DTYPE = torch.bfloat16  # the bench checkpoint's
COPY_BYTES = 256 * 2**20
IMPLS = ("native", "reference", "fast", "fast_no_shrink")


def copy_bandwidth(repeats: int = 7) -> float:
    """GB/s of one thread copying a COPY_BYTES buffer with torch (best of ``repeats``)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(COPY_BYTES, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return COPY_BYTES / best / 1e9


class ExpertMath:
    """The four implementations on one set of layers (all experts held here)."""

    def __init__(self, layers: dict[int, LayerExperts]):
        self.math = LayerMath(layers)  # moe_forward_native and the local rows of a batch
        self.layers = layers

    def run(self, impl: str, b: Batch) -> torch.Tensor:
        if impl == "native":
            return self.math.sglang(b)
        layer = self.layers[b.layer_id]
        kernel = "reference" if impl == "reference" else "fast"
        return weighted_expert_sum(layer, b.hidden, self.math._rows(b), b.router_weights,
                                   kernel=kernel, shrink=impl != "fast_no_shrink")

    def check(self, batches: list[Batch]) -> None:
        """Each implementation agrees with moe_forward_native before it is timed, at 1 torch
        thread (an expert server's default): ``reference`` runs SGLang's ops in its order, bit
        for bit, but with 2 threads oneDNN may split a bfloat16 product between them otherwise
        for the two (a last-bit difference in a few elements, seen on a CPU without
        AVX512-BF16), which says nothing about the op order."""
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self._check(batches)
        finally:
            torch.set_num_threads(previous)

    def _check(self, batches: list[Batch]) -> None:
        for b in batches:
            native = self.run("native", b)
            if not torch.equal(self.run("reference", b), native):
                raise RuntimeError(f"kernel=reference differs from moe_forward_native on layer "
                                   f"{b.layer_id} (it should be bit for bit)")
            fast = self.run("fast", b)
            scale = float(native.float().abs().max())
            diff = float((fast.float() - native.float()).abs().max())
            if diff > 2**-6 * scale:
                raise RuntimeError(f"kernel=fast differs from moe_forward_native on layer "
                                   f"{b.layer_id} by {diff:.3g} (scale {scale:.3g})")
            if not torch.equal(self.run("fast_no_shrink", b), fast):
                raise RuntimeError("kernel=fast gives other results with shrink disabled")

    def time(self, impl: str, batches: list[Batch], threads: int, budget: Budget) -> float:
        """Median milliseconds per layer call."""
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            times = budget.calls(lambda b: self.run(impl, b), batches)
        finally:
            torch.set_num_threads(previous)
        return statistics.median(times) * 1e3


def active_bytes(layers: dict[int, LayerExperts], batches: list[Batch]) -> float:
    """Mean bytes of the active experts' weights per batch (what a layer call must read)."""
    per_expert = {lid: (le.w13[0].nbytes + le.w2[0].nbytes) for lid, le in layers.items()}
    return statistics.mean(per_expert[b.layer_id] * int(b.expert_ids.unique().numel())
                           for b in batches)


def random_layer(experts: int, hidden: int, inter: int, seed: int) -> LayerExperts:
    """``experts`` random experts (bfloat16), generated a few at a time to bound memory."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.empty(experts, 2 * inter, hidden, dtype=DTYPE)
    w2 = torch.empty(experts, hidden, inter, dtype=DTYPE)
    for e in range(experts):
        w13[e] = torch.randn(2 * inter, hidden, generator=g) / hidden**0.5
        w2[e] = torch.randn(hidden, inter, generator=g) / inter**0.5
    return LayerExperts(w13, w2, torch.arange(experts))


def scaling(hidden: int, inter: int, tokens: int, top_k: int, budget: Budget,
            threads: int) -> dict[str, float]:
    """Fast kernel ms per layer: 8 experts (4 layers, cycled) against 256 experts with 8 active
    (a random 8 per call); the same per-expert rows (``tokens`` tokens, top-``top_k`` of 8)."""
    small = [random_layer(8, hidden, inter, seed=i) for i in range(4)]
    big = random_layer(256, hidden, inter, seed=10)
    g = torch.Generator().manual_seed(5)
    calls = []
    for i in range(16):
        ids = torch.stack([torch.randperm(8, generator=g)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=g)
        hidden_states = torch.randn(tokens, hidden, generator=g).to(DTYPE)
        chosen = torch.randperm(256, generator=g)[:8]
        calls.append((i % 4, hidden_states, ids, chosen[ids], weights))

    def run_small(c, shrink=True):
        layer, x, ids, _, w = c
        return weighted_expert_sum(small[layer], x, ids.reshape(-1), w, shrink=shrink)

    def run_big(c, shrink=True):
        _, x, _, ids, w = c
        return weighted_expert_sum(big, x, ids.reshape(-1), w, shrink=shrink)

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        for name, fn in (("8 experts", run_small), ("256 experts, 8 active", run_big),
                         ("256 experts, 8 active, shrink off",
                          lambda c: run_big(c, shrink=False))):
            times = budget.calls(fn, calls)
            out[name] = statistics.median(times) * 1e3
    finally:
        torch.set_num_threads(previous)
    # The same inputs through the same experts' weights must give the same answer either way.
    c = calls[0]
    same = LayerExperts(big.w13[c[3].unique()], big.w2[c[3].unique()], torch.arange(8))
    if not torch.equal(weighted_expert_sum(same, c[1], torch.searchsorted(
            c[3].unique(), c[3]).reshape(-1), c[4]), run_big(c)):
        raise RuntimeError("the 256-expert layer's answer differs from its 8 experts' alone")
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The default run takes about 2-3 minutes on 2 CPU cores. Other load on the "
        "machine skews every number (its load average is in the header).")
    parser.add_argument("--batch-sizes", default="1,8,32,64",
                        help="comma-separated tokens per layer call; default %(default)s")
    parser.add_argument("--threads", default="1,2",
                        help="comma-separated torch thread counts; default %(default)s")
    parser.add_argument("--iterations", type=int, default=100,
                        help="timed layer calls per point (cycling through the MoE layers); "
                        "default %(default)s")
    parser.add_argument("--warmup", type=int, default=4,
                        help="untimed layer calls before each point; default %(default)s")
    parser.add_argument("--point-seconds", type=float, default=3.0,
                        help="stop timing a point after this many seconds (with at least "
                        f"{Budget.MIN_CALLS} calls); default %(default)s")
    parser.add_argument("--out", type=Path, default=default_out("expert-math"),
                        help="markdown file receiving the report; default %(default)s")
    args = parser.parse_args()
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error("--batch-sizes and --threads must be comma-separated lists of integers")
    if min(args.batch_sizes) < 1 or min(args.threads) < 1 or args.iterations < 1:
        parser.error("--batch-sizes, --threads and --iterations must be >= 1")
    if args.warmup < 0 or args.point_seconds <= 0:
        parser.error("--warmup must be >= 0 and --point-seconds > 0")
    return args


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    say("building/loading the CPU expert kernel")
    try:
        cpu_ops.build()
    except cpu_ops.KernelUnavailable as exc:
        print(f"bench_expert_math: error: {exc}", file=sys.stderr)
        return 1
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say(m))
    info = MoeModelInfo.from_model_path(model)
    say(f"loading the experts of {model.name}")
    layers = load_experts(model, info, list(range(info.num_experts)), DTYPE)
    math = ExpertMath(layers)
    budget = Budget(args.warmup, args.iterations, args.point_seconds)
    copy = copy_bandwidth()
    say(f"copy bandwidth (1 thread): {copy:.1f} GB/s")
    rows = []
    for batch in args.batch_sizes:
        batches = make_batches(info, batch, DTYPE, 4 * len(info.moe_layers), seed=batch)
        math.check(batches)
        weight_bytes = active_bytes(layers, batches)
        for threads in args.threads:
            ms = {impl: math.time(impl, batches, threads, budget) for impl in IMPLS}
            rows.append((batch, threads, weight_bytes, ms))
            say(f"batch {batch}, {threads} thread(s): " + ", ".join(
                f"{impl} {t:.2f} ms" for impl, t in ms.items()))
    header = ["batch", "threads", "moe_forward_native ms", "reference ms", "fast ms",
              "fast, shrink off ms", "fast speedup vs native", "active weights MiB",
              "fast streamed GB/s", "of copy bandwidth"]
    lines = ["| " + " | ".join(header) + " |", "|---:" * len(header) + "|"]
    for batch, threads, weight_bytes, ms in rows:
        streamed = weight_bytes / (ms["fast"] / 1e3) / 1e9
        lines.append(
            f"| {batch} | {threads} | {ms['native']:.2f} | {ms['reference']:.2f} | "
            f"{ms['fast']:.2f} | {ms['fast_no_shrink']:.2f} | "
            f"{ms['native'] / ms['fast']:.2f}x | {weight_bytes / 2**20:.1f} | {streamed:.1f} | "
            f"{streamed / copy:.0%} |")
    report.add(
        f"Expert math per MoE layer on {model.name} ({info.num_experts} experts, hidden "
        f"{info.hidden_size}, top-{info.top_k}, bfloat16), all experts in this process, "
        f"{cpu_ops.isa()} kernel path; medians over up to {args.iterations} calls per point "
        f"(cycling through the {len(info.moe_layers)} MoE layers; a point stops after "
        f"{args.point_seconds:g} s). Copy bandwidth of one thread (torch, 256 MiB): "
        f"{copy:.1f} GB/s. streamed = the active experts' weight bytes / the fast kernel's "
        "time.\n\n" + "\n".join(lines))
    say("scaling: 8 experts against 256 experts with 8 active")
    scale_rows = []
    for threads in args.threads:
        result = scaling(info.hidden_size, info.moe_intermediate_size, 8, info.top_k, budget,
                         threads)
        scale_rows.append((threads, result))
        say(f"scaling, {threads} thread(s): {result}")
    lines = ["| threads | 8 experts ms | 256 experts, 8 active ms | ratio | 256 experts, 8 "
             "active, shrink off ms | ratio |", "|---:" * 6 + "|"]
    for threads, r in scale_rows:
        small, big, off = r.values()
        lines.append(f"| {threads} | {small:.2f} | {big:.2f} | {big / small:.2f}x | {off:.2f} | "
                     f"{off / small:.2f}x |")
    report.add("Scaling with total experts, fast kernel: 8 tokens, top-4 among 8 experts, in a "
               "layer of 8 experts (4 such layers, cycled) and in one of 256 (a random 8 active "
               "per call); same per-expert sizes.\n\n" + "\n".join(lines))
    report.add(verdict(rows, scale_rows, copy))
    report.save()
    return 0


def verdict(rows, scale_rows, copy: float) -> str:
    """The issue's targets, met or not, from the numbers above."""
    lines = ["Targets (issue 11):"]
    for batch, threads, weight_bytes, ms in rows:
        if batch in (8, 64):
            speedup = ms["native"] / ms["fast"]
            lines.append(f"- batch {batch}, {threads} thread(s): fast >= 2x moe_forward_native: "
                         f"{speedup:.2f}x, {'met' if speedup >= 2 else 'not met'}")
        if batch <= 8:
            share = weight_bytes / (ms["fast"] / 1e3) / 1e9 / copy
            lines.append(f"- batch {batch}, {threads} thread(s): fast streams >= 50% of the copy "
                         f"bandwidth: {share:.0%}, {'met' if share >= 0.5 else 'not met'}")
    for threads, r in scale_rows:
        small, big, _ = r.values()
        lines.append(f"- {threads} thread(s): 256 experts with 8 active <= 1.2x 8 experts: "
                     f"{big / small:.2f}x, {'met' if big / small <= 1.2 else 'not met'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
