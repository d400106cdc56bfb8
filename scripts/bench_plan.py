"""Benchmark (a projection by the simulator, not a measurement): the tier's own policies at
64 to 512 devices of the H100 profile, on a compressed diurnal day with and without failures
(docs/planning.md, "The tier's policies in the loop"; issue 38 item 3).

The model is Qwen3-235B-A22B (``examples/plan/``, config only), its per-expert load a Zipf law
(s = 0.8, the hot experts different in each layer); 2 of its 94 MoE layers simulated, each
standing for half of them (the balancer's looks cost seconds per layer at 256 servers). At G
devices: G/2 attention instances of one device and G/2 expert servers (EP, two-batch overlap,
G/4 more copies of the experts with the most load per copy: ``plan/tier.py``'s
``hot_placement``), G/64 warm standby servers (at least 1).
Traffic: Poisson arrivals whose rate follows a day compressed into ``--day`` seconds, starting
at its trough (rate x (1 - 0.6 cos(2 pi t / day)), peak ``--peak`` requests/s per device),
prompts and outputs lognormal (mean 256 and 256 tokens). SLO: TTFT <= 1 s and TPOT <= 100 ms.

Traces: ``diurnal`` (no failure); ``one GPU`` (an expert server lost at 0.4 day, when the load
rises); ``one node`` (every expert server of a node lost then); ``monitor outage`` (the monitor
out from 0.3 to 0.55 day: no change of holdings, serving goes on). Modes, each from the same
start (G/2 servers):

* **fixed**: nothing changes but what failures do (a lost server's place taken by a standby
  after 30 s, by a new device after 120 s);
* **elastic**: ``elastic/autoscaler.py``'s ``Autoscaler`` (window 10 s, patience 2, cooldown
  20 s, between G/8 and G/2 servers; one server per decision, as in the live tier) and
  ``balance/policy.py``'s ``BalancePolicy`` (reactive, a look every 120 s, a budget of 1024
  copies: one look plans every layer afresh, about 4 s of this CPU at 256 servers);
* **elastic+switching**: and ``elastic/layout_policy.py``'s ``LayoutChooser`` (its defaults,
  a window every 10 s, the cost model's constants from the profile).

Per run: SLO attainment (requests within both targets over all requests; failed ones count as
missed), device-hours over the day (every device paid: attention, active, standby and joining
servers; the same window for every mode; when the last request was done is given too),
failed requests (those waiting 60 s for an expert without a holder), the decisions taken.
The published anchors (DeepEP's low-latency dispatch and combine times; DeepSeek-V3's wide-EP
decode on H800, as DeepSeek and RTP-LLM published it) are printed after.

    python scripts/bench_plan.py [--scales 64,128,256,512] [--day 600] [--jobs 2] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.report import ROOT, Report, default_out, say  # noqa: E402
from sglang_eaas.balance.policy import BalanceSettings  # noqa: E402
from sglang_eaas.elastic.autoscaler import AutoscalePolicy  # noqa: E402
from sglang_eaas.elastic.layout_policy import LayoutPolicy  # noqa: E402
from sglang_eaas.plan.anchors import (DEEPEP_SOURCE, EAAS_SOURCE, Anchor,  # noqa: E402
                                      deepep_low_latency, eaas_double_batching,
                                      wide_ep_decode)
from sglang_eaas.plan.deployment import Deployment  # noqa: E402
from sglang_eaas.plan.load import zipf_load  # noqa: E402
from sglang_eaas.plan.model import ModelSpec  # noqa: E402
from sglang_eaas.plan.policies import AutoscaleLoop, BalanceLoop, LayoutLoop  # noqa: E402
from sglang_eaas.plan.profile import load_profile  # noqa: E402
from sglang_eaas.plan.sim import Failure, SimSettings, simulate  # noqa: E402
from sglang_eaas.plan.traffic import Lengths, poisson  # noqa: E402

MODEL = ROOT / "examples" / "plan" / "qwen3-235b-a22b"
TTFT, TPOT = 1.0, 0.1
TRACES = ("diurnal", "one GPU", "one node", "monitor outage")
MODES = ("fixed", "elastic", "elastic+switching")


@dataclass(frozen=True)
class Run:
    gpus: int
    trace: str
    mode: str
    day: float
    peak: float  # requests/s per device at the day's peak
    seed: int = 0


@dataclass(frozen=True)
class Outcome:
    run: Run
    attainment: float
    gpu_hours: float
    failed: int
    requests: int
    p90_tpot: float
    end: float  # seconds until the last request was done
    outs: int
    ins: int
    replacements: int
    switches: int


def one(run: Run) -> Outcome:
    model = ModelSpec.from_config(MODEL)
    profile = load_profile("h100")
    load = zipf_load(model.info.num_experts, model.info.moe_layers, 0.8, run.seed).subset(2)
    servers = run.gpus // 2
    dep = Deployment(run.gpus // 2, servers, hot_replicas=servers // 2,
                     standby=max(1, run.gpus // 64), overlap=True, prefill_budget=512)
    amplitude = 0.6
    traffic = poisson(run.peak * run.gpus / (1 + amplitude), run.day,
                      Lengths(256, "lognormal", 0.8), Lengths(256, "lognormal", 0.8),
                      seed=run.seed, diurnal=(amplitude, run.day), trough_first=True)
    failures = {"diurnal": (), "one GPU": (Failure(0.4 * run.day),),
                "one node": (Failure(0.4 * run.day, node=True),),
                "monitor outage": (Failure(0.3 * run.day, monitor=0.25 * run.day),)}[run.trace]
    controllers: tuple = ()
    if run.mode != "fixed":
        controllers = (
            AutoscaleLoop(AutoscalePolicy(ttft=TTFT, tpot=TPOT, window=10.0, patience=2,
                                          cooldown=20.0), bounds=(max(1, run.gpus // 8),
                                                                  servers)),
            BalanceLoop(BalanceSettings(mode="reactive", period=120.0, horizon=60.0,
                                        cooldown=60.0, budget=1024)))
    if run.mode == "elastic+switching":
        controllers += (LayoutLoop(LayoutPolicy(), period=10.0),)
    r = simulate(dep, model, profile, load, traffic, SimSettings(), failures, controllers)
    with np.errstate(all="ignore"):
        p90 = float(np.nanpercentile(r.tpot, 90)) if np.isfinite(r.tpot).any() else float("nan")
    said = " ".join(r.log)
    return Outcome(run, r.attainment(TTFT, TPOT), r.gpu_hours_until(run.day), r.failed,
                   len(traffic), p90,
                   r.last_done,
                   said.count("autoscaler: out"), said.count("autoscaler: in"),
                   said.count("balancer:"), said.count("layout:"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scales", default="64,128,256,512",
                   help="devices per deployment, comma-separated; default %(default)s")
    p.add_argument("--day", type=float, default=600.0,
                   help="seconds of the compressed day; default %(default)s")
    p.add_argument("--peak", type=float, default=0.9,
                   help="requests/s per device at the day's peak; default %(default)s")
    p.add_argument("--jobs", type=int, default=2, help="simulations at once; default 2")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 64 devices, a 120 s day, the diurnal and one-GPU traces")
    p.add_argument("--out", type=Path, default=default_out("plan"),
                   help="the report (markdown); default %(default)s")
    return p.parse_args()


def anchor_table(anchors: list[Anchor]) -> str:
    """Published anchors against the model's predictions, a row each (a percentage's unit
    written against its number, another after a space)."""
    rows = ["| published anchor (not a measurement here) | published | predicted | error |",
            "|---|---:|---:|---:|"]
    for a in anchors:
        unit = a.unit if a.unit == "%" else " " + a.unit
        rows.append(f"| {a.name} | {a.published:g}{unit} | {a.predicted:.1f}{unit} | "
                    f"{a.error:+.1%} |")
    return "\n".join(rows)


def main() -> int:
    args = parse_args()
    scales = [64] if args.quick else [int(x) for x in args.scales.split(",")]
    day = 120.0 if args.quick else args.day
    traces = TRACES[:2] if args.quick else TRACES
    runs = [Run(g, t, m, day, args.peak) for g in scales for t in traces for m in MODES]
    report = Report(args.out)
    say(f"{len(runs)} simulations on {args.jobs} processes")
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        outcomes = []
        for o in pool.map(one, runs):
            outcomes.append(o)
            say(f"{o.run.gpus} devices, {o.run.trace}, {o.run.mode}: {o.attainment:.1%}")
    report.add(
        f"Projection by the simulator (python/sglang_eaas/plan), not a measurement: "
        f"Qwen3-235B-A22B on the H100 profile (published specifications; message costs and "
        f"price assumed); a day compressed into {day:g} s, peak {args.peak:g} requests/s per "
        f"device; SLO TTFT <= {TTFT:g} s, TPOT <= {TPOT * 1e3:g} ms. The policies are the "
        "live tier's objects, driven by the simulated clock.")
    rows = ["| devices | trace | mode | requests | SLO attainment | device-hours in the day | "
            "failed | "
            "p90 TPOT ms | last done at s | scale out / in | re-placements | switches |",
            "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for o in outcomes:
        rows.append(f"| {o.run.gpus} | {o.run.trace} | {o.run.mode} | {o.requests} | "
                    f"{o.attainment:.1%} | {o.gpu_hours:.2f} | {o.failed} | "
                    f"{o.p90_tpot * 1e3:.1f} | {o.end:.0f} | {o.outs} / {o.ins} | "
                    f"{o.replacements} | "
                    f"{o.switches} |")
    report.add("\n".join(rows))
    h100 = load_profile("h100")
    anchors = deepep_low_latency(h100)
    median = statistics.median(abs(a.error) for a in anchors)
    report.add(anchor_table(anchors) + f"\n\nSource: {DEEPEP_SOURCE}. The fabric model on the H100 "
               f"profile's inter-node link (the same CX7 NIC); median absolute error "
               f"{median:.1%}, worst {max(abs(a.error) for a in anchors):.1%}.")
    decode = wide_ep_decode(h100)
    report.add(anchor_table(decode) + "\n\nSources: "
               + "; ".join(sorted({a.source for a in decode}))
               + ". The whole step's cost model on the H100 profile (an H800 has its compute "
               "and memory): the model has no MTP, no time between steps and no imbalance, and "
               "takes every kernel at its roofline.")
    ablation = eaas_double_batching(h100)
    report.add(anchor_table(ablation) + f"\n\nSource: {EAAS_SOURCE}. The simulator's own "
               "step on the H100 profile (Hopper 80 GB), with and without two micro-batches: "
               "32 clients and 32 expert servers of DeepSeek-V3's shape, 128 sequences a "
               "client, uniform load, BF16 hidden states both ways; the paper does not give "
               "the KV tokens a sequence reads, so two bracket ShareGPT's.")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
