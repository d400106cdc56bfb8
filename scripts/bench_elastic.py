"""Benchmark: resizing the expert tier while SGLang serves, against restarting SGLang with the
larger deployment (what users do today), in the same run (docs/elastic.md).

One SGLang server (--eaas, local:2, the bench checkpoint) under ``--concurrency`` closed-loop
streams. At ``--out-at`` seconds the admin API is asked to scale to 4 expert servers (none is
standby: the launcher starts two), at ``--in-at`` back to 2 (``python -m
sglang_eaas.tools.scale``'s calls); then two ``--standby`` servers are started next to the tier
(as an operator or orchestrator keeps them), and at ``--standby-at`` the tier is scaled to 4
again, taking them. Measured:

* **scale time**: from the command to the new capacity serving: the operation done (servers
  started or standby ones taken, filled from peers over the weight fabric, tables switched)
  and every new server computing tokens; scale-in: to the leaving servers gone. The standby
  servers' own start (spawned to registered, before the command) is shown on its own row;
* **the dip**: SGLang serves throughout, but slower while the tier changes: for each scale-out,
  the lowest 1 s throughput from the command to 2 s after the new servers compute, as a share
  of the median 1 s throughput of the 10 s before (depth), and the tokens not served against
  that rate over the same span (area);
* **restart**, the strongest baseline: SGLang with ``--eaas-expert-servers local:4`` started
  from nothing (the old one already gone) to the first token of a request: the downtime of a
  restart whose shutdown costs nothing. How long the old server's SIGTERM shutdown took is
  shown apart, not charged to the restart;
* throughput and TPOT over time through both changes (plot, last run), failed requests;
* the tier's memory: the expert servers' proportional set size (PSS: shared memory counted
  once across the processes that map it), sampled every 0.25 s: steady state before the
  scale-out, peak during it, steady after.

Every number is the median [min-max] of ``--runs`` runs (each a fresh SGLang and restart).
Goal (issue 21): scale-out >= 9x faster than the restart, zero failed requests; judged on the
scale-out that takes standby servers (ElasticMoE's pre-initialised instances), the cold one
(processes started by the resize) reported next to it.

    python scripts/bench_elastic.py [--concurrency 8] [--duration 75] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.report import (  # noqa: E402
    ROOT, Report, default_out, pyplot, save_figure, say, spread,
)
from bench_lib.streams import Run, closed_loop, throughput  # noqa: E402

from sglang_eaas import cpu_runtime, envs  # noqa: E402
from sglang_eaas.protocol.operations import TOKEN_HEADER  # noqa: E402
from sglang_eaas.protocol.control import probe  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError  # noqa: E402

BIN = 2.0  # seconds per point of the plot
COMPUTE_WAIT = 30.0  # seconds after the load ends that new servers may take to compute


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each run is two SGLang starts and --duration seconds of load: about 4 minutes "
        "on 2 CPU cores, 12 with the default 3 runs. Run it on an otherwise idle machine.")
    p.add_argument("--runs", type=int, default=3, help="runs; default %(default)s")
    p.add_argument("--concurrency", type=int, default=8, help="streams; default %(default)s")
    p.add_argument("--duration", type=float, default=75.0,
                   help="seconds of load; default %(default)s")
    p.add_argument("--out-at", type=float, default=15.0,
                   help="seconds into the load to scale 2 -> 4, starting servers; default "
                   "%(default)s")
    p.add_argument("--in-at", type=float, default=35.0,
                   help="seconds into the load to scale 4 -> 2 (then two standby servers are "
                   "started); default %(default)s")
    p.add_argument("--standby-at", type=float, default=55.0,
                   help="seconds into the load to scale 2 -> 4 again, taking the standby "
                   "servers; default %(default)s")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens; default %(default)s")
    p.add_argument("--output-len", type=int, default=64,
                   help="output tokens per request; default %(default)s")
    p.add_argument("--out", type=Path, default=default_out("elastic"),
                   help="markdown report; default %(default)s")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs")
    args = p.parse_args()
    if (not 0 < args.out_at < args.in_at < args.standby_at < args.duration
            or args.concurrency < 1 or args.runs < 1):
        p.error("need 0 < --out-at < --in-at < --standby-at < --duration, --concurrency >= 1 "
                "and --runs >= 1")
    return args


class Admin:
    def __init__(self, url: str):
        self.url, self.headers = url, {TOKEN_HEADER: envs.TOKEN.get()}

    def tier(self) -> dict:
        return requests.get(f"{self.url}/eaas/tier", headers=self.headers, timeout=30).json()

    def scale(self, servers: int, op_id: str) -> dict:
        op = requests.post(f"{self.url}/eaas/scale", json={"servers": servers, "id": op_id},
                           headers=self.headers, timeout=30).json()
        while op.get("state") in ("pending", "running"):
            time.sleep(0.05)
            op = requests.get(f"{self.url}/eaas/operations/{op_id}", headers=self.headers,
                              timeout=30).json()
        return op


class Memory:
    """The expert servers' PSS, sampled on a thread: (seconds into the run, bytes)."""

    def __init__(self, root_pid: int, started: float):
        self.root, self.started = psutil.Process(root_pid), started
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for child in self.root.children(recursive=True):
                try:
                    if "sglang_eaas.expert_server" in " ".join(child.cmdline()):
                        total += child.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            self.samples.append((time.perf_counter() - self.started, total))
            time.sleep(0.25)

    def between(self, a: float, b: float) -> list[int]:
        return [m for t, m in self.samples if a <= t < b]


def start_standby(model: Path, monitor: str, count: int, log: Path) -> list[subprocess.Popen]:
    """``count`` ``--standby`` expert servers registering with ``monitor`` (the token from the
    environment), as an operator would start them next to a running tier."""
    with open(log, "ab") as out:  # each child has its own descriptor of it
        return [subprocess.Popen([sys.executable, "-m", "sglang_eaas.expert_server",
                                  "--standby", "--model-path", str(model), "--monitor", monitor],
                                 stdout=out, stderr=subprocess.STDOUT) for _ in range(count)]


def first_token_after(url: str, vocab: int) -> float:
    """Seconds until one request's first token comes back (polling until the server is up)."""
    began = time.perf_counter()
    body = {"input_ids": [random.randrange(vocab) for _ in range(16)],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    while True:
        try:
            if requests.post(f"{url}/generate", json=body, timeout=60).ok:
                return time.perf_counter() - began
        except requests.RequestException:
            pass
        time.sleep(0.1)


def dip(run: Run, at: float, until: float) -> tuple[float, float]:
    """(depth, area) of the throughput dip of a change made at ``at`` and serving at ``until``:
    the lowest 1 s window's throughput in [at, until + 2) over the median 1 s window of the
    10 s before (1.0: no dip), and the tokens not served against that median rate over the
    same span."""
    before = [throughput(run, t / 10, t / 10 + 1)
              for t in range(int(max(0.0, at - 10) * 10), int((at - 1) * 10))]
    rate = statistics.median(before) if before else 0.0
    steps = [throughput(run, t / 10, t / 10 + 1)
             for t in range(int(at * 10), int((until + 2) * 10) - 9)] or [rate]
    lost = max(0.0, rate * (until + 2 - at) - throughput(run, at, until + 2) * (until + 2 - at))
    return (min(steps) / rate if rate else float("nan")), lost


@dataclass
class Measured:
    """One run's numbers (seconds unless named)."""

    standby_start: float = 0.0  # spawned to both registered, before the command
    standby_serving: float = 0.0  # command to every new server computing
    standby_op: float = 0.0
    out_serving: float = 0.0
    out_op: float = 0.0
    in_done: float = 0.0
    restart: float = 0.0  # start to first token, the old one already gone
    shutdown: float = 0.0  # the old server's SIGTERM shutdown, not charged
    depth_out: float = 0.0
    area_out: float = 0.0
    depth_standby: float = 0.0
    area_standby: float = 0.0
    failed: int = 0
    memory: tuple[float, float, float] = (0.0, 0.0, 0.0)  # steady 2, peak, steady 4 (bytes)
    windows: list[tuple[str, float, float, float, float]] = field(default_factory=list)
    run: Run | None = None
    events: dict = field(default_factory=dict)


def one_run(args: argparse.Namespace, model: Path, vocab: int, base: tuple) -> Measured:
    log = args.log_dir / "bench-elastic.log"
    say(f"starting SGLang --eaas with 2 local expert servers (log: {log})")
    server = SGLangServer(model, *base, "--eaas", "--eaas-expert-servers", "local:2",
                          log_path=log).start()
    admin, events, out, missing = Admin(server.url), {}, Measured(), []
    memory: Memory | None = None
    spares: list[subprocess.Popen] = []
    try:
        def changes(run: Run) -> None:
            nonlocal memory
            memory = Memory(server.process.pid, run.started)
            for at, servers, name in ((args.out_at, 4, "out"), (args.in_at, 2, "in"),
                                      (args.standby_at, 4, "standby")):
                if name == "standby":
                    spawned = time.perf_counter()
                    spares.extend(start_standby(model, admin.tier()["monitor"], 2, log))
                    while len(admin.tier()["standby"]) < 2:
                        time.sleep(0.2)
                    out.standby_start = time.perf_counter() - spawned
                    say(f"  two standby servers registered {out.standby_start:.1f} s after "
                        "they were spawned")
                time.sleep(max(0.0, run.started + at - time.perf_counter()))
                began = time.perf_counter()
                before = set(admin.tier()["active"])
                op = admin.scale(servers, f"bench-{name}-{os.getpid()}-{began:.0f}")
                done = time.perf_counter()
                new = set(admin.tier()["active"]) - before
                bound = run.started + args.duration + COMPUTE_WAIT
                while any(probe(s, envs.TOKEN.get()).counter("tokens") == 0 for s in new):
                    if time.perf_counter() > bound:
                        missing.append(f"scale {name}: new servers {sorted(new)} computed no "
                                       f"token within {COMPUTE_WAIT:g} s after the load ended")
                        return
                    time.sleep(0.05)
                events[name] = (began - run.started, time.perf_counter() - began,
                                done - began, op)
                say(f"  scale {name} to {servers}: {op['state']} in {done - began:.2f} s, "
                    f"serving after {time.perf_counter() - began:.2f} s: {op['result']}")

        say(f"{args.concurrency} streams for {args.duration:.0f} s; scale out at "
            f"{args.out_at:.0f} s, in at {args.in_at:.0f} s, out taking standby servers at "
            f"{args.standby_at:.0f} s")
        rng = random.Random(1)
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(64)]
        run = closed_loop(server.url, lambda w, n: prompts[(w * 7 + n) % len(prompts)],
                          args.output_len, args.concurrency, args.duration, during=changes)
        memory.stop.set()
    finally:
        say("restart baseline: stopping SGLang, then starting it with local:4")
        stopping = time.perf_counter()
        server.stop()
        out.shutdown = time.perf_counter() - stopping
        for spare in spares:
            spare.terminate()
            spare.wait(30)
    bigger = SGLangServer(model, *base, "--eaas", "--eaas-expert-servers", "local:4",
                          log_path=args.log_dir / "bench-elastic-restart.log")
    try:
        starting = time.perf_counter()
        bigger.start()
        first_token_after(bigger.url, vocab)
        out.restart = time.perf_counter() - starting
    finally:
        bigger.stop()
    if set(events) != {"out", "in", "standby"}:
        raise RuntimeError("; ".join(missing) or f"only the changes {sorted(events)} happened "
                           "within the run: give a longer --duration")
    out_at, out.out_serving, out.out_op, _ = events["out"]
    in_at, out.in_done, _, _ = events["in"]
    standby_at, out.standby_serving, out.standby_op, _ = events["standby"]
    out.depth_out, out.area_out = dip(run, out_at, out_at + out.out_serving)
    out.depth_standby, out.area_standby = dip(run, standby_at, standby_at + out.standby_serving)
    out.failed = len(run.failed)
    out.memory = (statistics.median(memory.between(2, out_at) or [0]),
                  max(memory.between(out_at, out_at + out.out_serving + 1) or [0]),
                  statistics.median(memory.between(out_at + out.out_serving + 2, in_at) or [0]))
    spans = [("before", 2, out_at), ("scale-out", out_at, out_at + out.out_serving),
             ("4 servers", out_at + out.out_serving, in_at),
             ("2 servers again", in_at + out.in_done, standby_at),
             ("scale-out, standby", standby_at, standby_at + out.standby_serving),
             ("4 servers again", standby_at + out.standby_serving, args.duration - 1)]
    for name, a, b in spans:
        gaps = [y - x for times in run.arrivals for x, y in zip(times, times[1:])
                if a <= x - run.started < b]
        out.windows.append((name, a, b, throughput(run, a, b),
                            1e3 * statistics.median(gaps) if gaps else float("nan")))
    out.run, out.events = run, events
    return out


def plot(last: Measured, args: argparse.Namespace) -> None:
    plt = pyplot()
    if plt is None:
        return
    run = last.run
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), dpi=110, sharex=True)
    edges = [i * BIN for i in range(int(args.duration / BIN))]
    top.plot([e + BIN / 2 for e in edges], [throughput(run, e, e + BIN) for e in edges])
    top.set_ylabel("decode tokens/s")
    tpot = []
    for e in edges:
        gaps = [y - x for times in run.arrivals for x, y in zip(times, times[1:])
                if e <= x - run.started < e + BIN]
        tpot.append(1e3 * statistics.median(gaps) if gaps else float("nan"))
    bottom.plot([e + BIN / 2 for e in edges], tpot)
    bottom.set_ylabel("TPOT ms")
    bottom.set_xlabel("seconds")
    for ax in (top, bottom):
        for name, color in (("out", "green"), ("in", "red"), ("standby", "blue")):
            ax.axvline(last.events[name][0], color=color, linestyle="--", linewidth=1)
        ax.set_ylim(bottom=0)
    top.set_title("2 -> 4 expert servers starting them (green), 4 -> 2 (red), 2 -> 4 "
                  "taking standby ones (blue); last run", fontsize=9)
    save_figure(fig, args.out.with_suffix(".png"))


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    runs: list[Measured] = []
    try:
        for n in range(args.runs):
            say(f"run {n + 1}/{args.runs}")
            runs.append(one_run(args, model, vocab, base))
    except ServerError as exc:
        print(f"bench: error: SGLang failed to start: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 1

    write_report(report, runs, args, model.name)
    plot(runs[-1], args)
    report.save()
    return 0


def write_report(report: Report, runs: list[Measured], args: argparse.Namespace,
                 model_name: str) -> None:
    def col(name: str, fmt: str = ".2f") -> str:
        return spread([getattr(r, name) for r in runs], fmt)

    def faster(name: str) -> str:
        return spread([r.restart / getattr(r, name) for r in runs], ".1f", "x") + " faster"

    report.add(
        f"Setup: bench checkpoint `{model_name}`; SGLang --eaas, local:2 expert servers; "
        f"{args.concurrency} closed-loop streams ({args.input_len} prompt tokens, "
        f"{args.output_len} output tokens) for {args.duration:.0f} s; scale to 4 at "
        f"{args.out_at:.0f} s (servers started by the resize), back to 2 at "
        f"{args.in_at:.0f} s, then two --standby servers started and the tier scaled to 4 at "
        f"{args.standby_at:.0f} s, taking them; all through the admin API. Median [min-max] "
        f"of {args.runs} runs.")
    rows = ["| | seconds | vs restart |", "|---|---:|---:|",
            f"| standby servers' own start, spawned to registered (before the command) | "
            f"{col('standby_start')} | |",
            f"| scale out 2 -> 4 taking standby servers, command to every new server "
            f"computing | {col('standby_serving')} | {faster('standby_serving')} |",
            f"| of which the operation (fill, switch) | {col('standby_op')} | |",
            f"| scale out 2 -> 4 starting servers, command to every new server computing | "
            f"{col('out_serving')} | {faster('out_serving')} |",
            f"| of which the operation (start, register, fill, switch) | {col('out_op')} | |",
            f"| scale in 4 -> 2, command to the leaving servers gone | {col('in_done')} | |",
            f"| restart with local:4: start to first token served (the old one gone; its "
            f"shutdown not counted) | {col('restart')} | 1x |",
            f"| the old server's SIGTERM shutdown (not charged to the restart) | "
            f"{col('shutdown')} | |"]
    report.add("\n".join(rows))
    report.add("\n".join([
        "The dip while SGLang serves through a scale-out (depth: the lowest 1 s throughput "
        "over the 10 s before the command; area: tokens not served against that rate, from "
        "the command to 2 s after every new server computes):", "",
        "| scale-out | depth | area (tokens) |", "|---|---:|---:|",
        f"| starting servers | {spread([r.depth_out for r in runs], '.2f')} | "
        f"{spread([r.area_out for r in runs], '.0f')} |",
        f"| taking standby servers | {spread([r.depth_standby for r in runs], '.2f')} | "
        f"{spread([r.area_standby for r in runs], '.0f')} |"]))
    rows = ["| window | tokens/s | TPOT ms (median) |", "|---|---:|---:|"]
    for i, (name, *_rest) in enumerate(runs[0].windows):
        rows.append(f"| {name} | {spread([r.windows[i][3] for r in runs], '.1f')} | "
                    f"{spread([r.windows[i][4] for r in runs], '.0f')} |")
    report.add("\n".join(rows))
    report.add(
        f"Tier memory (expert servers' PSS, shared weights counted once): steady "
        f"{spread([r.memory[0] / 2**20 for r in runs], '.0f')} MiB with 2 servers, peak "
        f"{spread([r.memory[1] / 2**20 for r in runs], '.0f')} MiB during the scale-out "
        f"({spread([r.memory[1] / max(r.memory[0], 1) for r in runs], '.2f')}x), "
        f"{spread([r.memory[2] / 2**20 for r in runs], '.0f')} MiB with 4 servers.")
    ratio = statistics.median([r.restart / r.standby_serving for r in runs])
    failed = sum(r.failed for r in runs)
    report.add(f"Goal: scale-out >= 9x faster than a restart with zero failed requests: "
               f"{ratio:.1f}x (median) taking standby servers, {failed} failed in "
               f"{args.runs} runs -> {'met' if ratio >= 9 and not failed else 'NOT met'}.")


if __name__ == "__main__":
    sys.exit(main())
