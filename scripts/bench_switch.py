"""Benchmark: one MoE layer's step time under EP and TP over batch sizes and skews (the
crossover), the cost model fitted to it, and the switch of the whole model: its time and the
expert servers' peak memory (docs/switching.md; issue 22).

Two expert servers of the bench checkpoint (bfloat16, 4 MoE layers of 32 experts, top-4),
registered with a monitor in this process, and a client (``EaasClient``, this process) that
follows it:

* **layer times**: both layouts held at once (each server adds its part of every expert, as a
  switch does before its drops), a client without a monitor whose table alternates between EP
  (experts 0-15 and 16-31) and TP (parts 0 and 1 of every expert) call by call, so both
  layouts meet the same machine at the same moments; for each batch size and routing skew
  (Zipf exponent over the experts, hottest first: the hot experts sit on the first server,
  EP's worst case), the median of ``--repeat`` calls of one MoE layer (after two warm-up
  calls), as the client sees it (dispatch, the servers' work, the sum);
* **cost model**: ``elastic/layout_cost.py``'s constants fitted to those times (least squares
  on the relative error), its error, the predicted crossover (tokens per step from which EP is
  faster) per skew; ``--write-default`` makes it the model ``--eaas-layout auto`` uses;
* **switch**: the parts dropped, the whole model EP -> TP and back with ``elastic/switch.py``,
  ``--switches`` times, each timed by the caller from the first call to the last layer's
  dropped rows freed, with each server's resident memory
  sampled every 2 ms: the peak over the steady state, against ParaSMoE's (K+2)/K for K MoE
  layers; the experts' rows after the round trip compared with the checkpoint's.

* **rollout**: ``--requests`` requests sent at once whose output lengths are long-tailed
  (lognormal: many short, a few long, as in an RL rollout), served by three SGLang servers
  (``--eaas``, two local expert servers each), ``--eaas-layout ep``, ``tp`` and ``auto`` (with
  this run's fitted model and ``--dwell``), all up at once and taking ``--rounds`` rounds in
  turn (so a drift of the machine's speed meets all three alike); per layout the median time
  of the head (until 75% of the requests finished: many sequences per step) and of the tail
  (the rest: few), and the switches ``auto`` made.
  ``--no-rollout`` leaves it out.

    python scripts/bench_switch.py [--repeat 41] [--tokens 1,2,4,...] [--skews 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.report import ROOT, Report, default_out, git_commit, pyplot, save_figure, say  # noqa: E402,E501

from sglang_eaas import envs  # noqa: E402
from sglang_eaas.checkpoint import ModelIdentity  # noqa: E402
from sglang_eaas.client.client import EaasClient  # noqa: E402
from sglang_eaas.elastic.layout_cost import DEFAULT_COST, Sample, fit  # noqa: E402
from sglang_eaas.elastic.switch import Switcher, layouts  # noqa: E402
from sglang_eaas.holdings import Holdings, ServerHoldings  # noqa: E402
from sglang_eaas.launcher.local_servers import start_local_servers  # noqa: E402
from sglang_eaas.model_info import MoeModelInfo  # noqa: E402
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer  # noqa: E402
from sglang_eaas.placement import even_placement  # noqa: E402
from sglang_eaas.protocol.control import AddParts, DropParts, call  # noqa: E402
from sglang_eaas.routing_table import RoutingTable  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SKEWS = (0.0, 1.0, 2.0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=41,
                   help="calls per (layout, batch, skew); the median is reported; default "
                   "%(default)s")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                   help="batch sizes (tokens per layer call); default %(default)s")
    p.add_argument("--skews", default=",".join(map(str, SKEWS)),
                   help="Zipf exponents of the routing over the experts (0: even); default "
                   "%(default)s")
    p.add_argument("--switches", type=int, default=3,
                   help="EP -> TP -> EP round trips of the whole model timed; default "
                   "%(default)s")
    p.add_argument("--requests", type=int, default=64,
                   help="rollout requests, sent at once; default %(default)s")
    p.add_argument("--max-len", type=int, default=192,
                   help="the longest rollout output (tokens); default %(default)s")
    p.add_argument("--rounds", type=int, default=3,
                   help="rollouts per layout (one SGLang server each; the median per phase is "
                   "reported); default %(default)s")
    p.add_argument("--dwell", type=float, default=5.0,
                   help="--eaas-layout-dwell of the auto run (seconds); default %(default)s")
    p.add_argument("--no-rollout", action="store_true", help="skip the SGLang rollout runs")
    p.add_argument("--write-default", action="store_true",
                   help=f"also write the fitted model to {DEFAULT_COST.relative_to(ROOT)}, the "
                   "one --eaas-layout auto uses by default")
    p.add_argument("--out", type=Path, default=default_out("switch"),
                   help="markdown report; default %(default)s")
    p.add_argument("--cost-out", type=Path, default=ROOT / ".cache" / "bench" /
                   "layout_cost.json", help="the fitted model; default %(default)s")
    args = p.parse_args()
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
        args.skews = [float(s) for s in args.skews.split(",")]
    except ValueError:
        p.error("--tokens and --skews are comma-separated numbers")
    if args.repeat < 3 or args.switches < 1 or min(args.tokens) < 1:
        p.error("need --repeat >= 3, --switches >= 1 and batch sizes >= 1")
    return args


def routing(info: MoeModelInfo, tokens: int, skew: float, seed: int):
    """``(x, ids, weights)``: each token's ``top_k`` distinct experts drawn with Zipf weights
    of exponent ``skew``, expert 0 the hottest."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, info.num_experts + 1, dtype=torch.float64) ** skew
    ids = torch.stack([torch.multinomial(weights, info.top_k, generator=g)
                       for _ in range(tokens)])
    x = torch.randn(tokens, info.hidden_size, generator=g).to(torch.bfloat16)
    return x, ids, torch.rand(tokens, info.top_k, generator=g)


def served(client: EaasClient, layer: int, ids: torch.Tensor) -> tuple[tuple[float, float], ...]:
    """What each server gets of ``ids`` in ``layer`` under the client's table: (entries,
    distinct routed ids), servers sent to only."""
    table = client.table
    routed = table.expand(layer, ids.numpy())
    server_of = table.assign(layer, routed)
    out = []
    for index in range(len(table.servers)):
        mine = routed[server_of == index]
        if mine.size:
            out.append((float(mine.size), float(len(np.unique(mine)))))
    return tuple(out)


def layer_times(client: EaasClient, info: MoeModelInfo, args
                ) -> dict[str, dict[tuple[int, float], tuple[float, Sample]]]:
    """Per layout, per (tokens, skew): the median time of one MoE layer's call and the sample
    the fit takes. The servers hold both layouts; the client's table alternates between EP and
    TP call by call (``stage``), so both see the same machine at the same moments."""
    layer, held = info.moe_layers[1], client.table.holdings
    tp_only = Holdings({s: ServerHoldings({lay: () for lay in h}, None, h.parts)
                        for s, h in held.items()})
    epoch = client.table.epoch
    out: dict[str, dict] = {"EP": {}, "TP": {}}
    for skew in args.skews:
        for tokens in args.tokens:
            x, ids, w = routing(info, tokens, skew, seed=tokens)
            times: dict[str, list[float]] = {"EP": [], "TP": []}
            for rep in range(args.repeat + 2):  # the first two of each: warm-up
                for layout, holdings in (("EP", held), ("TP", tp_only)):
                    epoch += 1
                    client.stage(RoutingTable.build(epoch, holdings, list(info.moe_layers),
                                                    info.num_experts))
                    client.begin_step()
                    began = time.perf_counter()
                    client.forward(layer, x, ids, w)
                    if rep >= 2:
                        times[layout].append((time.perf_counter() - began) * 1e6)
                    assert not client.end_step()
                    if rep == 0:
                        samples = served(client, layer, ids)
                        out[layout][tokens, skew] = (0.0, samples)
            for layout, width in (("EP", 1.0), ("TP", 0.5)):
                median = statistics.median(times[layout])
                samples = out[layout][tokens, skew][1]
                out[layout][tokens, skew] = (median, Sample(samples, width, median))
        say(f"skew {skew:g}: EP and TP measured at {len(args.tokens)} batch sizes")
    return out


ROLLOUT_HEAD = 0.75  # the head: until this share of the requests finished


def rollout_lengths(requests_: int, longest: int) -> list[int]:
    """Long-tailed output lengths (lognormal, seeded): many short, a few up to ``longest``."""
    rng = np.random.default_rng(0)
    return [int(v) for v in np.clip(24 * np.exp(rng.normal(0, 1, requests_)), 8, longest)]


def rollouts(model: Path, args, cost: Path, logs: Path) -> dict[str, dict]:
    """The rollout on three SGLang servers, one per ``--eaas-layout`` (each with its own two
    local expert servers), started before any round and idle but for their own rounds; the
    rounds go ep, tp, auto, ep, ... so that a drift of this machine's speed meets all three
    alike. Per layout: the median head, tail and total seconds, failed requests, the switches
    logged, each round's total."""
    from sglang_eaas import cpu_runtime
    from sglang_eaas.tools.server_process import CPU_DEVICE_ARGS, SGLangServer

    base = (*CPU_DEVICE_ARGS, "--max-total-tokens", "16384") if cpu_runtime.is_active() else ()
    servers: dict[str, SGLangServer] = {}
    try:
        for layout in ("ep", "tp", "auto"):
            flags = ["--eaas", "--eaas-expert-servers", "local:2", "--eaas-layout", layout]
            if layout == "auto":
                flags += ["--eaas-layout-dwell", f"{args.dwell:g}", "--eaas-layout-cost",
                          str(cost)]
            log = logs / f"bench-switch-rollout-{layout}.log"
            say(f"rollout, {layout}: starting SGLang {' '.join(flags)} (log: {log})")
            servers[layout] = SGLangServer(model, *base, *flags, log_path=log).start()
        deadline = time.monotonic() + 120
        while "every MoE layer is TP now" not in servers["tp"].log_path.read_text(
                errors="replace"):
            if time.monotonic() > deadline:
                raise RuntimeError("the tp tier did not switch to TP at start")
            time.sleep(0.2)
        lengths = rollout_lengths(args.requests, args.max_len)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        rng = np.random.default_rng(1)
        prompts = [[int(t) for t in rng.integers(10, vocab, 16)] for _ in lengths]
        rounds: dict[str, list[dict]] = {layout: [] for layout in servers}
        for i in range(args.rounds):
            for layout, server in servers.items():
                rounds[layout].append(_rollout_round(server.url, prompts, lengths))
            say(f"rollout round {i + 1}: " + ", ".join(
                f"{layout} {r[-1]['total']:.2f} s" for layout, r in rounds.items()))
    finally:
        for server in servers.values():
            server.stop()
    out = {}
    for layout, done in rounds.items():
        text = servers[layout].log_path.read_text(errors="replace")
        out[layout] = {key: statistics.median(r[key] for r in done)
                       for key in ("head", "tail", "total")} | {
            "failed": sum(r["failed"] for r in done),
            "switches": [line.split("eaas layout: ", 1)[1] for line in text.splitlines()
                         if "eaas layout: switching" in line],
            "rounds": [round(r["total"], 2) for r in done]}
    return out


def _rollout_round(url: str, prompts: list[list[int]], lengths: list[int]) -> dict:
    """The requests sent at once; the head and tail seconds."""
    finished, failed = [], []
    began = time.perf_counter()

    def one(prompt: list[int], length: int) -> None:
        try:
            reply = requests_post(f"{url}/generate", {
                "input_ids": prompt, "sampling_params": {
                    "max_new_tokens": length, "temperature": 0.0, "ignore_eos": True}})
            assert len(reply["output_ids"]) == length
            finished.append(time.perf_counter() - began)
        except Exception as exc:  # noqa: BLE001 (counted, the report shows it)
            failed.append(repr(exc))

    threads = [threading.Thread(target=one, args=(p, n)) for p, n in zip(prompts, lengths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finished.sort()
    if not finished:
        return {"head": float("nan"), "tail": float("nan"), "total": float("nan"),
                "failed": len(failed)}
    head = finished[max(0, int(ROLLOUT_HEAD * len(lengths)) - 1)]
    return {"head": head, "tail": finished[-1] - head, "total": finished[-1],
            "failed": len(failed)}


def requests_post(url: str, body: dict) -> dict:
    import requests

    reply = requests.post(url, json=body, timeout=900)
    reply.raise_for_status()
    return reply.json()


class MemorySampler(threading.Thread):
    """Each server's resident memory every 2 ms: the peak since ``reset``."""

    def __init__(self, pids: list[int]):
        super().__init__(daemon=True)
        self.processes = [psutil.Process(pid) for pid in pids]
        self.peak = [0] * len(pids)
        self.stop = threading.Event()

    def now(self) -> list[int]:
        return [p.memory_info().rss for p in self.processes]

    def reset(self) -> None:
        self.peak = self.now()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = [max(a, b) for a, b in zip(self.peak, self.now())]
            time.sleep(0.002)


def _phases(to_tp: list, to_ep: list) -> str:
    """The last round's time per layer and phase, and where the added weights came from."""
    rows = ["| layer | to | add s | monitor shows s | drop s | freed s | parts/experts added "
            "from (own rows, peer, disk) |", "|---|---|---|---|---|---|---|"]
    for record in [*to_tp, *to_ep]:
        p, a = record.phases, record.added
        rows.append(f"| {record.layer} | {record.to.upper()} | {p['add']:.3f} | "
                    f"{p['shown']:.3f} | {p['drop']:.3f} | {p['freed']:.3f} | "
                    f"{a['self']}, {a['peer']}, {a['disk']} |")
    return "The last round, layer by layer:\n\n" + "\n".join(rows)


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    info = MoeModelInfo.from_model_path(model)
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    token = envs.TOKEN.get()
    monitor = MonitorServer(MonitorConfig(token=token, loss_timeout=5.0)).start()
    log = open(ROOT / ".cache" / "logs" / "bench-switch-servers.log", "w")
    placement = even_placement(info.num_experts, 2)
    servers = start_local_servers(model, placement, "bfloat16", max_clients=4,
                                  extra_args=("--monitor", monitor.address), stdout=log)
    group = [s.address for s in servers]
    client = None
    try:
        deadline = time.monotonic() + 30
        while len(monitor.registry.snapshot().servers()) < 2:
            if time.monotonic() > deadline:
                print("bench: error: the expert servers did not register", file=sys.stderr)
                return 1
            time.sleep(0.05)
        say("both layouts held: each server adds its part of every expert of every layer")
        for layer in info.moe_layers:
            for p, address in enumerate(group):
                call(address, AddParts(layer, 2, [e * 2 + p for e in range(info.num_experts)],
                                       {group[1 - p]: placement[1 - p]}), token, 120)
        client = EaasClient(group, info, ModelIdentity.of(model, info), torch.bfloat16,
                            "bench-switch")  # no monitor: its tables are the bench's
        times = layer_times(client, info, args)
        ep, tp = times["EP"], times["TP"]
        client.close()
        client = None
        for layer in info.moe_layers:
            for address in group:
                call(address, DropParts(layer, grace=0.0), token, 30)
        switcher = Switcher(monitor.address, token, info, say=lambda line: None)
        deadline = time.monotonic() + 30
        while any(h.parts for h in switcher.holdings().values()):
            if time.monotonic() > deadline:
                print("bench: error: the parts were not dropped", file=sys.stderr)
                return 1
            time.sleep(0.05)

        sampler = MemorySampler([s.process.pid for s in servers])
        steady = sampler.now()
        sampler.start()
        rounds = []
        for _ in range(args.switches):
            sampler.reset()
            began = time.perf_counter()
            tp_layers = switcher.switch(list(info.moe_layers), "tp", group)
            to_tp, peak_tp, tp_steady = time.perf_counter() - began, sampler.peak, sampler.now()
            sampler.reset()
            began = time.perf_counter()
            ep_layers = switcher.switch(list(info.moe_layers), "ep", group)
            rounds.append((to_tp, peak_tp, tp_steady, time.perf_counter() - began,
                           sampler.peak, sampler.now(), tp_layers, ep_layers))
        sampler.stop.set()
        final = layouts(switcher.holdings(), info)
    finally:
        if client is not None:
            client.close()
        for server in servers:
            server.stop()
        monitor.close()
        log.close()

    samples = [s for _, s in [*ep.values(), *tp.values()]]
    (args.cost_out.parent / "switch_samples.json").write_text(json.dumps(
        [{"servers": s.servers, "width": s.width, "measured_us": s.measured_us}
         for s in samples]))
    cost = fit(samples, cores=os.cpu_count() or 1,
               fitted_by={"command": " ".join(sys.orig_argv), "commit": git_commit(),
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "model": model.name, "servers": 2})
    args.cost_out.parent.mkdir(parents=True, exist_ok=True)
    args.cost_out.write_text(cost.to_json() + "\n")
    if args.write_default:
        DEFAULT_COST.write_text(cost.to_json() + "\n")

    report.add(f"Setup: bench checkpoint `{model.name}` (bfloat16, {len(info.moe_layers)} MoE "
               f"layers, {info.num_experts} experts, top-{info.top_k}); 2 expert servers "
               f"(EP: experts 0-15 and 16-31; TP: parts 0 and 1 of every expert), the client in "
               f"this process; one MoE layer per call, median of {args.repeat} calls.")
    rows = ["| tokens | skew | EP ms | TP ms | TP / EP | EP predicted | TP predicted |",
            "|---|---|---|---|---|---|---|"]
    for skew in args.skews:
        for tokens in args.tokens:
            e, t = ep[tokens, skew], tp[tokens, skew]
            rows.append(f"| {tokens} | {skew:g} | {e[0] / 1e3:.2f} | {t[0] / 1e3:.2f} | "
                        f"{t[0] / e[0]:.2f}x | "
                        f"{cost.layer_us(e[1].servers, 1.0) / 1e3:.2f} | "
                        f"{cost.layer_us(t[1].servers, 0.5) / 1e3:.2f} |")
    report.add("Layer times (measured, and as the fitted model predicts them):\n\n"
               + "\n".join(rows))
    crossings = []
    for skew in args.skews:
        measured = [t for t in args.tokens if tp[t, skew][0] < 0.95 * ep[t, skew][0]]
        predicted = [t for t in args.tokens
                     if cost.layer_us(tp[t, skew][1].servers, 0.5)
                     < 0.95 * cost.layer_us(ep[t, skew][1].servers, 1.0)]
        crossings.append(f"| {skew:g} | {', '.join(map(str, measured)) or 'none'} | "
                         f"{', '.join(map(str, predicted)) or 'none'} |")
    picks = sum((cost.layer_us(tp[key][1].servers, 0.5) < cost.layer_us(ep[key][1].servers, 1.0))
                == (tp[key][0] < ep[key][0]) for key in ep)
    report.add(
        "Fitted cost model (microseconds; `elastic/layout_cost.py`): "
        f"client {cost.client_us:.0f}, per message {cost.message_us:.0f}, per entry "
        f"{cost.entry_us:.2f}, per entry at whole width {cost.width_entry_us:.2f}, per active "
        f"expert at whole width {cost.expert_us:.1f}, servers computing at once "
        f"{cost.parallel:.2f}; relative error mean "
        f"{cost.fitted_by['mean_relative_error']:.1%}, worst "
        f"{cost.fitted_by['worst_relative_error']:.1%} over {cost.fitted_by['samples']} "
        f"calls; it picks the faster layout at {picks} of the {len(ep)} (batch, skew) points."
        "\n\nWhere TP is faster than EP by more than 5% (batch sizes):\n\n"
        "| skew | measured | predicted |\n|---|---|---|\n" + "\n".join(crossings))
    layers = len(info.moe_layers)
    bound = (layers + 2) / layers
    rows = ["| round | EP -> TP s | peak / EP steady | TP -> EP s | peak / TP steady |",
            "|---|---|---|---|---|"]
    for i, (to_tp, peak_tp, tp_steady, to_ep, peak_ep, *_) in enumerate(rounds, 1):
        rows.append(f"| {i} | {to_tp:.2f} | "
                    f"{max(p / s for p, s in zip(peak_tp, steady)):.2f}x | {to_ep:.2f} | "
                    f"{max(p / s for p, s in zip(peak_ep, tp_steady)):.2f}x |")
    report.add(
        f"Switch of the whole model ({layers} MoE layers, one after the other; the goal: <= 1 s "
        f"each way, peak resident memory per server within (K+2)/K = {bound:.2f}x its steady "
        f"state). Steady resident memory per server in EP: "
        f"{', '.join(f'{s / 2**20:.0f} MiB' for s in steady)}; in TP after the first switch: "
        f"{', '.join(f'{s / 2**20:.0f} MiB' for s in rounds[0][2])}. Layouts at the end: "
        f"{final}.\n\n" + "\n".join(rows) + "\n\n" + _phases(rounds[-1][6], rounds[-1][7]))
    if not args.no_rollout:
        logs = ROOT / ".cache" / "logs"
        runs = rollouts(model, args, args.cost_out, logs)
        lengths = rollout_lengths(args.requests, args.max_len)
        best = {phase: min(runs["ep"][phase], runs["tp"][phase]) for phase in ("head", "tail")}
        rows = ["| layout | head s | tail s | total s | / best fixed, head | tail | total "
                "| rounds' totals s | failed | switches |", "|---" * 10 + "|"]
        best["total"] = min(runs["ep"]["total"], runs["tp"]["total"])
        for layout, run in runs.items():
            rows.append(f"| {layout} | {run['head']:.2f} | {run['tail']:.2f} | "
                        f"{run['total']:.2f} | {run['head'] / best['head']:.2f}x | "
                        f"{run['tail'] / best['tail']:.2f}x | "
                        f"{run['total'] / best['total']:.2f}x | "
                        f"{', '.join(map(str, run['rounds']))} | {run['failed']} | "
                        f"{len(run['switches'])} |")
        report.add(
            f"Rollout: {args.requests} requests sent at once (16 prompt tokens, output lengths "
            f"long-tailed: median {statistics.median(lengths):.0f}, longest {max(lengths)}); "
            f"the head: until {ROLLOUT_HEAD:.0%} of them finished, the tail: the rest; one "
            f"SGLang server per layout, all three up at once, {args.rounds} rounds going ep, "
            "tp, auto in turn, medians. Goals: "
            "auto within 5% of the better fixed layout in each phase, and faster than both "
            "over the run.\n\n" + "\n".join(rows)
            + ("\n\nauto's switches: " + "; ".join(runs["auto"]["switches"])
               if runs["auto"]["switches"] else "\n\nauto made no switch."))
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, len(args.skews), figsize=(4 * len(args.skews), 3.2),
                                 squeeze=False)
        for ax, skew in zip(axes[0], args.skews):
            for name, times in (("EP", ep), ("TP", tp)):
                ax.plot(args.tokens, [times[t, skew][0] / 1e3 for t in args.tokens], "o-",
                        label=f"{name} measured")
                width = 1.0 if name == "EP" else 0.5
                ax.plot(args.tokens, [cost.layer_us(times[t, skew][1].servers, width) / 1e3
                                      for t in args.tokens], "--", label=f"{name} model")
            ax.set_xscale("log", base=2)
            ax.set_title(f"skew {skew:g}")
            ax.set_xlabel("tokens per layer call")
            ax.set_ylabel("ms")
        save_figure(fig, ROOT / "docs" / "img" / "switch.png", legend_below=4)
        report.add("![EP and TP layer times](img/switch.png)")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
