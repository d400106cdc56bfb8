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
  and every new server computing tokens; scale-in: to the leaving servers gone;
* **restart**: SGLang stopped and started again with ``--eaas-expert-servers local:4``, from
  the stop to the first token of a request on the new server (the downtime a restart costs);
* throughput and TPOT over time through both changes (plot), failed requests;
* the tier's memory: the expert servers' proportional set size (PSS: shared memory counted
  once across the processes that map it), sampled every 0.25 s: steady state before the
  scale-out, peak during it, steady after.

Goal (issue 21): scale-out >= 9x faster than the restart, zero failed requests; judged on the
scale-out that takes standby servers (ElasticMoE's pre-initialised instances), the cold one
(processes started by the resize) reported next to it.

    python scripts/bench_elastic.py [--concurrency 8] [--duration 75]
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
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.report import ROOT, Report, default_out, pyplot, save_figure, say  # noqa: E402
from bench_lib.streams import Run, closed_loop, throughput  # noqa: E402

from sglang_eaas import cpu_runtime, envs  # noqa: E402
from sglang_eaas.protocol.operations import TOKEN_HEADER  # noqa: E402
from sglang_eaas.protocol.control import probe  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError  # noqa: E402

BIN = 2.0  # seconds per point of the plot


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
            or args.concurrency < 1):
        p.error("need 0 < --out-at < --in-at < --standby-at < --duration and --concurrency "
                ">= 1")
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


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    log = args.log_dir / "bench-elastic.log"
    say(f"starting SGLang --eaas with 2 local expert servers (log: {log})")
    try:
        server = SGLangServer(model, *base, "--eaas", "--eaas-expert-servers", "local:2",
                              log_path=log).start()
    except ServerError as exc:
        print(f"bench: error: SGLang failed to start: {exc}", file=sys.stderr)
        return 1
    admin, events = Admin(server.url), {}
    memory: Memory | None = None
    spares: list[subprocess.Popen] = []
    try:
        def changes(run: Run) -> None:
            nonlocal memory
            memory = Memory(server.process.pid, run.started)
            for at, servers, name in ((args.out_at, 4, "out"), (args.in_at, 2, "in"),
                                      (args.standby_at, 4, "standby")):
                if name == "standby":
                    spares.extend(start_standby(model, admin.tier()["monitor"], 2, log))
                    while len(admin.tier()["standby"]) < 2:
                        time.sleep(0.2)
                    say(f"  two standby servers registered at "
                        f"{time.perf_counter() - run.started:.1f} s")
                time.sleep(max(0.0, run.started + at - time.perf_counter()))
                began = time.perf_counter()
                before = set(admin.tier()["active"])
                op = admin.scale(servers, f"bench-{name}-{os.getpid()}")
                done = time.perf_counter()
                new = set(admin.tier()["active"]) - before
                while any(probe(s, envs.TOKEN.get()).counter("tokens") == 0 for s in new):
                    time.sleep(0.05)
                events[name] = (began - run.started, time.perf_counter() - began,
                                done - began, op)
                say(f"  scale {name} to {servers}: {op['state']} in {done - began:.2f} s, "
                    f"serving after {time.perf_counter() - began:.2f} s: {op['result']}")

        say(f"{args.concurrency} streams for {args.duration:.0f} s; scale out at "
            f"{args.out_at:.0f} s, in at {args.in_at:.0f} s")
        rng = random.Random(1)
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(64)]
        run = closed_loop(server.url, lambda w, n: prompts[(w * 7 + n) % len(prompts)],
                          args.output_len, args.concurrency, args.duration, during=changes)
        memory.stop.set()
    finally:
        say("restart baseline: stopping SGLang, starting it with local:4")
        stopped = time.perf_counter()
        server.stop()
        for spare in spares:
            spare.terminate()
            spare.wait(30)
    try:
        bigger = SGLangServer(model, *base, "--eaas", "--eaas-expert-servers", "local:4",
                              log_path=args.log_dir / "bench-elastic-restart.log")
        bigger.start()
        first_token_after(bigger.url, vocab)
        restart = time.perf_counter() - stopped
    except ServerError as exc:
        print(f"bench: error: the restart failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if "bigger" in locals():
            bigger.stop()

    out_at, out_serving, out_op, _ = events["out"]
    in_at, in_done, _, _ = events["in"]
    standby_at, standby_serving, standby_op, _ = events["standby"]
    steady = statistics.median(memory.between(2, out_at) or [0])
    peak = max(memory.between(out_at, out_at + out_serving + 1) or [0])
    after = statistics.median(memory.between(out_at + out_serving + 2, in_at) or [0])
    report.add(
        f"Setup: bench checkpoint `{model.name}`; SGLang --eaas, local:2 expert servers; "
        f"{args.concurrency} closed-loop streams ({args.input_len} prompt tokens, "
        f"{args.output_len} output tokens) for {args.duration:.0f} s; scale to 4 at "
        f"{args.out_at:.0f} s (servers started by the resize), back to 2 at "
        f"{args.in_at:.0f} s, then two --standby servers started and the tier scaled to 4 at "
        f"{args.standby_at:.0f} s, taking them; all through the admin API.")
    rows = ["| | seconds | vs restart |", "|---|---:|---:|",
            f"| scale out 2 -> 4 taking standby servers, command to every new server "
            f"computing | {standby_serving:.2f} | {restart / standby_serving:.1f}x faster |",
            f"| of which the operation (fill, switch) | {standby_op:.2f} | |",
            f"| scale out 2 -> 4 starting servers, command to every new server computing | "
            f"{out_serving:.2f} | {restart / out_serving:.1f}x faster |",
            f"| of which the operation (start, register, fill, switch) | {out_op:.2f} | |",
            f"| scale in 4 -> 2, command to the leaving servers gone | {in_done:.2f} | |",
            f"| restart with local:4: stop to first token served (downtime) | {restart:.2f} | "
            f"1x |"]
    report.add("\n".join(rows))
    spans = [("before", 2, out_at), ("scale-out", out_at, out_at + out_serving),
             ("4 servers", out_at + out_serving, in_at), ("2 servers again", in_at + in_done,
                                                          standby_at),
             ("scale-out, standby", standby_at, standby_at + standby_serving),
             ("4 servers again", standby_at + standby_serving, args.duration - 1)]
    rows = ["| window | seconds | tokens/s | TPOT ms (median) |", "|---|---|---:|---:|"]
    for name, a, b in spans:
        gaps = [y - x for times in run.arrivals for x, y in zip(times, times[1:])
                if a <= x - run.started < b]
        rows.append(f"| {name} | {a:.1f}-{b:.1f} | {throughput(run, a, b):.1f} | "
                    f"{1e3 * statistics.median(gaps) if gaps else float('nan'):.0f} |")
    report.add("\n".join(rows))
    report.add(f"Tier memory (expert servers' PSS): steady {steady / 2**20:.0f} MiB with 2 "
               f"servers, peak {peak / 2**20:.0f} MiB during the scale-out "
               f"({peak / max(steady, 1):.2f}x), {after / 2**20:.0f} MiB with 4 servers "
               f"(shared weights counted once).")
    failed = len(run.failed)
    ratio = restart / standby_serving
    report.add(f"Goal: scale-out >= 9x faster than a restart with zero failed requests: "
               f"{ratio:.1f}x taking standby servers ({restart / out_serving:.1f}x starting "
               f"them), {failed} failed -> {'met' if ratio >= 9 and not failed else 'NOT met'}.")
    plt = pyplot()
    if plt is not None:
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
            ax.axvline(out_at, color="green", linestyle="--", linewidth=1)
            ax.axvline(in_at, color="red", linestyle="--", linewidth=1)
            ax.axvline(standby_at, color="blue", linestyle="--", linewidth=1)
            ax.set_ylim(bottom=0)
        top.set_title("2 -> 4 expert servers starting them (green), 4 -> 2 (red), 2 -> 4 "
                      "taking standby ones (blue)", fontsize=9)
        save_figure(fig, args.out.with_suffix(".png"))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
