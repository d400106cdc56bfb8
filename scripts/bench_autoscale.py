"""Benchmark: a load step served with the autoscaler on, against every fixed size of expert tier
the autoscaler may choose (the best one included), in the same run (docs/elastic.md,
"Autoscaler").

SGLang servers (--eaas, the bench checkpoint), one after the other, each under the same stepped
closed loop of streaming requests: ``--low`` streams for ``--low-s`` seconds, then ``--high``
streams for ``--high-s``, then ``--after`` streams (by default ``--low``: traffic falls back,
it does not vanish) for ``--after-s``:

* **fixed N**: ``--eaas-expert-servers local:N`` for every N from ``--min-servers`` to
  ``--max-servers``;
* **autoscaled**: ``local:MIN`` with ``--eaas-autoscale`` between ``--min-servers`` and
  ``--max-servers``, at the product's default window and cooldown unless told otherwise
  (``act resize``: the resize starts servers).

The SLO targets are set once, from the first run's smallest fixed tier: the TPOT target is its
p90 time per output token at low load over 0.45 (so that low load is slack for the policy, whose
scale-in needs p90 <= 0.5x the targets), the TTFT target 4x its p90 time to first token at low
load (at least 1 s): TPOT decides. Measured per tier and run: SLO attainment (finished requests
meeting both targets, by when they were sent) overall and during the high phase; p90 TPOT at
high load; server-seconds, counted from each expert-server *process*'s start to its exit (a
server still starting or draining costs as much as a serving one), sampled every 0.5 s; the
autoscaler's decisions (its log lines); failed requests. Every number is the median [min-max]
of ``--runs`` runs. The strongest baseline is the best fixed size: the smallest whose high-phase
attainment meets the policy's attainment goal, else the one with the best attainment; the
autoscaler is reported against it and against every other size.

    python scripts/bench_autoscale.py [--low 1] [--high 8] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.report import (  # noqa: E402
    ROOT, Report, default_out, pyplot, save_figure, say, spread,
)
from bench_lib.streams import Run, closed_loop  # noqa: E402

from sglang_eaas import cpu_runtime, envs  # noqa: E402
from sglang_eaas.elastic.autoscaler import AutoscalePolicy  # noqa: E402
from sglang_eaas.protocol.operations import TOKEN_HEADER  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError  # noqa: E402

SLACK_SHARE = 0.45  # low load's p90 TPOT as a share of the target: under the policy's 0.5
EXPERT_SERVER = "sglang_eaas.expert_server"  # in every local expert server's command line
AUTO = "autoscaled"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="With the defaults: 4 tiers x 3 runs, each a server start (about a minute) and "
        "6 minutes of load: about 85 minutes on 2 CPU cores. Run it on an otherwise idle "
        "machine.")
    policy = AutoscalePolicy(ttft=1.0, tpot=1.0)  # for its defaults only
    p.add_argument("--low", type=int, default=1, help="streams at low load; default %(default)s")
    p.add_argument("--high", type=int, default=8,
                   help="streams at high load; default %(default)s")
    p.add_argument("--after", type=int, default=None,
                   help="streams after the high load; default --low")
    p.add_argument("--low-s", type=float, default=60.0,
                   help="seconds of low load first; default %(default)s")
    p.add_argument("--high-s", type=float, default=180.0,
                   help="seconds of high load; default %(default)s")
    p.add_argument("--after-s", type=float, default=120.0,
                   help="seconds after the high load; default %(default)s")
    p.add_argument("--min-servers", type=int, default=2,
                   help="the smallest tier (fixed, and the autoscaler's floor); default "
                   "%(default)s")
    p.add_argument("--max-servers", type=int, default=4,
                   help="the largest tier (fixed, and the autoscaler's ceiling); default "
                   "%(default)s")
    p.add_argument("--window", type=float, default=policy.window,
                   help="the autoscaler's --eaas-autoscale-window; default the product's, "
                   "%(default)s")
    p.add_argument("--cooldown", type=float, default=policy.cooldown,
                   help="the autoscaler's --eaas-autoscale-cooldown; default the product's, "
                   "%(default)s")
    p.add_argument("--runs", type=int, default=3, help="runs of every tier; default %(default)s")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens; default %(default)s")
    p.add_argument("--output-len", type=int, default=32,
                   help="output tokens per request; default %(default)s")
    p.add_argument("--out", type=Path, default=default_out("autoscale"),
                   help="markdown report; default %(default)s")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs",
                   help="server logs; default .cache/logs")
    args = p.parse_args()
    args.after = args.low if args.after is None else args.after
    if (not 1 <= args.low < args.high or not 0 <= args.after <= args.high
            or min(args.low_s, args.high_s, args.after_s) <= 0):
        p.error("need 1 <= --low < --high, 0 <= --after <= --high and positive phase lengths")
    if not 1 <= args.min_servers < args.max_servers:
        p.error("need 1 <= --min-servers < --max-servers")
    if args.runs < 1 or args.window <= 0 or args.cooldown < 0:
        p.error("need --runs >= 1, --window > 0 and --cooldown >= 0")
    args.attainment = policy.attainment
    return args


@dataclass
class Served:
    """One tier's run: the requests, the servers over time, the decisions."""

    name: str
    run: Run
    # (seconds into the run, active servers at the admin API, expert-server processes alive)
    servers: list[tuple[float, int, int]] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)

    def requests(self) -> list[tuple[float, float, float]]:
        """(sent, seconds into the run; TTFT; TPOT) of every request that ran to its end."""
        out, finished = [], {id(times) for times in self.run.finished}
        for times, sent in zip(self.run.arrivals, self.run.sent):
            if id(times) in finished and len(times) > 1:
                out.append((sent - self.run.started, times[0] - sent,
                            (times[-1] - times[0]) / (len(times) - 1)))
        return out

    def server_seconds(self, duration: float) -> float:
        """Expert-server processes alive, integrated over the run (from each one's start)."""
        if not self.servers:
            return float("nan")
        points = [(t, n) for t, _, n in self.servers]
        total, points = 0.0, points + [(duration, points[-1][1])]
        for (t0, n), (t1, _) in zip(points, points[1:]):
            total += n * (min(t1, duration) - t0)
        return total


def p90(values: list[float]) -> float:
    return float(statistics.quantiles(values, n=10)[-1]) if len(values) > 1 else (
        values[0] if values else float("nan"))


def expert_processes(root: psutil.Process) -> int:
    """Local expert-server processes under SGLang's process tree, alive now."""
    alive = 0
    for child in root.children(recursive=True):
        try:
            if EXPERT_SERVER in " ".join(child.cmdline()) and child.status() != "zombie":
                alive += 1
        except psutil.Error:
            pass  # it exited as we looked
    return alive


def serve(name: str, model: Path, flags: list[str], args: argparse.Namespace, vocab: int,
          log: Path) -> Served:
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    say(f"{name}: starting SGLang {' '.join(flags)} (log: {log})")
    server = SGLangServer(model, *base, "--eaas", *flags, log_path=log).start()
    root = psutil.Process(server.process.pid)
    headers = {TOKEN_HEADER: envs.TOKEN.get()}
    duration = args.low_s + args.high_s + args.after_s
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(64)]

    def active(worker: int, seconds: float) -> bool:
        if seconds < args.low_s:
            return worker < args.low
        return worker < (args.high if seconds < args.low_s + args.high_s else args.after)

    samples: list[tuple[float, int, int]] = []

    def watch(run: Run) -> None:
        while time.perf_counter() - run.started < duration:
            at = time.perf_counter() - run.started
            try:
                tier = requests.get(f"{server.url}/eaas/tier", headers=headers, timeout=10)
                serving = len(tier.json()["active"])
            except (requests.RequestException, ValueError, KeyError):
                serving = samples[-1][1] if samples else 0
            samples.append((at, serving, expert_processes(root)))
            time.sleep(0.5)

    try:
        run = closed_loop(server.url, lambda w, n: prompts[(w * 7 + n) % len(prompts)],
                          args.output_len, args.high, duration, during=watch, active=active)
    finally:
        server.stop()
    served = Served(name, run, samples)
    served.decisions = [line.split("] eaas autoscaler: ", 1)[1].strip()
                        for line in log.read_text(errors="replace").splitlines()
                        if "] eaas autoscaler: scale " in line]
    say(f"{name}: {len(run.finished)} requests, {len(run.failed)} failed, "
        f"{len(served.decisions)} decisions, {served.server_seconds(duration):.0f} "
        "server-seconds")
    return served


@dataclass
class Row:
    """One tier's numbers per run."""

    attainment: list[float] = field(default_factory=list)
    in_high: list[float] = field(default_factory=list)
    high_tpot_ms: list[float] = field(default_factory=list)
    server_seconds: list[float] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)


def judge(served: Served, rows: dict[str, Row], high_phase: tuple[float, float],
          targets: tuple[float, float], duration: float) -> None:
    ttft, tpot = targets
    reqs = served.requests()
    met = [r[1] <= ttft and r[2] <= tpot for r in reqs]
    in_high = [m for r, m in zip(reqs, met) if high_phase[0] <= r[0] < high_phase[1]]
    high_tpot = [r[2] for r in reqs if high_phase[0] + 5 <= r[0] < high_phase[1]]
    row = rows.setdefault(served.name, Row())
    row.attainment.append(sum(met) / max(len(met), 1))
    row.in_high.append(sum(in_high) / max(len(in_high), 1))
    row.high_tpot_ms.append(p90(high_tpot) * 1e3)
    row.server_seconds.append(served.server_seconds(duration))
    row.failed.append(len(served.run.failed))
    row.decisions.append(", ".join(d.split(":")[0].removeprefix("scale ")
                                   for d in served.decisions) or "-")


def best_fixed(rows: dict[str, Row], goal: float) -> str:
    """The strongest fixed baseline: the smallest size whose median high-phase attainment meets
    ``goal``, else the size with the best median attainment (the first, smallest, on a tie)."""
    fixed = [name for name in rows if name != AUTO]
    meeting = [name for name in fixed if statistics.median(rows[name].in_high) >= goal]
    if meeting:
        return meeting[0]
    return max(fixed, key=lambda name: statistics.median(rows[name].attainment))


def plot(last: list[Served], duration: float, high_phase: tuple[float, float], tpot: float,
         args: argparse.Namespace) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), dpi=110, sharex=True)
    for served in last:
        xs, ys = [], []
        for a in range(0, int(duration), 5):
            tp = [r[2] for r in served.requests() if a <= r[0] < a + 5]
            xs.append(a + 2.5)
            ys.append(1e3 * statistics.median(tp) if tp else float("nan"))
        top.plot(xs, ys, label=served.name)
        bottom.step([t for t, _, _ in served.servers], [n for _, _, n in served.servers],
                    where="post", label=served.name)
    top.axhline(tpot * 1e3, color="gray", linestyle=":", linewidth=1)
    top.set_ylabel("TPOT ms (median)")
    top.legend(fontsize=8)
    bottom.set_ylabel("expert-server processes")
    bottom.set_xlabel("seconds")
    for ax in (top, bottom):
        ax.axvspan(*high_phase, color="orange", alpha=0.1)
    top.set_title(f"load step {args.low} -> {args.high} -> {args.after} streams (shaded); "
                  "last run")
    save_figure(fig, args.out.with_suffix(".png"))


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    duration = args.low_s + args.high_s + args.after_s
    high_phase = (args.low_s, args.low_s + args.high_s)
    sizes = list(range(args.min_servers, args.max_servers + 1))
    rows: dict[str, Row] = {}
    targets: tuple[float, float] | None = None
    small_tpot: tuple[float, float] = (0.0, 0.0)
    last: list[Served] = []
    try:
        for run in range(args.runs):
            last = []
            for n in sizes:
                name = f"fixed {n}"
                served = serve(f"run {run + 1}/{args.runs}, {name}", model,
                               ["--eaas-expert-servers", f"local:{n}"], args, vocab,
                               args.log_dir / f"bench-autoscale-fixed{n}.log")
                served.name = name
                if targets is None:  # the first run's smallest tier sets the targets
                    low = [r for r in served.requests() if r[0] < args.low_s]
                    high = [r for r in served.requests()
                            if high_phase[0] + 5 <= r[0] < high_phase[1]]
                    if not low or not high:
                        print("bench: error: the smallest tier finished no request in a phase",
                              file=sys.stderr)
                        return 1
                    small_tpot = (p90([r[2] for r in low]), p90([r[2] for r in high]))
                    targets = (max(1.0, 4 * p90([r[1] for r in low])),
                               small_tpot[0] / SLACK_SHARE)
                    say(f"targets: TTFT <= {targets[0]:.2f} s, TPOT <= "
                        f"{targets[1] * 1e3:.0f} ms")
                judge(served, rows, high_phase, targets, duration)
                last.append(served)
            served = serve(f"run {run + 1}/{args.runs}, {AUTO}", model, [
                "--eaas-expert-servers", f"local:{args.min_servers}", "--eaas-autoscale",
                "--eaas-autoscale-ttft", f"{targets[0]:.3f}",
                "--eaas-autoscale-tpot", f"{targets[1]:.4f}",
                "--eaas-autoscale-window", f"{args.window:g}",
                "--eaas-autoscale-cooldown", f"{args.cooldown:g}",
                "--eaas-autoscale-min-servers", str(args.min_servers),
                "--eaas-autoscale-max-servers", str(args.max_servers)],
                args, vocab, args.log_dir / "bench-autoscale-auto.log")
            served.name = AUTO
            judge(served, rows, high_phase, targets, duration)
            last.append(served)
    except ServerError as exc:
        print(f"bench: error: SGLang failed to start: {exc}", file=sys.stderr)
        return 1

    write_report(report, rows, targets, small_tpot, args, model.name, sizes)
    plot(last, duration, high_phase, targets[1], args)
    report.save()
    return 0


def write_report(report: Report, rows: dict[str, Row], targets: tuple[float, float],
                 small_tpot: tuple[float, float], args: argparse.Namespace, model_name: str,
                 sizes: list[int]) -> None:
    ttft, tpot = targets
    fair = small_tpot[1] > tpot
    best = best_fixed(rows, args.attainment)
    report.add(
        f"Setup: bench checkpoint `{model_name}`; SGLang --eaas; a closed loop of {args.low} "
        f"stream(s) for {args.low_s:.0f} s, {args.high} for {args.high_s:.0f} s, {args.after} "
        f"for {args.after_s:.0f} s ({args.input_len} prompt tokens, {args.output_len} output "
        f"tokens per request); targets from the first run's fixed {sizes[0]}-server tier's "
        f"low-load p90s: TTFT <= {ttft:.2f} s, TPOT <= {tpot * 1e3:.0f} ms (its p90 TPOT at "
        f"high load: {small_tpot[1] * 1e3:.0f} ms, {'above' if fair else 'NOT above'} the "
        f"target); autoscaler window {args.window:g} s, cooldown {args.cooldown:g} s, "
        f"{args.min_servers}-{args.max_servers} servers. Server-seconds count every "
        f"expert-server process from its start to its exit. Median [min-max] of {args.runs} "
        f"runs. The strongest fixed baseline is **{best}** (the smallest whose high-phase "
        f"attainment meets the goal of {args.attainment:.0%}, else the best attainment).")
    lines = ["| tier | SLO attainment | during the high load | p90 TPOT ms, high load | "
             f"server-seconds | vs {best} | failed | decisions (per run) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    base = statistics.median(rows[best].server_seconds)
    for name, row in rows.items():
        lines.append(
            f"| {name} | {spread([100 * a for a in row.attainment], '.0f', '%')} | "
            f"{spread([100 * a for a in row.in_high], '.0f', '%')} | "
            f"{spread(row.high_tpot_ms, '.0f')} | {spread(row.server_seconds, '.0f')} | "
            f"{spread([s / base for s in row.server_seconds], '.2f', 'x')} | "
            f"{spread(row.failed, '.0f')} | {'; '.join(row.decisions)} |")
    report.add("\n".join(lines))
    auto = rows[AUTO]
    verdicts = []
    for name, row in rows.items():
        if name == AUTO:
            continue
        seconds = statistics.median(auto.server_seconds) / statistics.median(row.server_seconds)
        gained = statistics.median(auto.attainment) - statistics.median(row.attainment)
        verdicts.append(f"- against {name}{' (the strongest)' if name == best else ''}: "
                        f"{seconds:.2f}x the server-seconds, SLO attainment {100 * gained:+.0f} "
                        "points")
    report.add("The autoscaler, medians against each fixed size:\n" + "\n".join(verdicts))


if __name__ == "__main__":
    sys.exit(main())
