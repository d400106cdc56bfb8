"""Calibration of the planner on this machine (docs/planning.md, "Calibration"; issue 38 item 2).

1. **Microbenchmarks, fitted into a profile** (``plan/profiles/cpu-here.yaml``'s numbers):
   * the expert server's kernel (``weighted_expert_sum``, the fast C++ kernel at 1 thread, as a
     server runs it) on every expert of one layer of the bench checkpoint (bfloat16, 32
     experts, hidden 1024, intermediate 512, top-4), in this process, with every expert
     computing exactly k rows for each k of ``--fit-rows``: the device's ``expert_rows``, the
     seconds per byte of an expert's weights at k rows (the planner averages it over a Poisson
     count of rows of the mean a placement gives; the kernel changes its inner loop with the
     rows it multiplies together, so a mean count alone does not give the mean cost); checked
     out of sample on random top-4 routing of ``--fit-batches`` tokens; and, for the rest of a
     step (attention, the LM head), the roofline's memory bandwidth and FLOP/s, one after the
     other (``roofline: sum``: a core streams and multiplies in turn), least squares of the
     relative error;
   * ``host_cores``, this host's cores, which its expert servers share, each server's work
     for a layer call run to its end on one core (list scheduling); checked by 1 to
     ``--busy`` processes running the kernel at once (``--busy-batch`` tokens), each one's
     time per call against one alone's: the cores' worth of work n busy processes get;
   * the slot protocol's echo round trips over shm (``bench_p2p``'s peers: one client and 1
     or 2 servers, each its own process, a (batch, 7168) bfloat16 payload): ``round trip / 2 =
     servers x (fixed + bytes / bandwidth)``, least squares: the intra-node link's fixed cost
     per message and bandwidth;
   * one client (``EaasClient``, what SGLang's MoE layer calls under ``--eaas``) and ONE local
     expert server holding every expert, over shm, at the same batch sizes: the round trip less
     the kernel's time and the two messages is the endpoints' own work per layer call (routing,
     copies, sums), ``2 * (call_s + entries * entry_s)``, fitted on the relative error of the
     round trip with a robust loss (one noisy point does not move it): the fabric's ``call_s``
     and ``entry_s``.

   Every point is the median of ``--runs`` runs, each the median of ``--repeat`` calls that
   cycle through 8 batches, each MoE layer twice with routing of its own, as serving calls the
   layers in turn (one batch of one layer called again and again finds its experts' weights in
   the cache, which makes small batches look up to 2x cheaper per expert than serving sees).
2. **Configurations, predicted and measured** (out of sample: none of them is a fit point but
   the 1-server ones, marked): ``--configs`` of (layout, servers, copies of each expert, batch),
   each started as ``--eaas-expert-servers local:N`` starts servers (``start_local_servers``; TP
   as ``--part P/N`` servers), the client polling as the launcher sets it for that many
   servers on this host (``launcher.prepare.client_poll_spin_us``), one MoE layer's
   ``EaasClient.forward`` timed (random top-4 routing); the prediction is the planner's own
   layer (``Tier.phase`` for the servers, ``fabric_phase`` for the messages) on the fitted
   profile. Printed: predicted, measured, error per configuration and the median error, and,
   to show what each part of the model is worth, the same prediction with the host's cores not
   shared (the busiest server gates), and with the model before this calibration (a GPU's
   roofline fitted to the kernel, no per-entry term, cores not shared).

It starts up to 4 expert servers and takes the machine's cores for about 2 minutes a run.

    python scripts/bench_plan_calibrate.py [--runs 3] [--repeat 41] [--write-profile PATH]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.layer_math import make_batches  # noqa: E402
from bench_lib.p2p_peers import HIDDEN, Plan, run_slots  # noqa: E402
from bench_lib.report import ROOT, Report, default_out, say  # noqa: E402
from sglang_eaas import envs  # noqa: E402
from sglang_eaas.checkpoint import ModelIdentity  # noqa: E402
from sglang_eaas.client.client import EaasClient  # noqa: E402
from sglang_eaas.expert_server.compute import local_experts, weighted_expert_sum  # noqa: E402
from sglang_eaas.expert_server.experts import load_experts  # noqa: E402
from sglang_eaas.launcher.local_servers import start_local_servers  # noqa: E402
from sglang_eaas.launcher.prepare import client_poll_spin_us  # noqa: E402
from sglang_eaas.model_info import MoeModelInfo  # noqa: E402
from sglang_eaas.plan.cost import expert_costs, fabric_phase  # noqa: E402
from sglang_eaas.plan.deployment import EP, TP, Deployment  # noqa: E402
from sglang_eaas.plan.load import ExpertLoad  # noqa: E402
from sglang_eaas.plan.model import ModelSpec  # noqa: E402
from sglang_eaas.plan.profile import PROFILES, load_profile, parse_profile  # noqa: E402
from sglang_eaas.plan.tier import Tier  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402

ROTATION = 8  # batches every timed point cycles through: each MoE layer twice, routed anew
# (layout, servers, copies of each expert, batch tokens)
CONFIGS = [(EP, 1, 1, 1), (EP, 1, 1, 32), (EP, 2, 1, 8), (EP, 4, 1, 32), (EP, 2, 2, 32),
           (EP, 4, 2, 8), (TP, 2, 1, 8), (TP, 4, 1, 1), (TP, 2, 1, 32), (EP, 3, 1, 16)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(str(i) for i in range(len(CONFIGS))),
                   help="indices of CONFIGS to measure (" + "; ".join(
                       f"{i}: {c[0]} x{c[1]} copies {c[2]} batch {c[3]}"
                       for i, c in enumerate(CONFIGS)) + "); default all")
    p.add_argument("--fit-batches", default="1,2,4,8,16,64",
                   help="batch sizes of the microbenchmarks; default %(default)s")
    p.add_argument("--fit-rows", default="1,2,3,4,6,8,12,16,24",
                   help="rows per expert of the kernel's exact-rows microbenchmark; default "
                   "%(default)s")
    p.add_argument("--busy", type=int, default=4,
                   help="the most processes running the kernel at once (1 to this many); "
                   "default %(default)s")
    p.add_argument("--busy-batch", type=int, default=16,
                   help="their batch; default %(default)s")
    p.add_argument("--runs", type=int, default=3,
                   help="runs of everything; each point is their median; default 3")
    p.add_argument("--repeat", type=int, default=41,
                   help="timed calls per point and run (their median); default 41")
    p.add_argument("--write-profile", type=Path, default=None, metavar="PATH",
                   help="write the fitted profile there (e.g. "
                   "python/sglang_eaas/plan/profiles/cpu-here.yaml)")
    p.add_argument("--out", type=Path, default=default_out("plan_calibrate"),
                   help="the report (markdown); default %(default)s")
    return p.parse_args()


def median_us(call, repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def uniform(info: MoeModelInfo) -> ExpertLoad:
    return ExpertLoad(tuple(info.moe_layers), np.full((len(info.moe_layers), info.num_experts),
                                                      1.0 / info.num_experts), "uniform")


def every_expert(model: Path, info: MoeModelInfo) -> dict:
    """MoE layer -> every expert of it, in bfloat16, for the kernel at 1 thread."""
    torch.set_num_threads(1)
    return load_experts(model, info, list(range(info.num_experts)), torch.bfloat16)


def rotation(calls: list) -> Callable[[], object]:
    """One call after the other of ``calls``, round and round: the MoE layers in turn, each
    with routing of its own, as serving calls them (one batch of one layer called again and
    again would find its experts in the cache, which serving does not)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def kernel_call(layers: dict, layer_id: int, hidden, ids, weights) -> Callable[[], object]:
    layer = layers[layer_id]
    flat = local_experts(layer, ids)
    return lambda: weighted_expert_sum(layer, hidden, flat, weights)


def kernel_times(model: Path, info: MoeModelInfo, batches: list[int], repeat: int
                 ) -> dict[int, float]:
    """Microseconds of ``weighted_expert_sum`` on every expert of a layer, 1 thread, on random
    top-k routing of ``batches`` tokens, the layers in turn."""
    layers = every_expert(model, info)
    out = {}
    for b in batches:
        out[b] = median_us(rotation([
            kernel_call(layers, x.layer_id, x.hidden, x.expert_ids, x.router_weights)
            for x in make_batches(info, b, torch.bfloat16, ROTATION, seed=b)]), repeat)
        say(f"kernel, batch {b}: {out[b]:.1f} us")
    return out


def exact_rows(info: MoeModelInfo, k: int, seed: int):
    """(hidden, expert ids, router weights) of a batch in which every expert gets exactly
    ``k`` rows: ``k * E / top_k`` tokens, token t routed to experts ``top_k * t + j`` mod E
    (shuffled by ``seed``)."""
    e, top = info.num_experts, info.top_k
    if (k * e) % top:
        raise ValueError(f"{k} rows per expert need k * {e} divisible by top-k {top}")
    tokens = k * e // top
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(e, generator=gen)
    ids = order[(torch.arange(tokens)[:, None] * top + torch.arange(top)[None, :]) % e]
    weights = torch.rand(tokens, top, generator=gen) + 0.1
    hidden = torch.randn(tokens, info.hidden_size, generator=gen).to(torch.bfloat16)
    return hidden, ids.int(), (weights / weights.sum(dim=-1, keepdim=True)).float()


def kernel_rows_times(model: Path, info: MoeModelInfo, rows: list[int], repeat: int
                      ) -> dict[int, float]:
    """Microseconds of ``weighted_expert_sum`` on a layer whose every expert computes exactly
    k rows, for each k of ``rows``, 1 thread, the layers in turn."""
    layers = every_expert(model, info)
    out = {}
    for k in rows:
        out[k] = median_us(rotation([
            kernel_call(layers, info.moe_layers[i % len(info.moe_layers)],
                        *exact_rows(info, k, seed=1000 * k + i)) for i in range(ROTATION)]),
            repeat)
        say(f"kernel, {k} rows per expert: {out[k]:.1f} us")
    return out


def _busy_kernel(model: Path, batch: int, calls: int, start, out) -> None:
    """One of several processes: the kernel at ``batch`` (the layers in turn) for ``calls``
    calls once ``start`` is set; the median call's microseconds to ``out``."""
    info = MoeModelInfo.from_model_path(model)
    layers = every_expert(model, info)
    call = rotation([kernel_call(layers, x.layer_id, x.hidden, x.expert_ids, x.router_weights)
                     for x in make_batches(info, batch, torch.bfloat16, ROTATION, seed=batch)])
    for _ in range(ROTATION):
        call()
    start.wait()
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    out.put(statistics.median(times) * 1e6)


def busy_times(model: Path, counts: list[int], batch: int, calls: int) -> dict[int, float]:
    """busy processes -> the median microseconds of one kernel call (``batch`` tokens, every
    expert of a layer) in each of that many processes running it at once on this host, as
    that many expert servers would: what the host's cores give several busy processes
    (their memory bandwidth and caches shared, their switches)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = {}
    for count in counts:
        start, results = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_busy_kernel, args=(model, batch, calls, start, results))
                 for _ in range(count)]
        for p in procs:
            p.start()
        time.sleep(8.0)  # every process loaded and warm
        start.set()
        medians = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        out[count] = statistics.median(medians)
        say(f"kernel, batch {batch}, {count} busy processes at once: {out[count]:.1f} us each")
    return out


def layer_time(model: Path, info: MoeModelInfo, placements, parts: int | None, batch: int,
               repeat: int, log) -> float:
    """Microseconds of one MoE layer's ``EaasClient.forward`` on servers started with
    ``placements`` (TP: ``parts`` servers, server i ``--part i/parts``)."""
    servers = []
    try:
        for i, experts in enumerate(placements):
            extra = ("--transport", "shm") + (("--part", f"{i}/{parts}") if parts else ())
            servers += start_local_servers(model, [experts], "bfloat16", max_clients=1,
                                           extra_args=extra, stdout=log)
        torch.set_num_threads(1)
        spin = client_poll_spin_us(None, servers=len(servers), ranks=1) * 1e-6
        client = EaasClient([s.address for s in servers], info, ModelIdentity.of(model, info),
                            torch.bfloat16, "bench_plan_calibrate", transport="shm",
                            poll_spin=spin)
        try:
            return median_us(rotation([
                functools.partial(client.forward, x.layer_id, x.hidden, x.expert_ids,
                                  x.router_weights)
                for x in make_batches(info, batch, torch.bfloat16, ROTATION, seed=batch)]),
                repeat)
        finally:
            client.close()
    finally:
        for s in servers:
            s.stop()


def fit_device(spec: ModelSpec, kernel: dict[int, float], roofline: str
               ) -> tuple[float, float, float]:
    """(bandwidth, FLOP/s, mean relative error) of the planner's roofline on ``kernel``."""
    from scipy.optimize import least_squares

    base = load_profile("cpu-here")
    e, k = spec.info.num_experts, spec.info.top_k

    def predicted(x):
        dev = parse_profile(_profile_dict(base, 10 ** x[0], 10 ** x[1], None, None,
                                          roofline=roofline)).device
        return np.array([float(expert_costs(np.full(e, b * k / e), spec, dev).sum()) * 1e6
                         for b in kernel])

    measured = np.array(list(kernel.values()))
    found = least_squares(lambda x: np.log(predicted(x) / measured), [10.0, 10.5])
    err = float(np.mean(np.abs(predicted(found.x) / measured - 1)))
    return 10 ** found.x[0], 10 ** found.x[1], err


def fit_rows(spec: ModelSpec, rows: dict[int, float], kernel: dict[int, float]
             ) -> tuple[list[int], list[float], dict[int, float]]:
    """The device's ``expert_rows`` from ``rows`` (exactly k rows per expert: seconds per
    byte of an expert), and its error on the random batches of ``kernel`` (out of sample:
    the planner's mean over a Poisson count of rows against the kernel's measured time)."""
    e, top = spec.info.num_experts, spec.info.top_k
    xs = sorted(rows)
    ys = [rows[k] * 1e-6 / (e * spec.expert_bytes) for k in xs]
    base = load_profile("cpu-here")
    device = parse_profile(_profile_dict(base, 1e10, 1e10, None, None,
                                         rows=(xs, ys))).device
    errors = {b: float(expert_costs(np.full(e, b * top / e), spec, device).sum() * 1e6
                       / kernel[b] - 1) for b in kernel}
    return xs, ys, errors


def host_parallelism(busy: dict[int, float]) -> list[float]:
    """The cores' worth of work 1, 2, ... busy processes get: n times one alone's time over
    each one's time with n busy."""
    return [round(n * busy[1] / busy[n], 3) for n in sorted(busy)]


def slot_round_trips(batches: list[int], repeat: int) -> dict[tuple[int, int], float]:
    """(servers, batch) -> microseconds of the shm slot echo, 1 client and 1 or 2 servers."""
    plan = Plan(tuple(batches), repeat, 3, 1)
    out = {}
    for servers in (1, 2):
        for b, us in run_slots(plan, "shm", 1, servers).items():
            out[servers, b] = us
            say(f"shm slot echo, 1 x {servers}, batch {b}: {us:.1f} us")
    return out


def fit_link(echo: dict[tuple[int, int], float]) -> tuple[float, float]:
    """(fixed seconds, bandwidth bytes/s): round trip / 2 = servers x (fixed + bytes / bw)."""
    a = np.array([[s, s * b * HIDDEN * 2] for s, b in echo])
    y = np.array(list(echo.values())) * 1e-6 / 2
    (fixed, per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
    return max(float(fixed), 1e-7), 1.0 / max(float(per_byte), 1e-13)


def fit_call(spec: ModelSpec, trips: dict[int, float], kernel: dict[int, float], fixed: float,
             link_bw: float, per_entry: bool = True) -> tuple[float, float]:
    """The endpoints' own work per phase, ``(call_s, entry_s)``, each >= 0: the 1-server round
    trip is the kernel, two messages and ``2 * (call_s + entries * entry_s)``, fitted on its
    relative error with a soft-L1 loss (``per_entry`` False: ``entry_s`` 0)."""
    from scipy.optimize import least_squares

    k = spec.info.top_k
    entry = k * spec.info.hidden_size * spec.dtype_bytes
    batches = list(trips)
    known = np.array([kernel[b] * 1e-6 + 2 * (fixed + b * entry / link_bw) for b in batches])
    measured = np.array([trips[b] * 1e-6 for b in batches])
    entries = np.array([b * k for b in batches], dtype=float)

    def misfit(x):
        per = x[1] if per_entry else 0.0
        return np.log((known + 2 * (x[0] + entries * per)) / measured)

    found = least_squares(misfit, [1e-4, 1e-6], bounds=(0, np.inf), loss="soft_l1",
                          f_scale=0.05, x_scale=[1e-4, 1e-6])
    return float(found.x[0]), float(found.x[1]) if per_entry else 0.0


def _profile_dict(base, bandwidth, flops, fixed, link_bw, call=0.0, entry=0.0,
                  roofline="sum", cores=None, rows=None) -> dict:
    made = {"name": "cpu-here",
            "device": {"memory_bandwidth": bandwidth,
                       "flops": {"bfloat16": flops, "float32": flops},
                       "memory": base.device.memory, "roofline": roofline},
            "fabric": {"intra_node": {"bandwidth": link_bw or base.intra_node.bandwidth,
                                      "message_s": fixed or base.intra_node.message_s},
                       "inter_node": {"bandwidth": base.inter_node.bandwidth,
                                      "message_s": base.inter_node.message_s},
                       "serial_messages": True, "call_s": call, "entry_s": entry},
            "gpus_per_node": base.gpus_per_node,
            "price_per_gpu_hour": base.price_per_gpu_hour}
    if cores:
        made["host_cores"] = cores
    if rows:
        made["device"]["expert_rows"] = {"rows": rows[0], "seconds_per_byte": rows[1]}
    return made


def predict(spec: ModelSpec, profile, layout: str, servers: int, copies: int, batch: int
            ) -> tuple[float, list]:
    """(the planner's layer in microseconds, the placement): its ``Tier`` on the profile,
    every server on one node (this host), one client there too."""
    info = spec.info
    dep = Deployment(1, servers, hot_replicas=(copies - 1) * info.num_experts, layout=layout)
    load = uniform(info)
    tier = Tier(dep, spec, profile, load.layers, load.shares)
    phase = tier.phase(0, float(batch * info.top_k))
    entry = info.hidden_size * spec.dtype_bytes
    comm = fabric_phase(phase.entries, 1, np.array([0]), tier.server_nodes(), entry, profile,
                        phase.routed)
    placement = [list(tier.holdings[s][info.moe_layers[0]]) for s in tier.holdings]
    return (2 * comm + float(phase.times.max())) * 1e6, placement


def one_host(profile: dict, servers: int) -> dict:
    """``profile`` with the client and every one of ``servers`` on one node (the
    calibration's host; the planner numbers attention devices first, then servers)."""
    return {**profile, "gpus_per_node": max(servers + 1, profile["gpus_per_node"])}


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"],
                         log=lambda m: say("  " + m))
    info = MoeModelInfo.from_model_path(model)
    spec = ModelSpec.from_config(model / "config.json")
    os.environ.setdefault(envs.TOKEN.name, secrets.token_hex(16))
    log_path = ROOT / ".cache" / "logs" / "bench-plan-calibrate-servers.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fit_batches = [int(x) for x in args.fit_batches.split(",")]
    fit_rows_list = [int(x) for x in args.fit_rows.split(",")]
    busy_counts = list(range(1, args.busy + 1))
    chosen = [CONFIGS[int(i)] for i in args.configs.split(",")]
    base = load_profile("cpu-here")
    placements = {c: predict(spec, parse_profile(one_host(_profile_dict(
        base, 1e10, 1e10, None, None), c[1])), *c)[1] for c in chosen}
    runs: list[dict] = []
    with open(log_path, "w") as log:
        for run in range(args.runs):
            say(f"run {run + 1} of {args.runs}")
            everything = list(range(info.num_experts))
            runs.append({
                "kernel": kernel_times(model, info, fit_batches, args.repeat),
                "rows": kernel_rows_times(model, info, fit_rows_list, args.repeat),
                "busy": busy_times(model, busy_counts, args.busy_batch, args.repeat),
                "trips": {b: layer_time(model, info, [everything], None, b, args.repeat, log)
                          for b in fit_batches},
                "echo": slot_round_trips(fit_batches, args.repeat),
                "configs": {}})
            for c in chosen:
                layout, servers, copies, batch = c
                got = runs[-1]["configs"][c] = layer_time(
                    model, info, placements[c], servers if layout == TP else None, batch,
                    args.repeat, log)
                say(f"{layout} x{servers} copies {copies} batch {batch}: {got:.0f} us")
    kernel, by_rows, busy, trips, echo, measured = (
        {k: statistics.median(r[part][k] for r in runs) for k in runs[0][part]}
        for part in ("kernel", "rows", "busy", "trips", "echo", "configs"))
    fixed, link_bw = fit_link(echo)
    bandwidth, flops, kernel_err = fit_device(spec, kernel, "sum")
    rows_x, rows_y, rows_err = fit_rows(spec, by_rows, kernel)
    call, per_entry = fit_call(spec, trips, kernel, fixed, link_bw)
    parallel = host_parallelism(busy)
    fitted = _profile_dict(base, bandwidth, flops, fixed, link_bw, call, per_entry,
                           cores=os.cpu_count() or 1, rows=(rows_x, rows_y))
    # the model without each part: the host's cores not shared; and the model before this
    # calibration (a GPU's roofline fitted to the kernel, no per-entry term, cores not shared)
    gpu_bw, gpu_flops, gpu_err = fit_device(spec, kernel, "max")
    gpu_call, _ = fit_call(spec, trips, kernel, fixed, link_bw, per_entry=False)
    before = _profile_dict(base, gpu_bw, gpu_flops, fixed, link_bw, gpu_call, roofline="max")
    unshared = {**fitted, "host_cores": None}
    rows = []
    for c in chosen:
        predicted = [predict(spec, parse_profile(one_host(p, c[1])), *c)[0]
                     for p in (fitted, unshared, before)]
        spread_of = [r["configs"][c] for r in runs]
        rows.append((*c, *predicted, measured[c], min(spread_of), max(spread_of)))
    report.add(
        f"Fitted from the microbenchmarks (bench checkpoint `{model.name}`, 1 thread per "
        f"server and client, shm; every point the median of {args.runs} runs of "
        f"{args.repeat} calls): the kernel's `expert_rows` (seconds per byte of an expert "
        "computing exactly k rows; on the random batches, the mean over a Poisson count of "
        "rows is off by " + ", ".join(f"{e:+.0%} at batch {b}" for b, e in rows_err.items())
        + f"); for the rest of a step, memory bandwidth {bandwidth / 1e9:.2f} GB/s and "
        f"{flops / 1e9:.1f} GFLOP/s one after the other (`roofline: sum`; on the kernel its "
        f"mean error is {kernel_err:.1%}, {gpu_err:.1%} with a GPU's `max`); a message "
        f"{fixed * 1e6:.1f} us + bytes at {link_bw / 1e9:.2f} GB/s; the endpoints' own work "
        f"{call * 1e6:.1f} us per dispatch or combine plus {per_entry * 1e6:.2f} us per entry "
        f"(without the per-entry term: {gpu_call * 1e6:.1f} us); the host's "
        f"{os.cpu_count()} cores shared by its servers (`host_cores`), each server's work run "
        "to its end on one core, longest first (list scheduling: `cost.shared_cores`). Run "
        f"1 to {len(parallel)} at a time, the kernel at batch {args.busy_batch} gets "
        f"{', '.join(f'{c:.2f}' for c in parallel)} cores' worth: the host does not lose "
        "throughput to more processes than cores; what it loses is that works shorter than "
        "the operating system's slice are not shared finely (three on two cores take two "
        "works' time).\n\n"
        "| batch | kernel us | shm echo 1x1 us | shm echo 1x2 us | 1-server EaasClient round "
        "trip us |\n|---:|---:|---:|---:|---:|\n"
        + "\n".join(f"| {b} | {kernel[b]:.1f} | {echo[1, b]:.1f} | {echo[2, b]:.1f} | "
                     f"{trips[b]:.1f} |" for b in fit_batches)
        + "\n\n| rows per expert | " + " | ".join(str(k) for k in rows_x) + " |\n|---|"
        + "---:|" * len(rows_x) + "\n| kernel us, every expert | "
        + " | ".join(f"{by_rows[k]:.0f}" for k in rows_x) + " |\n\n"
        "| processes running the kernel at once | " + " | ".join(str(n) for n in busy)
        + " |\n|---|" + "---:|" * len(busy) + "\n| us per call, each | "
        + " | ".join(f"{busy[n]:.0f}" for n in busy) + " |\n| cores' worth | "
        + " | ".join(f"{c:.2f}" for c in parallel) + " |")
    lines = ["| layout | servers | copies | batch | measured us [min-max] | predicted us | "
             "error | error, cores not shared | error, the model before |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    errors: list[list[float]] = [[], [], []]
    for layout, servers, copies, batch, *predicted, got, low, high in rows:
        fit_point = servers == 1 and batch in fit_batches
        e = [p / got - 1 for p in predicted]
        if not fit_point:
            for kept, x in zip(errors, e):
                kept.append(abs(x))
        lines.append(f"| {layout.upper()} | {servers} | {copies} | {batch}"
                     f"{' (fit point)' if fit_point else ''} | {got:.0f} [{low:.0f}-{high:.0f}] "
                     f"| {predicted[0]:.0f} | " + " | ".join(f"{x:+.1%}" for x in e) + " |")
    summary = (f"Median absolute error over the {len(errors[0])} configurations that are not "
               f"fit points: **{statistics.median(errors[0]):.1%}** (the planner's model; the "
               f"issue's goal is 15%); {statistics.median(errors[1]):.1%} with the host's cores "
               f"not shared; {statistics.median(errors[2]):.1%} with the model before (a GPU's "
               "roofline, no per-entry term, cores not shared)." if errors[0]
               else "No configuration outside the fit points.")
    report.add("\n".join(lines) + "\n\n" + summary)
    if args.write_profile:
        header = (f"# This machine, fitted by {' '.join(sys.orig_argv)} "
                  f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}); see "
                  f"{PROFILES.name}/h100.yaml for the format.\n")
        fitted["device"]["source"] = ("fitted by scripts/bench_plan_calibrate.py (the "
                                      "kernel: expert_rows and the roofline)")
        fitted["fabric"]["intra_node"]["source"] = ("fitted by scripts/bench_plan_calibrate.py "
                                                    "(shm slot echoes)")
        args.write_profile.write_text(header + yaml.safe_dump(plain(fitted), sort_keys=False))
        say(f"profile written to {args.write_profile}")
    report.save()
    return 0


def plain(value):
    """``value`` with NumPy's scalars made Python's (what yaml.safe_dump can write)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value.item() if hasattr(value, "item") else value


if __name__ == "__main__":
    sys.exit(main())
