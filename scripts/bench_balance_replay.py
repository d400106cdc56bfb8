"""Replay: the serving stack's balancer on recorded routing, in simulated time (issue 36).

``bench_balance_shift`` measures the balancer live: 3 runs of 90 s, two shifts each, so six
shifts per policy, and a run-to-run spread as large as the gap it looks for. This replays the
same traffic many times faster, to compare balancer settings on many shifts before a live run
decides: each prompt of ``bench_balance_shift``'s mixes is run once through the trained
checkpoint (transformers, greedy, its router's picks per token, cached in
``.cache/bench/routing``), then a simulated SGLang serves ``--concurrency`` closed-loop streams
of them in the live benchmark's order, prompts from the phase the stream's request starts in:
a step is a prefill of the requests waiting (SGLang's default: prefill first) or a decode step
of the running ones, its time ``--decode-step`` / ``--prefill-token`` seconds. The code under
test runs unchanged on it: ``RoutingBook`` fed with each step's rows and requests, the
forecast, the servers' counters over the horizon, ``BalancePolicy.look`` every period on the
placement in force, the re-placement in force ``--move-replica`` seconds per added replica
later (acted on at the decision and at the end, as ``client/balance_hooks.py`` does).

Measured as the live benchmark measures: per 1 s interval the busiest server's entries over the
mean per MoE layer (each expert's entries split evenly over its holders, under the placement in
force at each step), averaged over layers, over the run (time-averaged) and over the intervals
starting within ``--after-shift`` seconds of a shift; median [min-max] over ``--seeds`` (each
seed shifts every stream's place in the prompt lists and the step times' jitter).

What it leaves out: the step time's dependence on the placement, the re-placement's own cost
(token gaps, p90 TPOT), dealing by load (even split here), the balancer thread's share of the
cores. So it ranks settings; the live benchmark is what a claim quotes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.live_balance_measure import busiest_over_mean  # noqa: E402
from bench_lib.live_balance_prompts import SHIFT_MIXES, prompts as mix_prompts  # noqa: E402
from bench_lib.report import ROOT, Report, default_out, say, spread  # noqa: E402
from bench_lib.request_routing import RequestRouting, recorded  # noqa: E402
from bench_balance_shift import traffic_flags  # noqa: E402
from bench_live_balance import contiguous  # noqa: E402
from sglang_eaas.balance import forecast  # noqa: E402
from sglang_eaas.balance.evaluate import layer_load  # noqa: E402
from sglang_eaas.balance.forecast import (RoutingBook, StepRequest, horizon_steps,  # noqa: E402
                                          load_overlap)
from sglang_eaas.balance.known_futures import KnownFutures  # noqa: E402
from sglang_eaas.balance.policy import BalancePolicy, BalanceSettings  # noqa: E402
from sglang_eaas.holdings import Holdings  # noqa: E402
from sglang_eaas.placement import parse_expert_list  # noqa: E402

POLICIES = ("off", "reactive", "predictive", "hindsight-running", "hindsight-decode",
            "hindsight")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-moe-stdlib",
                   help="the checkpoint; default models/tiny-moe-stdlib (the trained one)")
    p.add_argument("--phases", type=int, default=12,
                   help="phases of --phase-seconds, cycling stdlib-held-out, other-code, prose "
                   "(as bench_balance_shift's default order); default 12 (11 shifts)")
    p.add_argument("--phase-seconds", type=float, default=30.0, help="default 30")
    p.add_argument("--seeds", type=int, default=5, help="replays per setting; default 5")
    traffic_flags(p)
    p.add_argument("--decode-step", type=float, default=0.075,
                   help="seconds of a decode step of the streams; default 0.075 (about the "
                   "live benchmark's: 8 streams of 48 tokens make 2 requests a second)")
    p.add_argument("--prefill-token", type=float, default=0.0005,
                   help="seconds per prompt token of a prefill step; default 0.0005")
    p.add_argument("--cache-tokens", type=int, default=8192,
                   help="SGLang's prefix cache, as the live benchmark runs it (--max-total-tokens "
                   "8192, radix cache on): a prompt finished within the last N tokens of "
                   "sequences, less the running requests', prefills its last token only; 0: "
                   "no cache; default 8192")
    p.add_argument("--move-replica", type=float, default=0.022,
                   help="seconds a re-placement takes per added replica (live: 40 in 0.9 s); "
                   "default 0.022")
    p.add_argument("--recent-decay", type=float, default=None,
                   help="the forecast's weight of a running request's older decode rows "
                   "(balance.forecast.RECENT_DECAY; 1: every row alike), for an ablation; "
                   "default the forecast's own")
    p.add_argument("--settings", action="append", default=[],
                   help="NAME=FLAGS: a balancer setting to compare, FLAGS as "
                   "--eaas-balance-* flags without the prefix ('cooldown=10 settle=1'); "
                   "repeatable; default one, 'defaults'")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"of {', '.join(POLICIES)}; default all")
    p.add_argument("--out", type=Path, default=default_out("balance-replay"),
                   help="markdown report; default %(default)s")
    args = p.parse_args()
    args.policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    if not args.policies or any(x not in POLICIES for x in args.policies):
        p.error(f"--policies: of {', '.join(POLICIES)}, got {args.policies}")
    if args.recent_decay is not None and not 0 < args.recent_decay <= 1:
        p.error(f"--recent-decay must be within (0, 1], got {args.recent_decay}")
    if min(args.phases - 1, args.seeds, args.concurrency, args.output_len - 1) < 1:
        p.error("--phases >= 2, --seeds, --concurrency >= 1 and --output-len >= 2")
    settings, defaults = {}, BalanceSettings()
    for item in args.settings or ["defaults="]:
        name, _, flags = item.partition("=")
        try:
            fields = dict(f.split("=", 1) for f in flags.split())
            known = [f.name for f in dataclasses.fields(BalanceSettings) if f.name != "mode"]
            unknown = sorted(set(fields) - set(known))
            if unknown:
                p.error(f"--settings {item!r}: no setting {', '.join(unknown)} (of "
                        f"{', '.join(known)})")
            settings[name] = {k: int(v) if getattr(defaults, k) is None  # slots
                              else type(getattr(defaults, k))(v) for k, v in fields.items()}
            BalanceSettings("reactive", **settings[name])
        except (ValueError, AttributeError, TypeError) as exc:
            p.error(f"--settings {item!r}: {exc}")
    args.settings = settings
    return args


@dataclass
class Stream:
    worker: int
    n: int = 0
    key: str = ""
    prompt: str = ""
    routing: RequestRouting | None = None
    fed: int = 0  # generated tokens fed back so far (decode rows made)


@dataclass
class Outcome:
    ratio: float
    after: float
    replacements: int
    replicas: int
    requests: int
    overlap: float | None  # the forecast's, with the decode until the next look (None: off)
    intervals: list[tuple[float, float]] = field(default_factory=list)
    steps: list[tuple[float, np.ndarray, bool]] = field(default_factory=list)  # (end, [L, E],
    # a decode step): what the servers computed


class Replay:
    """One simulated run of one policy."""

    def __init__(self, args, routing: dict[str, RequestRouting], lists: dict[str, list[str]],
                 holdings: Holdings, layers: list[int], num_experts: int, top_k: int,
                 policy: str, settings: dict, seed: int):
        self.inputs = (args, routing, lists, holdings, layers, num_experts, top_k)
        self.args, self.routing, self.lists = args, routing, lists
        self.layers, self.E, self.K = layers, num_experts, top_k
        self.holdings, self.policy_name, self.seed = holdings, policy, seed
        self.settings = BalanceSettings(policy if policy == "predictive" else "reactive",
                                        **settings)
        self.future: list[tuple[float, np.ndarray, bool]] = []  # hindsight
        self.policy = BalancePolicy(self.settings, tuple(layers))
        self.book = RoutingBook(layers, num_experts, top_k)
        self.rng = np.random.default_rng(seed)
        self.cache: collections.OrderedDict[str, int] = collections.OrderedDict()  # -> tokens
        self.servers = sorted(holdings)
        self.slots = max(len(ids) for server in holdings.values() for ids in server.values())
        self.bounds = [(i * args.phase_seconds, SHIFT_MIXES[i % len(SHIFT_MIXES)])
                       for i in range(args.phases)]
        self.duration = args.phases * args.phase_seconds

    def mix_at(self, t: float) -> str:
        return [m for start, m in self.bounds if start <= t][-1]

    def start(self, stream: Stream, t: float) -> None:
        mix = self.mix_at(t)
        prompt = self.lists[mix][(stream.worker * 7 + stream.n + 13 * self.seed)
                                 % len(self.lists[mix])]
        stream.key, stream.prompt, stream.routing, stream.fed = \
            f"{stream.worker}-{stream.n}", prompt, self.routing[prompt], 0
        stream.n += 1

    def cached(self, prompt: str, running: list[Stream]) -> bool:
        """Whether SGLang's prefix cache still holds ``prompt`` (a finished sequence, least
        recently used first out, within what the running requests leave of the pool)."""
        room = self.args.cache_tokens - sum(s.routing.prompt.shape[1] + self.args.output_len
                                            for s in running)
        while self.cache and sum(self.cache.values()) > room:
            self.cache.popitem(last=False)
        hit = prompt in self.cache
        if hit:
            self.cache.move_to_end(prompt)
        return hit

    def run(self) -> Outcome:
        if self.policy_name.startswith("hindsight"):  # the steps to come: the traffic does
            self.future = Replay(*self.inputs, "off", {}, self.seed).run().steps  # not depend
            # on the placement
        a, L = self.args, len(self.layers)
        streams = [Stream(w) for w in range(a.concurrency)]
        waiting = collections.deque(streams)
        for s in streams:
            self.start(s, 0.0)
        running: list[Stream] = []
        t, next_look, pending = 0.0, self.settings.period, None  # (in force at, target)
        steps: list[tuple[float, np.ndarray, bool]] = []  # (end, [L, E], a decode step)
        counted = 0  # the first step the servers' counters over the horizon still hold
        durations: collections.deque[float] = collections.deque(maxlen=64)
        interval = np.zeros((L, len(self.servers)))  # entries per server this interval
        holdings, finished = self.holdings, 0
        guess, decoded, judged = None, np.zeros((L, self.E)), []  # the forecast's accuracy
        intervals, replacements, replicas, tick = [], 0, 0, 1.0
        while t < self.duration:
            if waiting:  # a prefill of every waiting request
                batch = list(waiting)
                waiting.clear()
                rows = [s.routing.prompt[:, -1:] if self.cached(s.prompt, running)
                        else s.routing.prompt for s in batch]
                ids = np.concatenate(rows, axis=1)
                dt = a.prefill_token * ids.shape[1]
                reqs = [StepRequest(s.key, r.shape[1], False, a.output_len - 1)
                        for s, r in zip(batch, rows)]
                running += batch
                complete = False
            else:  # a decode step: each running request feeds its last token back
                batch = running
                ids = np.stack([s.routing.output[:, s.fed] for s in batch], axis=1)
                dt = a.decode_step
                reqs = []
                for s in batch:
                    s.fed += 1
                    done = s.fed >= a.output_len - 1
                    reqs.append(StepRequest(s.key, 1, True, a.output_len - 1 - s.fed, done))
                complete = True
            dt *= float(self.rng.uniform(0.85, 1.15))
            for i, layer in enumerate(self.layers):
                self.book.note(layer, ids[i])
            self.book.end_step(reqs, complete)
            entries = np.stack([np.bincount(ids[i].reshape(-1), minlength=self.E)
                                for i in range(L)]).astype(np.float64)
            t += dt
            durations.append(dt)
            steps.append((t, entries, complete))
            interval += self.served(holdings, entries)
            if complete:
                decoded += entries
                for s in [s for s in running if s.fed >= a.output_len - 1]:
                    running.remove(s)
                    finished += 1
                    self.cache[s.prompt] = s.routing.prompt.shape[1] + a.output_len
                    self.start(s, t)
                    waiting.append(s)
            if pending is not None and t >= pending[0]:
                holdings, pending = pending[1], None
                self.policy.acted(t)
            if t >= tick:  # a poll interval of the servers' counters ends
                intervals.append((tick - 1.0, self.measure(interval)))
                interval[:] = 0
                tick += 1.0
            while t >= next_look:
                next_look += self.settings.period
                if self.policy_name == "off" or pending is not None:
                    continue
                while steps[counted][0] < t - self.settings.horizon:
                    counted += 1
                n = horizon_steps(self.settings.horizon, statistics.mean(durations))
                forecast_now = self.book.forecast(n)  # judged as /metrics judges it: against
                overlap = load_overlap(guess, decoded) if guess is not None else None  # the
                if overlap is not None and not np.isnan(overlap).all():  # decode entries
                    judged.append(float(np.nanmean(overlap)))  # until the next look
                guess, decoded = forecast_now, np.zeros_like(decoded)
                ahead = t + self.settings.horizon
                if self.policy_name == "hindsight":  # the entries of the next horizon
                    estimate = sum((e for at, e, _ in self.future if t < at <= ahead),
                                   np.zeros((L, self.E)))
                elif self.policy_name == "hindsight-decode":  # its decode, and the forecast's
                    estimate = sum((e for at, e, decode in self.future  # prompts to come
                                    if decode and t < at <= ahead), self.book.coming_prefill(n))
                elif self.policy_name == "hindsight-running":  # the running requests' own
                    estimate = self.knowing_running(running, n)  # decode to come, the rest as
                    # the forecast has it
                elif self.policy_name == "predictive":
                    estimate = forecast_now + self.book.coming_prefill(n)
                else:
                    estimate = sum(e for _, e, _ in steps[counted:])
                look, chosen = self.policy.look(t, estimate, holdings, self.slots)
                if chosen is not None:
                    self.policy.acted(t)
                    adds = sum(len(m.adds) for m in chosen.moves)
                    pending = (t + a.move_replica * adds, chosen.target)
                    replacements, replicas = replacements + 1, replicas + adds
        shifts = [start for start, _ in self.bounds[1:]]
        kept = [(at, r) for at, r in intervals if not np.isnan(r)]
        after = [r for at, r in kept if any(s <= at < s + a.after_shift for s in shifts)]
        return Outcome(statistics.mean(r for _, r in kept), statistics.mean(after),
                       replacements, replicas, finished,
                       statistics.mean(judged) if judged else None, kept, steps)

    def knowing_running(self, running: list[Stream], n: int) -> np.ndarray:
        """The forecast with each running request's decode of the next ``n`` steps as it will
        be (its recorded rows: ``RoutingBook.forecast_knowing``, as the live bound runs it), the
        requests to come as the forecast spreads them, and the forecast's prompts to come."""
        known = KnownFutures({s.key: s.routing.output for s in running}, self.E)
        return self.book.forecast_knowing(n, known.entries) + self.book.coming_prefill(n)

    def served(self, holdings: Holdings, entries: np.ndarray) -> np.ndarray:
        """``[L, servers]``: one step's entries per server as the client deals them (each
        replicated expert's entries by load over its holders: ``evaluate.layer_load`` with
        whole tokens)."""
        return np.stack([layer_load({s: holdings[s].get(layer, ()) for s in self.servers},
                                    entries[i], whole_tokens=True).tokens
                         for i, layer in enumerate(self.layers)])

    def measure(self, per_server: np.ndarray) -> float:
        """An interval's busiest server over the mean, mean over the MoE layers with at least
        one step's entries (``concurrency * top_k``)."""
        ratios = busiest_over_mean(per_server.T)
        ratios[per_server.sum(axis=1) < self.args.concurrency * self.K] = np.nan
        return float("nan") if np.isnan(ratios).all() else float(np.nanmean(ratios))


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    from sglang_eaas.model_info import MoeModelInfo

    if args.recent_decay is not None:
        forecast.RECENT_DECAY = args.recent_decay
    info = MoeModelInfo.from_model_path(args.model)
    layers, E, K = list(info.moe_layers), info.num_experts, info.top_k
    lists = {mix: mix_prompts(mix, 64) for mix in SHIFT_MIXES}
    say(f"recording the routing of {len({p for v in lists.values() for p in v})} prompts "
        "(cached)")
    routing = recorded(args.model, [p for v in lists.values() for p in v], args.output_len,
                       ROOT / ".cache" / "bench" / "routing", say)
    experts, _slots = contiguous(E, args.servers, args.extra_replicas)
    holdings = Holdings.uniform({f"s{i}": parse_expert_list(spec, E)
                                 for i, spec in enumerate(experts)}, layers)
    results: dict[tuple[str, str], list[Outcome]] = {}
    for name, settings in args.settings.items():
        for policy in args.policies:
            if policy == "off" and (name, policy) != (next(iter(args.settings)), policy):
                continue  # off ignores the settings: once
            for seed in range(args.seeds):
                results.setdefault((name, policy), []).append(Replay(
                    args, routing, lists, holdings, layers, E, K, policy, settings,
                    seed).run())
            say(f"  {name}, {policy}: done")
    report.add(
        f"Replay of `bench_balance_shift`'s traffic on recorded routing (`{args.model.name}`, "
        f"{len(layers)} MoE layers x {E} experts, top-{K}): {args.concurrency} closed-loop "
        f"streams of {args.output_len}-token greedy requests, {args.phases} phases of "
        f"{args.phase_seconds:g} s cycling {', '.join(SHIFT_MIXES)} ({args.phases - 1} shifts); "
        f"{args.servers} servers of the live benchmark's starting placement; simulated decode "
        f"step {args.decode_step * 1000:g} ms, prefill {args.prefill_token * 1000:g} ms per "
        f"token, a re-placement {args.move_replica * 1000:g} ms per added replica. Busiest/mean "
        f"per 1 s interval, mean over layers; after a shift: intervals starting within "
        f"{args.after_shift:g} s of one. Cells: median [min-max] over {args.seeds} seeds. "
        "Simulated time: rank settings here, quote the live benchmark.")
    rows = ["| setting | policy | busiest/mean, time-averaged | after a shift | excess after a "
            "shift vs reactive | re-placements | replicas added | requests | forecast overlap |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, policy), outs in results.items():
        reactive = results.get((name, "reactive"))
        cut = ""
        if reactive and policy != "reactive":
            cuts = [1 - (o.after - 1) / (r.after - 1) for o, r in zip(outs, reactive)]
            cut = spread([100 * c for c in cuts], ".0f", "% less")
        rows.append(f"| {name} | {policy} | {spread([o.ratio for o in outs], '.3f')} | "
                    f"{spread([o.after for o in outs], '.3f')} | {cut} | "
                    f"{spread([o.replacements for o in outs], '.0f')} | "
                    f"{spread([o.replicas for o in outs], '.0f')} | "
                    f"{spread([o.requests for o in outs], '.0f')} | "
                    f"{spread([o.overlap for o in outs], '.3f')} |")
    report.add("\n".join(rows))
    report.add("Settings: " + "; ".join(
        f"`{name}`: {' '.join(f'{k}={v}' for k, v in s.items()) or 'the defaults'}"
        for name, s in args.settings.items()) + f"; the forecast's RECENT_DECAY "
        f"{forecast.RECENT_DECAY:g}" + (" (--recent-decay)" if args.recent_decay else ""))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
