"""Benchmark: a load step served with the autoscaler on, against a fixed small and a fixed large
expert tier, in the same run (docs/elastic.md, "Autoscaler").

Three SGLang servers (--eaas, the bench checkpoint), one after the other, each under the same
stepped closed loop of streaming requests: ``--low`` streams for ``--low-s`` seconds, then
``--high`` streams for ``--high-s``, then ``--tail`` streams (none by default: the burst is
over) for ``--tail-s``:

* **fixed small**: ``--eaas-expert-servers local:2``;
* **fixed large**: ``local:4``;
* **autoscaled**: ``local:2`` with ``--eaas-autoscale`` (window ``--window`` s, cooldown
  ``--cooldown`` s, between 2 and 4 servers, ``act resize``: the resize starts servers).

The SLO targets are set from the fixed small tier's run, made first: the TPOT target is its
p90 time per output token at low load over 0.45 (so that low load is slack for the policy,
whose scale-in needs p90 <= 0.5x the targets), the TTFT target 4x its p90 time to first token
at low load (at least 1 s): TPOT decides. The step tests the autoscaler when the small tier's
p90 TPOT at high load is above the target; the report says whether it is. Measured per tier:
SLO attainment (finished requests meeting both targets, by when they were sent) overall and
during the high phase; server-seconds (active expert servers, sampled from the admin API
every 0.5 s, integrated over the run); the autoscaler's decisions (its log lines); failed
requests.

    python scripts/bench_autoscale.py [--low 1] [--high 8]
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

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.report import ROOT, Report, default_out, pyplot, save_figure, say  # noqa: E402
from bench_lib.streams import Run, closed_loop  # noqa: E402

from sglang_eaas import cpu_runtime, envs  # noqa: E402
from sglang_eaas.protocol.operations import TOKEN_HEADER  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError  # noqa: E402

SLACK_SHARE = 0.45  # low load's p90 TPOT as a share of the target: under the policy's 0.5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--low", type=int, default=1, help="streams at low load; default %(default)s")
    p.add_argument("--high", type=int, default=8,
                   help="streams at high load; default %(default)s")
    p.add_argument("--low-s", type=float, default=20.0,
                   help="seconds of low load first; default %(default)s")
    p.add_argument("--high-s", type=float, default=40.0,
                   help="seconds of high load; default %(default)s")
    p.add_argument("--tail", type=int, default=0,
                   help="streams after the high load; default %(default)s")
    p.add_argument("--tail-s", type=float, default=40.0,
                   help="seconds after the high load; default %(default)s")
    p.add_argument("--window", type=float, default=5.0,
                   help="the autoscaler's --eaas-autoscale-window; default %(default)s")
    p.add_argument("--cooldown", type=float, default=15.0,
                   help="the autoscaler's --eaas-autoscale-cooldown; default %(default)s")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens; default %(default)s")
    p.add_argument("--output-len", type=int, default=32,
                   help="output tokens per request; default %(default)s")
    p.add_argument("--out", type=Path, default=default_out("autoscale"),
                   help="markdown report; default %(default)s")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs")
    args = p.parse_args()
    if (not 1 <= args.low < args.high or not 0 <= args.tail <= args.high
            or min(args.low_s, args.high_s, args.tail_s) <= 0):
        p.error("need 1 <= --low < --high, 0 <= --tail <= --high and positive phase lengths")
    return args


@dataclass
class Served:
    """One tier's run: the requests, the active server count over time, the decisions."""

    name: str
    run: Run
    servers: list[tuple[float, int]] = field(default_factory=list)  # (seconds, active)
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
        total, points = 0.0, self.servers + [(duration, self.servers[-1][1])]
        for (t0, n), (t1, _) in zip(points, points[1:]):
            total += n * (min(t1, duration) - t0)
        return total


def p90(values: list[float]) -> float:
    return float(statistics.quantiles(values, n=10)[-1]) if len(values) > 1 else (
        values[0] if values else float("nan"))


def serve(name: str, model: Path, flags: list[str], args: argparse.Namespace, vocab: int,
          log: Path) -> Served:
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    say(f"{name}: starting SGLang {' '.join(flags)} (log: {log})")
    server = SGLangServer(model, *base, "--eaas", *flags, log_path=log).start()
    headers = {TOKEN_HEADER: envs.TOKEN.get()}
    duration = args.low_s + args.high_s + args.tail_s
    rng = random.Random(1)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(64)]

    def active(worker: int, seconds: float) -> bool:
        if seconds < args.low_s:
            return worker < args.low
        return worker < (args.high if seconds < args.low_s + args.high_s else args.tail)

    served: Served | None = None
    samples: list[tuple[float, int]] = []

    def watch(run: Run) -> None:
        while time.perf_counter() - run.started < duration:
            try:
                tier = requests.get(f"{server.url}/eaas/tier", headers=headers, timeout=10)
                samples.append((time.perf_counter() - run.started, len(tier.json()["active"])))
            except (requests.RequestException, ValueError, KeyError):
                pass
            time.sleep(0.5)

    try:
        run = closed_loop(server.url, lambda w, n: prompts[(w * 7 + n) % len(prompts)],
                          args.output_len, args.high, duration, during=watch, active=active)
        served = Served(name, run, samples)
    finally:
        server.stop()
    served.decisions = [line.split("] eaas autoscaler: ", 1)[1].strip()
                        for line in log.read_text(errors="replace").splitlines()
                        if "] eaas autoscaler: scale " in line]
    say(f"{name}: {len(run.finished)} requests, {len(run.failed)} failed, "
        f"{len(served.decisions)} decisions")
    return served


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    duration = args.low_s + args.high_s + args.tail_s
    high_phase = (args.low_s, args.low_s + args.high_s)
    logs = args.log_dir
    try:
        small = serve("fixed small", model, ["--eaas-expert-servers", "local:2"], args, vocab,
                      logs / "bench-autoscale-small.log")
        low = [r for r in small.requests() if r[0] < args.low_s]
        high = [r for r in small.requests() if high_phase[0] + 5 <= r[0] < high_phase[1]]
        if not low or not high:
            print("bench: error: the small tier finished no request in a phase", file=sys.stderr)
            return 1
        tpot = p90([r[2] for r in low]) / SLACK_SHARE
        ttft = max(1.0, 4 * p90([r[1] for r in low]))
        say(f"targets: TTFT <= {ttft:.2f} s, TPOT <= {tpot * 1e3:.0f} ms (small tier: p90 TPOT "
            f"{p90([r[2] for r in low]) * 1e3:.0f} ms at low load, "
            f"{p90([r[2] for r in high]) * 1e3:.0f} ms at high load)")
        large = serve("fixed large", model, ["--eaas-expert-servers", "local:4"], args, vocab,
                      logs / "bench-autoscale-large.log")
        auto = serve("autoscaled", model, [
            "--eaas-expert-servers", "local:2", "--eaas-autoscale",
            "--eaas-autoscale-ttft", f"{ttft:.3f}", "--eaas-autoscale-tpot", f"{tpot:.4f}",
            "--eaas-autoscale-window", f"{args.window:g}",
            "--eaas-autoscale-cooldown", f"{args.cooldown:g}",
            "--eaas-autoscale-min-servers", "2", "--eaas-autoscale-max-servers", "4"],
            args, vocab, logs / "bench-autoscale-auto.log")
    except ServerError as exc:
        print(f"bench: error: SGLang failed to start: {exc}", file=sys.stderr)
        return 1

    fair = p90([r[2] for r in high]) > tpot
    report.add(
        f"Setup: bench checkpoint `{model.name}`; SGLang --eaas; a closed loop of {args.low} "
        f"stream(s) for {args.low_s:.0f} s, {args.high} for {args.high_s:.0f} s, {args.tail} "
        f"for {args.tail_s:.0f} s ({args.input_len} prompt tokens, {args.output_len} output "
        f"tokens per request); targets from the fixed small tier's low-load p90s: TTFT <= "
        f"{ttft:.2f} s, TPOT <= {tpot * 1e3:.0f} ms (its p90 TPOT at high load: "
        f"{p90([r[2] for r in high]) * 1e3:.0f} ms, "
        f"{'above' if fair else 'NOT above'} the target); autoscaler window {args.window:g} s, "
        f"cooldown {args.cooldown:g} s, 2-4 servers.")
    rows = ["| tier | SLO attainment | during the high load | p90 TPOT ms, high load | "
            "server-seconds | vs fixed large | failed | decisions |",
            "|---|---:|---:|---:|---:|---:|---:|---|"]
    changes = [(t, n) for (t, n), (_, before) in zip(auto.servers[1:], auto.servers)
               if n != before]
    biggest = large.server_seconds(duration)
    for served in (small, large, auto):
        reqs = served.requests()
        met = [r[1] <= ttft and r[2] <= tpot for r in reqs]
        in_high = [m for r, m in zip(reqs, met) if high_phase[0] <= r[0] < high_phase[1]]
        high_tpot = [r[2] for r in reqs if high_phase[0] + 5 <= r[0] < high_phase[1]]
        seconds = served.server_seconds(duration)
        rows.append(
            f"| {served.name} | {sum(met) / max(len(met), 1):.0%} | "
            f"{sum(in_high) / max(len(in_high), 1):.0%} | {p90(high_tpot) * 1e3:.0f} | "
            f"{seconds:.0f} | {seconds / biggest:.2f}x | {len(served.run.failed)} | "
            f"{', '.join(d.split(':')[0].removeprefix('scale ') for d in served.decisions) or '-'}"
            f" |")
    report.add("\n".join(rows))
    report.add("The autoscaled tier's active servers changed at: " + (", ".join(
        f"{t:.0f} s -> {n}" for t, n in changes) or "never") + ". Its decisions, as logged:\n\n"
        + "\n".join(f"- {d}" for d in auto.decisions or ["none"]))
    plt = pyplot()
    if plt is not None:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), dpi=110, sharex=True)
        for served in (small, large, auto):
            xs, ys = [], []
            for a in range(0, int(duration), 2):
                tp = [r[2] for r in served.requests() if a <= r[0] < a + 2]
                xs.append(a + 1)
                ys.append(1e3 * statistics.median(tp) if tp else float("nan"))
            top.plot(xs, ys, label=served.name)
            bottom.step([t for t, _ in served.servers], [n for _, n in served.servers],
                        where="post", label=served.name)
        top.axhline(tpot * 1e3, color="gray", linestyle=":", linewidth=1)
        top.set_ylabel("TPOT ms (median)")
        top.legend(fontsize=8)
        bottom.set_ylabel("active expert servers")
        bottom.set_xlabel("seconds")
        for ax in (top, bottom):
            ax.axvspan(*high_phase, color="orange", alpha=0.1)
        top.set_title(f"load step {args.low} -> {args.high} -> {args.tail} streams (shaded)")
        save_figure(fig, args.out.with_suffix(".png"))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
