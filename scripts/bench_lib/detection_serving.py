"""Heartbeats with SGLang in the loop (``bench_faults.py --hog --sglang``): the cadence of every
member's presence at the monitor while SGLang serves, quiet and on a loaded host, and what the
failure detector made of it.

The setup of issue 34's report: a monitor with the product's default timings (in this process,
so it sees every gap between two heartbeats), two expert servers each holding every expert of
the bench checkpoint, and ``python -m sglang.launch_server --eaas`` with its default flags
reaching them through the monitor, serving ``concurrency`` closed loops of greedy streaming
requests. Nothing fails: every suspicion and every loss in a window is false. For each window:
failed requests, decode throughput, suspicions and losses, the longest gap between two
heartbeats of any server and of the SGLang rank (the client), the share more than twice the
period late, and how many gaps were longer than the one-stage loss timeout of before (0.6 s:
each would have been a false loss) and than today's suspect timeout.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_eaas import cpu_runtime, envs
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.membership import SUSPECT_TIMEOUT
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.monitor import CLIENT, SERVER
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer

from bench_lib.report import say, spread
from bench_lib.streams import closed_loop, throughput

ONE_STAGE_LOSS = 0.6  # the embedded monitor's loss timeout before issue 34
INPUT_LEN, OUTPUT_LEN = 16, 128


@dataclass
class Window:
    """One window of serving under one condition (nothing failed in it)."""

    failed_requests: int = 0
    tokens_per_s: float = 0.0
    suspicions: int = 0
    losses: int = 0
    gap_ms: dict[str, int] = field(default_factory=dict)  # longest, by kind of member
    late_share: dict[str, float] = field(default_factory=dict)  # > 2 periods, by kind
    over_one_stage: int = 0  # gaps > ONE_STAGE_LOSS, any member
    over_suspect: int = 0  # gaps > SUSPECT_TIMEOUT, any member


class _Gaps:
    """Every gap between two heartbeats the monitor sees while ``recording`` is set."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seen: list[tuple[str, float]] = []
        self.recording = False

    def __call__(self, kind: str, member: str, gap: float) -> None:
        if self.recording:
            with self.lock:
                self.seen.append((kind, gap))

    def take(self) -> list[tuple[str, float]]:
        with self.lock:
            seen, self.seen = self.seen, []
        return seen


def serve(model: Path, conditions: dict, runs: int, window: float, concurrency: int,
          log_dir: Path) -> dict[str, list[Window]]:
    """``conditions``: name -> a context manager that makes it (a ``Hog``, or None: quiet).
    Starts the tier once, then for each run every condition in turn, a ``window`` each."""
    info = MoeModelInfo.from_model_path(model)
    monitor = MonitorServer(MonitorConfig(token=envs.TOKEN.get())).start()  # the defaults
    gaps = _Gaps()
    monitor.registry.gap_listeners.append(gaps)
    log = open(log_dir / "bench-detection-sglang-servers.log", "w")
    every = list(range(info.num_experts))
    servers, sglang = [], None
    results: dict[str, list[Window]] = {name: [] for name in conditions}
    try:
        servers = start_local_servers(model, [every, every], "bfloat16", max_clients=2,
                                      extra_args=("--monitor", monitor.address), stdout=log)
        base_args = CPU_ARGS if cpu_runtime.is_active() else ()
        say(f"starting SGLang --eaas with the monitor {monitor.address} and 2 expert servers")
        sglang = SGLangServer(model, *base_args, "--eaas", "--eaas-monitor", monitor.address,
                              log_path=log_dir / "bench-detection-sglang.log").start()
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        for run in range(runs):
            for name, make in conditions.items():
                say(f"run {run + 1}/{runs}, {name}: {concurrency} streams for {window:g} s")
                with (make() if make else contextlib.nullcontext()):
                    time.sleep(1.0)  # the condition in force before the window opens
                    results[name].append(_window(sglang.url, monitor, gaps, vocab, window,
                                                 concurrency, seed=run))
    finally:
        if sglang is not None:
            sglang.stop()
        for server in servers:
            server.stop()
        monitor.close()
        log.close()
    return results


def _window(url: str, monitor: MonitorServer, gaps: _Gaps, vocab: int, window: float,
            concurrency: int, seed: int) -> Window:
    rngs = [random.Random(seed * 1000 + w) for w in range(concurrency)]
    before = dict(monitor.stats().counters)
    gaps.take()
    gaps.recording = True
    run = closed_loop(url, lambda w, n: [rngs[w].randrange(vocab) for _ in range(INPUT_LEN)],
                      OUTPUT_LEN, concurrency, window)
    gaps.recording = False
    after = dict(monitor.stats().counters)
    seen = gaps.take()

    def grew(name: str) -> int:
        return after.get(name, 0) - before.get(name, 0)

    out = Window(failed_requests=len(run.failed), tokens_per_s=throughput(run, 0, window),
                 suspicions=grew("suspicions"),
                 losses=sum(grew(k) for k in after if k.startswith("losses_")),
                 over_one_stage=sum(gap > ONE_STAGE_LOSS for _, gap in seen),
                 over_suspect=sum(gap > SUSPECT_TIMEOUT for _, gap in seen))
    for kind in (SERVER, CLIENT):
        mine = [gap for k, gap in seen if k == kind]
        out.gap_ms[kind] = round(1000 * max(mine, default=0.0))
        out.late_share[kind] = grew(f"{kind}s_heartbeats_late") / max(
            grew(f"{kind}s_heartbeats"), 1)
    return out


def table(results: dict[str, list[Window]]) -> list[str]:
    """One row per condition: median [min-max] of the runs."""
    rows = [
        "| condition | failed requests | decode tok/s | false suspicions | false losses | "
        "longest heartbeat gap, servers / SGLang rank (ms) | heartbeats > 2 periods late, "
        f"servers / SGLang rank | gaps > {ONE_STAGE_LOSS:g} s (one-stage loss before) | "
        f"gaps > {SUSPECT_TIMEOUT:g} s (suspect now) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        def col(get, fmt: str) -> str:
            return spread([get(w) for w in runs], fmt)

        rows.append(
            f"| {name} | {col(lambda w: w.failed_requests, 'd')} | "
            f"{col(lambda w: w.tokens_per_s, '.1f')} | {col(lambda w: w.suspicions, 'd')} | "
            f"{col(lambda w: w.losses, 'd')} | {col(lambda w: w.gap_ms[SERVER], 'd')} / "
            f"{col(lambda w: w.gap_ms[CLIENT], 'd')} | "
            f"{col(lambda w: 100 * w.late_share[SERVER], '.2f')}% / "
            f"{col(lambda w: 100 * w.late_share[CLIENT], '.2f')}% | "
            f"{col(lambda w: w.over_one_stage, 'd')} | {col(lambda w: w.over_suspect, 'd')} |")
    return rows
