"""What bench_esft reads from a deployment besides its answers: the expert servers' ``stats``
(weight bytes, kernel time and layer calls; each server the monitor lists, probed through its
control port) and the CPU time of the deployment's processes (``/proc/PID/stat``).
"""

from __future__ import annotations

import os
from pathlib import Path

from sglang_eaas import envs
from sglang_eaas.membership import current_snapshot
from sglang_eaas.protocol.control import probe


def expert_servers(monitor: str) -> list[str]:
    """The expert servers the monitor lists (their control addresses)."""
    return [m.id for m in current_snapshot(monitor, envs.TOKEN.get()).servers()]


def expert_weight_bytes(monitor: str) -> int:
    """The expert servers' weight bytes, summed: each server the monitor lists, probed."""
    return sum(probe(s, envs.TOKEN.get()).weight_bytes for s in expert_servers(monitor))


def kernel_totals(servers: list[str]) -> tuple[int, int]:
    """(kernel nanoseconds, layer calls) the expert servers have computed since they started."""
    ns = calls = 0
    for address in servers:
        stats = probe(address, envs.TOKEN.get())
        ns += sum(ns for per in stats.expert_load.values() for _, ns in per.values())
        calls += stats.counter("batches")
    return ns, calls


ROLES = ("SGLang scheduler", "SGLang HTTP + tokenizer", "detokenizer", "expert servers")
TICK = os.sysconf("SC_CLK_TCK")


def _role(cmdline: str) -> str | None:
    if "sglang::scheduler" in cmdline:
        return ROLES[0]
    if "sglang.launch_server" in cmdline:
        return ROLES[1]
    if "sglang::detokenizer" in cmdline:
        return ROLES[2]
    if "sglang_eaas.expert_server" in cmdline:
        return ROLES[3]
    return None


def cpu_seconds(group: int) -> dict[str, float]:
    """User + system CPU seconds of the processes of process group ``group`` (a server and
    its children), by role; the load generator (this process) under ``load generator``."""
    out = dict.fromkeys(ROLES, 0.0)
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if not proc.name.isdigit() or int(fields[2]) != group:
                continue
            role = _role((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):  # a process gone meanwhile
            continue
        if role is not None:
            out[role] += (int(fields[11]) + int(fields[12])) / TICK
    times = os.times()
    out["load generator"] = times.user + times.system
    return out
