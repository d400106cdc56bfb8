"""Benchmark: one MoE layer's step time under EP and TP over batch sizes and skews (the
crossover), the cost model fitted to it, and the switch of the whole model: its time and the
expert servers' peak memory (docs/switching.md; issue 22).

``--servers`` expert servers (default 3) of a generated checkpoint (``--model``: by default
``float32-24``, float32, 4 MoE layers of 24 experts, top-4, expert intermediate 384, which 2, 3
and 4 parts divide; ``bench`` is the bench checkpoint, bfloat16, 32 experts), registered with a
monitor in this process, and a client (``EaasClient``, this process) that follows it:

* **layer times**: both layouts held at once (each server adds its part of every expert, as a
  switch does before its drops), a client without a monitor whose table alternates between EP
  (contiguous blocks of experts) and TP (server i holding part i of every expert) call by
  call, so both
  layouts meet the same machine at the same moments; for each batch size and routing skew
  (Zipf exponent over the experts, hottest first: the hot experts sit on the first server,
  EP's worst case), the median of ``--repeat`` calls of one MoE layer (after two warm-up
  calls), as the client sees it (dispatch, the servers' work, the sum);
* **cost model**: ``elastic/layout_cost.py``'s constants fitted to those times (least squares
  on the relative error), its error, the predicted crossover (tokens per step from which EP is
  faster) per skew; ``--write-default`` makes it the model ``--eaas-layout auto`` uses;
* **switch**: the parts dropped, the whole model EP -> TP and back with ``elastic/switch.py``,
  ``--switches`` times idle and ``--switches`` times while a client that follows the monitor
  steps every MoE layer on ``--load-tokens`` rows without pause (under load), each timed by
  the caller from the first call to the last layer's dropped rows freed; each server's
  resident memory sampled every 2 ms and the expert weights it holds (its ``weight_bytes``)
  every 10 ms: the peaks over the steady state, against ParaSMoE's (K+2)/K for K MoE layers
  (resident) and (K+1)/K (expert weights: one layer held in both layouts at a time).

* **rollout**: ``--requests`` requests sent at once whose output lengths are long-tailed
  (lognormal: many short, a few long, as in an RL rollout), served by three SGLang servers
  (``--eaas``, ``--servers`` local expert servers each), ``--eaas-layout ep``, ``tp`` and
  ``auto`` (with this run's fitted model and ``--dwell``), all up at once and taking
  ``--rounds`` rounds in
  turn (so a drift of the machine's speed meets all three alike); per layout the median time
  of the head (until 75% of the requests finished: many sequences per step) and of the tail
  (the rest: few), and the switches ``auto`` made.
  ``--no-rollout`` leaves it out.

    python scripts/bench_switch.py [--model float32-24] [--servers 3] [--repeat 41]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
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
from bench_lib.stepper import Stepper  # noqa: E402
from bench_lib.report import (  # noqa: E402
    ROOT, Report, default_out, git_commit, pyplot, save_figure, say, spread,
)

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
from sglang_eaas.protocol.control import AddParts, DropParts, call, probe  # noqa: E402
from sglang_eaas.routing_table import RoutingTable  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MODELS = {"float32-24": replace(PRESETS["bench"], experts=24, moe_intermediate=384,
                                dtype="float32"),
          "bench": PRESETS["bench"]}
SKEWS = (0.0, 1.0, 2.0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="float32-24",
                   help="the generated checkpoint; default %(default)s")
    p.add_argument("--servers", type=int, default=3,
                   help="expert servers (TP: one part of every expert each); default "
                   "%(default)s")
    p.add_argument("--load-tokens", type=int, default=64,
                   help="rows per MoE layer call of the client stepping during the switches "
                   "under load; default %(default)s")
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
    if args.repeat < 3 or args.switches < 1 or min(args.tokens) < 1 or args.load_tokens < 1:
        p.error("need --repeat >= 3, --switches >= 1, batch sizes >= 1, --load-tokens >= 1")
    spec = MODELS[args.model]
    if not 2 <= args.servers <= spec.experts or spec.moe_intermediate % args.servers:
        p.error(f"--servers must be 2-{spec.experts} and divide the expert intermediate size "
                f"{spec.moe_intermediate} of --model {args.model}")
    return args


def routing(info: MoeModelInfo, tokens: int, skew: float, seed: int):
    """``(x, ids, weights)``: each token's ``top_k`` distinct experts drawn with Zipf weights
    of exponent ``skew``, expert 0 the hottest."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, info.num_experts + 1, dtype=torch.float64) ** skew
    ids = torch.stack([torch.multinomial(weights, info.top_k, generator=g)
                       for _ in range(tokens)])
    x = torch.randn(tokens, info.hidden_size, generator=g).to(getattr(torch, info.dtype))
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
            for layout, width in (("EP", 1.0), ("TP", 1.0 / len(held))):
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
            flags = ["--eaas", "--eaas-expert-servers", f"local:{args.servers}",
                     "--eaas-layout", layout]
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
    """Each server's resident memory every 2 ms and the expert weights it holds (its stats'
    ``weight_bytes``) every 10 ms: the peaks since ``reset``."""

    def __init__(self, pids: list[int], addresses: list[str], token: str):
        super().__init__(daemon=True)
        self.processes = [psutil.Process(pid) for pid in pids]
        self.addresses, self.token = addresses, token
        self.peak = [0] * len(pids)
        self.weights_peak = [0] * len(pids)
        self.stop = threading.Event()

    def now(self) -> list[int]:
        return [p.memory_info().rss for p in self.processes]

    def weights(self) -> list[int]:
        return [probe(a, self.token, 5.0).weight_bytes for a in self.addresses]

    def reset(self) -> None:
        self.peak, self.weights_peak = self.now(), self.weights()

    def run(self) -> None:
        ticks = 0
        while not self.stop.is_set():
            self.peak = [max(a, b) for a, b in zip(self.peak, self.now())]
            if ticks % 5 == 0:
                try:
                    self.weights_peak = [max(a, b) for a, b in
                                         zip(self.weights_peak, self.weights())]
                except (OSError, RuntimeError, ValueError):
                    pass  # a server busy past the timeout: the next sample
            ticks += 1
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


def switch_rounds(switcher: Switcher, info: MoeModelInfo, group: list[str],
                  sampler: MemorySampler, count: int) -> list[dict]:
    """``count`` round trips EP -> TP -> EP of every MoE layer: each way's seconds, the peaks
    over the steady state before it (resident, expert weights), the records."""
    rounds = []
    for _ in range(count):
        one = {}
        for to in ("tp", "ep"):
            steady, weights = sampler.now(), sampler.weights()
            sampler.reset()
            began = time.perf_counter()
            records = switcher.switch(list(info.moe_layers), to, group)
            one[to] = {"seconds": time.perf_counter() - began, "records": records,
                       "rss": max(p / s for p, s in zip(sampler.peak, steady)),
                       "weights": max(p / max(s, 1)
                                      for p, s in zip(sampler.weights_peak, weights)),
                       "steady_rss": steady, "steady_weights": weights}
        rounds.append(one)
    return rounds


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", MODELS[args.model],
                         log=lambda m: say("  " + m))
    info = MoeModelInfo.from_model_path(model)
    dtype = getattr(torch, info.dtype)
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    token = envs.TOKEN.get()
    monitor = MonitorServer(MonitorConfig(token=token)).start()
    log = open(ROOT / ".cache" / "logs" / "bench-switch-servers.log", "w")
    n = args.servers
    placement = even_placement(info.num_experts, n)
    servers = start_local_servers(model, placement, info.dtype, max_clients=4,
                                  extra_args=("--monitor", monitor.address), stdout=log)
    group = [s.address for s in servers]
    client = follower = stepper = None
    try:
        deadline = time.monotonic() + 60
        while len(monitor.registry.snapshot().servers()) < n:
            if time.monotonic() > deadline:
                print("bench: error: the expert servers did not register", file=sys.stderr)
                return 1
            time.sleep(0.05)
        say("both layouts held: each server adds its part of every expert of every layer")
        for layer in info.moe_layers:
            for p, address in enumerate(group):
                call(address, AddParts(layer, n, [e * n + p for e in range(info.num_experts)],
                                       {group[q]: placement[q] for q in range(n) if q != p}),
                     token, 120)
        client = EaasClient(group, info, ModelIdentity.of(model, info), dtype,
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

        sampler = MemorySampler([s.process.pid for s in servers], group, token)
        sampler.start()
        say(f"switching the whole model {args.switches} times each way, idle")
        idle = switch_rounds(switcher, info, group, sampler, args.switches)
        follower = EaasClient(group, info, ModelIdentity.of(model, info), dtype,
                              "bench-switch-load", monitor=monitor.address)
        stepper = Stepper(follower, info, routing(info, args.load_tokens, 1.0, seed=7))
        stepper.start()
        time.sleep(1.0)
        say(f"switching the whole model {args.switches} times each way, under a client "
            f"stepping every MoE layer on {args.load_tokens} rows")
        loaded = switch_rounds(switcher, info, group, sampler, args.switches)
        stepper.stop.set()
        stepper.join(60)
        sampler.stop.set()
        final = layouts(switcher.holdings(), info)
    finally:
        if stepper is not None:
            stepper.stop.set()
        for c in (client, follower):
            if c is not None:
                c.close()
        for server in servers:
            server.stop()
        monitor.close()
        log.close()

    samples = [s for _, s in [*ep.values(), *tp.values()]]
    args.cost_out.parent.mkdir(parents=True, exist_ok=True)
    (args.cost_out.parent / "switch_samples.json").write_text(json.dumps(
        [{"servers": s.servers, "width": s.width, "measured_us": s.measured_us}
         for s in samples]))
    cost = fit(samples, cores=os.cpu_count() or 1,
               fitted_by={"command": " ".join(sys.orig_argv), "commit": git_commit(),
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "model": model.name, "servers": n})
    args.cost_out.write_text(cost.to_json() + "\n")
    if args.write_default:
        DEFAULT_COST.write_text(cost.to_json() + "\n")

    blocks = ", ".join(f"{b[0]}-{b[-1]}" for b in placement)
    report.add(f"Setup: checkpoint `{model.name}` (--model {args.model}: {info.dtype}, "
               f"{len(info.moe_layers)} MoE layers, {info.num_experts} experts, "
               f"top-{info.top_k}, expert intermediate {info.moe_intermediate_size}); {n} expert "
               f"servers (EP: experts {blocks}; TP: server i holds part i of {n} of every "
               f"expert), the client in this process; one MoE layer per call, median of "
               f"{args.repeat} calls.")
    rows = ["| tokens | skew | EP ms | TP ms | TP / EP | EP predicted | TP predicted |",
            "|---|---|---|---|---|---|---|"]
    for skew in args.skews:
        for tokens in args.tokens:
            e, t = ep[tokens, skew], tp[tokens, skew]
            rows.append(f"| {tokens} | {skew:g} | {e[0] / 1e3:.2f} | {t[0] / 1e3:.2f} | "
                        f"{t[0] / e[0]:.2f}x | "
                        f"{cost.layer_us(e[1].servers, 1.0) / 1e3:.2f} | "
                        f"{cost.layer_us(t[1].servers, 1 / n) / 1e3:.2f} |")
    report.add("Layer times (measured, and as the fitted model predicts them):\n\n"
               + "\n".join(rows))
    crossings = []
    for skew in args.skews:
        measured = [t for t in args.tokens if tp[t, skew][0] < 0.95 * ep[t, skew][0]]
        predicted = [t for t in args.tokens
                     if cost.layer_us(tp[t, skew][1].servers, 1 / n)
                     < 0.95 * cost.layer_us(ep[t, skew][1].servers, 1.0)]
        crossings.append(f"| {skew:g} | {', '.join(map(str, measured)) or 'none'} | "
                         f"{', '.join(map(str, predicted)) or 'none'} |")
    picks = sum((cost.layer_us(tp[key][1].servers, 1 / n)
                 < cost.layer_us(ep[key][1].servers, 1.0))
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
    bound, weights_bound = (layers + 2) / layers, (layers + 1) / layers

    rows = ["| condition | way | seconds | peak resident / steady | peak expert weights / "
            "steady |", "|---|---|---:|---:|---:|"]
    for condition, rounds in (("idle", idle), (f"under load ({args.load_tokens} rows per "
                                               "layer call, stepping without pause)", loaded)):
        for to in ("tp", "ep"):
            rows.append(f"| {condition} | {'EP -> TP' if to == 'tp' else 'TP -> EP'} | "
                        f"{spread([r[to]['seconds'] for r in rounds], '.2f')} | "
                        f"{spread([r[to]['rss'] for r in rounds], '.2f', 'x')} | "
                        f"{spread([r[to]['weights'] for r in rounds], '.2f', 'x')} |")
    load_note = (f"The client under load made {stepper.steps} steps during the switches, "
                 f"{stepper.failed} rows failed" + (f"; {stepper.error}"
                                                    if stepper.error else "") + ".")
    report.add(
        f"Switch of the whole model ({layers} MoE layers, one after the other), "
        f"{args.switches} round trips idle, then {args.switches} under load; median "
        f"[min-max]. Goals: <= 1 s each way; peak resident memory per server within "
        f"(K+2)/K = {bound:.2f}x its steady state, and its expert weights within (K+1)/K = "
        f"{weights_bound:.2f}x (one layer held in both layouts at a time). Steady per server "
        f"in EP: resident {', '.join(f'{v / 2**20:.0f} MiB' for v in idle[0]['tp']['steady_rss'])}"
        f", expert weights "
        f"{', '.join(f'{v / 2**20:.0f} MiB' for v in idle[0]['tp']['steady_weights'])}; in TP: "
        f"resident {', '.join(f'{v / 2**20:.0f} MiB' for v in idle[0]['ep']['steady_rss'])}, "
        f"expert weights "
        f"{', '.join(f'{v / 2**20:.0f} MiB' for v in idle[0]['ep']['steady_weights'])}. "
        f"Layouts at the end: {final}. {load_note}\n\n" + "\n".join(rows) + "\n\n"
        + _phases(loaded[-1]["tp"]["records"], loaded[-1]["ep"]["records"])
        .replace("The last round", "The last round under load"))
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
                width = 1.0 if name == "EP" else 1 / n
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
