"""The failure detector's table (``bench_faults.py --hog``): how soon a fault is seen against how
often a healthy member is taken for a failed one, quiet and with the cores saturated.

One tier per measurement, in this process: a TCP monitor with the timings measured, four expert
server processes (each expert on three), one of them reaching the monitor through a
``Partition`` relay, and an attention client (``EaasClient``) stepping every MoE layer on a
thread of its own, as SGLang's scheduler does, while its presence heartbeats on another. Each
measurement runs, in order:

1. a window with no fault: false suspicions and false losses (any is false: nothing failed),
   the heartbeats' cadence at the monitor (the longest gap of any server's and of the client's,
   and the share of gaps over twice the period), failed rows;
2. kill -9 of one server: seconds until the client has dropped it;
3. SIGSTOP of another: seconds until the client's table routes around it (suspected, lost or
   evicted, whichever comes first), then SIGCONT and seconds until it is back;
4. a partition between the relayed server and the monitor alone: seconds until the monitor
   suspects it and until it loses it (if within the loss timeout + 5 s), then healed.

A *hog* is ``N`` busy processes (default twice the cores), and optionally a process holding and
touching ``--memory-pressure`` GB; the same measurements run quiet and under it, in the same
run, for each set of timings.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sglang_eaas import envs
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.membership import HEARTBEAT, LOSS_TIMEOUT, SUSPECT_TIMEOUT
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer

from bench_lib.partition import Partition
from bench_lib.stepper import Stepper, random_batch
from bench_lib.report import spread

# (heartbeat, suspect, loss): the one-stage detector before issue 34, and today's defaults
TIMINGS = {"one stage (0.3 / 0.6 / 0.6 s)": (0.3, 0.6, 0.6),
           f"two stages ({HEARTBEAT:g} / {SUSPECT_TIMEOUT:g} / {LOSS_TIMEOUT:g} s)":
           (HEARTBEAT, SUSPECT_TIMEOUT, LOSS_TIMEOUT)}
SERVERS, REPLICAS = 4, 3


@dataclass
class Measured:
    """One measurement's numbers (None: not seen within its bound)."""

    false_suspicions: int = 0
    false_losses: int = 0
    failed_rows: int = 0
    server_gap_ms: int = 0  # the longest gap between two heartbeats of any server
    client_gap_ms: int = 0
    late_share: float = 0.0  # heartbeats more than twice the period after the one before
    kill_s: float | None = None
    stop_routed_s: float | None = None
    stop_back_s: float | None = None
    partition_suspected_s: float | None = None
    partition_lost_s: float | None = None
    steps: int = 0
    notes: list[str] = field(default_factory=list)


def _placement(experts: int) -> list[list[int]]:
    """Expert e on servers e, e+1, e+2 (mod 4): any two may fail."""
    return [[e for e in range(experts) if any((e + j) % SERVERS == s for j in range(REPLICAS))]
            for s in range(SERVERS)]


def _until(condition, bound: float) -> float | None:
    """Seconds until ``condition()`` holds, polled every 10 ms; None after ``bound``."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > bound:
            return None
        time.sleep(0.01)
    return time.monotonic() - began


def measure(model: Path, timings: tuple[float, float, float], window: float, tokens: int,
            log) -> Measured:
    heartbeat, suspect, loss = timings
    token = envs.TOKEN.get()
    info = MoeModelInfo.from_model_path(model)
    monitor = MonitorServer(MonitorConfig(token=token, loss_timeout=loss,
                                          suspect_timeout=suspect)).start()
    partition = Partition(monitor.address)
    beat = ("--heartbeat", str(heartbeat))
    placements = _placement(info.num_experts)
    servers = start_local_servers(model, placements[:3], "float32", max_clients=2,
                                  extra_args=("--monitor", monitor.address, *beat), stdout=log)
    servers += start_local_servers(model, placements[3:], "float32", max_clients=2,
                                   extra_args=("--monitor", partition.address, *beat),
                                   stdout=log)
    client = EaasClient([s.address for s in servers], info, ModelIdentity.of(model),
                        torch.float32, "bench-detection", monitor=monitor.address,
                        heartbeat=heartbeat)
    stepper = Stepper(client, info, random_batch(info, tokens))
    out = Measured()
    try:
        stepper.start()
        time.sleep(1.0)  # past the first steps (kernels warm)
        before = dict(monitor.stats().counters)
        time.sleep(window)
        after = dict(monitor.stats().counters)

        def grew(name: str) -> int:
            return after.get(name, 0) - before.get(name, 0)

        out.false_suspicions = grew("suspicions")
        out.false_losses = sum(grew(k) for k in after if k.startswith("losses_"))
        out.server_gap_ms = after.get("servers_max_heartbeat_gap_ms", 0)
        out.client_gap_ms = after.get("clients_max_heartbeat_gap_ms", 0)
        beats = grew("servers_heartbeats") + grew("clients_heartbeats")
        late = grew("servers_heartbeats_late") + grew("clients_heartbeats_late")
        out.late_share = late / max(beats, 1)

        dead, stopped, cut = servers[0], servers[1], servers[3]
        os.kill(dead.process.pid, signal.SIGKILL)
        out.kill_s = _until(lambda: dead.address not in client.tier.live_connections(), 30)

        os.kill(stopped.process.pid, signal.SIGSTOP)
        out.stop_routed_s = _until(lambda: stopped.address not in client.table.servers,
                                   loss + 5)
        os.kill(stopped.process.pid, signal.SIGCONT)
        out.stop_back_s = _until(lambda: stopped.address in client.table.servers, 30)

        def member():
            return next((m for m in monitor.registry.snapshot().members
                         if m.id == cut.address), None)

        first = member().incarnation if member() is not None else ""
        partition.cut.set()
        began = time.monotonic()
        out.partition_suspected_s = _until(
            lambda: member() is None or member().suspected, loss + 5)
        gone = _until(lambda: member() is None or member().incarnation != first,
                      max(0.0, loss + 5 - (time.monotonic() - began)))
        out.partition_lost_s = None if gone is None else time.monotonic() - began
        partition.cut.clear()
        if _until(lambda: cut.address in client.table.servers, 30) is None:
            out.notes.append("the partitioned server was not back within 30 s of healing")
    finally:
        stepper.stop.set()
        stepper.join(30)
        out.failed_rows, out.steps = stepper.failed, stepper.steps
        if stepper.error:
            out.notes.append(stepper.error)
        for server in servers:
            try:
                server.process.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
        client.close()
        for server in servers:
            server.stop()
        partition.close()
        monitor.close()
    return out


def table(results: dict[tuple[str, str], list[Measured]], window: float) -> list[str]:
    """The markdown table: one row per (timings, condition), medians [min-max] of the runs."""
    rows = [
        "| timings | condition | false suspicions per min | false losses | failed rows | "
        "longest heartbeat gap, server / client (ms) | heartbeats > 2 periods late | kill -9 "
        "dropped (s) | SIGSTOP routed around (s) | back after SIGCONT (s) | partition: "
        "suspected (s) | partition: lost (s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (timings, condition), runs in results.items():
        def col(name: str, fmt: str) -> str:
            return spread([getattr(r, name) for r in runs], fmt)

        rows.append(
            f"| {timings} | {condition} | "
            f"{spread([r.false_suspicions * 60 / window for r in runs], '.1f')} | "
            f"{col('false_losses', 'd')} | {col('failed_rows', 'd')} | "
            f"{col('server_gap_ms', 'd')} / {col('client_gap_ms', 'd')} | "
            f"{spread([100 * r.late_share for r in runs], '.2f')}% | {col('kill_s', '.2f')} | "
            f"{col('stop_routed_s', '.2f')} | {col('stop_back_s', '.2f')} | "
            f"{col('partition_suspected_s', '.2f')} | {col('partition_lost_s', '.2f')} |")
    return rows


def ratios(results: dict[tuple[str, str], list[Measured]]) -> list[str]:
    """Each set of timings against the first (the one-stage detector, the fastest to drop a
    member: the strongest baseline for detection time), per condition: medians' ratios."""
    baseline = next(iter(TIMINGS))
    lines = []
    for (timings, condition), runs in results.items():
        base = results.get((baseline, condition))
        if timings == baseline or not base:
            continue
        parts = []
        for name, what in (("kill_s", "kill -9 dropped"), ("stop_routed_s", "SIGSTOP routed "
                           "around"), ("false_losses", "false losses")):
            ours = [getattr(r, name) for r in runs if getattr(r, name) is not None]
            theirs = [getattr(r, name) for r in base if getattr(r, name) is not None]
            if ours and theirs:
                a, b = statistics.median(ours), statistics.median(theirs)
                parts.append(f"{what} {a:.3g} vs {b:.3g}" + (f" ({a / b:.2f}x)" if b else ""))
        lines.append(f"- {condition}: {timings} against {baseline}: " + "; ".join(parts))
    return lines
