"""Benchmark: where one MoE layer's time goes with --eaas, against SGLang's own CPU MoE.

On the generated bench checkpoint, in one run:

1. Round trip. One client (``EaasClient``, what each of SGLang's MoE layers calls under --eaas)
   and N local expert servers over shm (as --eaas-expert-servers local:N starts them: even
   placement, 1 torch thread each), layer after layer with nothing in between: per layer round
   trip (``EaasClient.forward``), split into send (``ClientSlot.send``: copies into the slots
   and the doorbell), wait (``ClientSlot.wait``: the servers' wake-up, compute and answer),
   read (``ClientSlot.result``) and the rest (the client's routing and combine).
2. Expert math, in this process: ``weighted_expert_sum`` (expert_server/compute.py, what a
   server computes) on the loaded experts, for one server's share (the other entries -1) and
   for all experts, at 1 and 2 torch threads; against SGLang's ``moe_forward_native`` on the
   same weights and entries (where some entries are not held, once per top-k slot, as the CPU
   runtime runs an EP rank). Both are checked to agree before they are timed.

Every number is a median over the layers and iterations; the routing is random top-k.
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from sglang_eaas import envs
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.expert_server.experts import load_experts
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import even_placement
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model

from bench_lib.layer_math import Batch, Budget, LayerMath, MathTiming, make_batches
from bench_lib.report import ROOT, Report, default_out, say

PHASES = ("send", "wait", "read")
DTYPE = torch.bfloat16  # the bench checkpoint's



class PhaseClock:
    """Adds up the time spent in each ``ClientSlot`` phase of the client's slots."""

    def __init__(self, client: EaasClient):
        self.spent: collections.Counter[str] = collections.Counter()
        for conn in client.connections:
            for phase, method in zip(PHASES, ("send", "wait", "result")):
                setattr(conn.slot, method, self._timed(phase, getattr(conn.slot, method)))

    def _timed(self, phase: str, method: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.spent[phase] += time.perf_counter() - start

        return timed


def round_trips(client: EaasClient, clock: PhaseClock, batches: list[Batch],
                budget: Budget) -> dict[str, float]:
    """Median microseconds per layer call of each phase, the rest and the whole round trip;
    ``calls``: how many layer calls the medians are over."""
    samples: dict[str, list[float]] = collections.defaultdict(list)

    def call(b: Batch) -> None:
        clock.spent.clear()
        client.forward(b.layer_id, b.hidden, b.expert_ids, b.router_weights)
        for phase in PHASES:
            samples[phase].append(clock.spent[phase])

    totals = budget.calls(call, batches)
    samples = {name: values[budget.warmup:] for name, values in samples.items()}
    samples["rest"] = [t - sum(p) for t, *p in zip(totals, *(samples[n] for n in PHASES))]
    samples["total"] = totals
    medians = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
    return {**medians, "calls": len(totals)}


def check_round_trip(client: EaasClient, math: LayerMath, batches: list[Batch]) -> None:
    """The servers' answer is the layer's MoE output (SGLang's, to bfloat16 rounding)."""
    for b in batches:
        got = client.forward(b.layer_id, b.hidden, b.expert_ids, b.router_weights).float()
        want = math.sglang(b).float()
        if not torch.allclose(got, want, rtol=2**-6, atol=want.abs().max() * 2**-7):
            raise RuntimeError(f"the expert servers' answer for layer {b.layer_id} differs from "
                               f"moe_forward_native by {(got - want).abs().max():.3g}")


def round_trip_table(trips: dict[int, dict[str, float]], share: dict[int, MathTiming],
                     sglang: dict[int, dict[int, MathTiming]]) -> str:
    """Per batch: the phases and the whole round trip, then what it adds to one server's math
    and how it compares with SGLang computing the layer itself at 1 and 2 threads."""
    header = ["batch", "calls", "send us", "wait us", "read us", "rest us", "round trip us",
              "one server's math us", "round trip - math us", "round trip / SGLang 1 thread",
              "round trip / SGLang 2 threads"]
    lines = ["| " + " | ".join(header) + " |", "|---:" * len(header) + "|"]
    for batch, t in trips.items():
        math = share[batch].eaas_us
        cells = [str(batch), str(t["calls"])]
        cells += [f"{t[n]:.1f}" for n in (*PHASES, "rest", "total")]
        cells += [f"{math:.1f}", f"{t['total'] - math:.1f}"]
        cells += [f"{t['total'] / sglang[threads][batch].sglang_us:.2f}x" for threads in (1, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def math_table(timings: list[MathTiming]) -> str:
    """One row per (experts, threads, tokens): both implementations and their ratio."""
    lines = ["| experts | threads | tokens | weighted_expert_sum us | calls "
             "| moe_forward_native us | calls | ratio |", "|---:" * 8 + "|"]
    for t in timings:
        lines.append(f"| {t.experts} | {t.threads} | {t.tokens} | {t.eaas_us:.1f} | "
                     f"{t.eaas_calls} | {t.sglang_us:.1f} | {t.sglang_calls} | "
                     f"{t.eaas_us / t.sglang_us:.2f}x |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The default run takes 1-3 minutes on 2 CPU cores (at most 10 s per point). "
        "Other load on the machine skews every number.")
    parser.add_argument("--servers", type=int, default=2,
                        help="local expert servers (even placement); default %(default)s")
    parser.add_argument("--batch-sizes", default="1,8",
                        help="comma-separated tokens per layer call; default %(default)s")
    parser.add_argument("--iterations", type=int, default=200,
                        help="timed layer calls per point (cycling through the MoE layers); "
                        "default %(default)s")
    parser.add_argument("--warmup", type=int, default=8,
                        help="untimed layer calls before each point; default %(default)s")
    parser.add_argument("--point-seconds", type=float, default=10.0,
                        help="stop timing a point after this many seconds (with at least "
                        f"{Budget.MIN_CALLS} calls), so a loaded machine cannot stretch the run; "
                        "default %(default)s")
    parser.add_argument("--out", type=Path, default=default_out("layer"),
                        help="markdown file receiving the report; default %(default)s")
    args = parser.parse_args()
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes {args.batch_sizes!r} is not a comma-separated list of "
                     "integers")
    if args.servers < 1 or min(args.batch_sizes) < 1 or args.iterations < 1:
        parser.error("--servers, --batch-sizes and --iterations must be >= 1")
    if args.warmup < 0 or args.point_seconds <= 0:
        parser.error("--warmup must be >= 0 and --point-seconds > 0")
    return args


def measure_round_trips(model: Path, info: MoeModelInfo, placements: list[list[int]],
                        batches: dict[int, list[Batch]], whole: LayerMath,
                        budget: Budget) -> dict[int, dict[str, float]]:
    """Start the expert servers, join them with one client at 1 torch thread, check its answer
    against ``whole`` and time its round trips per batch size; stop the servers."""
    os.environ.setdefault(envs.TOKEN.name, secrets.token_hex(16))
    log_path = ROOT / ".cache" / "logs" / "bench-layer-servers.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    say(f"starting {len(placements)} expert servers (log: {log_path})")
    trips = {}
    torch.set_num_threads(1)
    with open(log_path, "w") as log:
        servers = start_local_servers(model, placements, "bfloat16", max_clients=1,
                                      extra_args=("--transport", "shm"), stdout=log)
        try:
            client = EaasClient([s.address for s in servers], info,
                                ModelIdentity.of(model, info), DTYPE, "bench_layer",
                                transport="shm")
            try:
                clock = PhaseClock(client)
                for batch, inputs in batches.items():
                    check_round_trip(client, whole, inputs)
                    trips[batch] = round_trips(client, clock, inputs, budget)
                    say(f"batch {batch}: round trip {trips[batch]['total']:.1f} us")
            finally:
                client.close()
        finally:
            for server in servers:
                server.stop()
    return trips


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say(m))
    info = MoeModelInfo.from_model_path(model)
    if args.servers > info.num_experts:
        print(f"bench_layer: error: --servers {args.servers} exceeds the model's "
              f"{info.num_experts} experts", file=sys.stderr)
        return 1
    placements = even_placement(info.num_experts, args.servers)
    batches = {b: make_batches(info, b, DTYPE, 4 * len(info.moe_layers), seed=b)
               for b in args.batch_sizes}
    say(f"loading experts of {model.name}")
    share = LayerMath(load_experts(model, info, placements[0], DTYPE))
    whole = LayerMath(load_experts(model, info, list(range(info.num_experts)), DTYPE))
    budget = Budget(args.warmup, args.iterations, args.point_seconds)
    trips = measure_round_trips(model, info, placements, batches, whole, budget)
    timings: dict[tuple[str, int, int], MathTiming] = {}
    for name, math in (("share", share), ("whole", whole)):
        for threads in (1, 2):
            for batch, inputs in batches.items():
                math.check(inputs)
                timings[name, threads, batch] = math.time(inputs, threads, budget)
                say(f"expert math: {math.num_experts} experts, {threads} thread(s), "
                    f"{batch} token(s) done")
    medians = (f"medians in microseconds over the calls counted (up to {args.iterations} per "
               f"point, cycling through the {len(info.moe_layers)} MoE layers; a point stops "
               f"after {args.point_seconds:g} s)")
    report.add(
        f"Round trip per MoE layer (EaasClient.forward): one client at 1 torch thread, "
        f"{args.servers} expert servers over shm ({len(placements[0])} experts and 1 thread "
        f"each); {medians}. rest = round trip - send - wait - read (routing, combine); one "
        f"server's math = weighted_expert_sum of server 0's share at 1 thread; SGLang = "
        f"moe_forward_native of all {info.num_experts} experts (both from the next table):\n\n"
        + round_trip_table(trips, {b: timings["share", 1, b] for b in batches},
                           {n: {b: timings["whole", n, b] for b in batches} for n in (1, 2)}))
    report.add(f"Expert math per MoE layer in this process, {medians}; ratio = "
               "weighted_expert_sum / moe_forward_native on the same weights and entries:\n\n"
               + math_table(list(timings.values())))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
