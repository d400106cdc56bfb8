"""CPU seconds of a server's process tree, split by role: SGLang's scheduler (its ranks), the
expert servers it started, and the rest (launcher, tokenizer, detokenizer)."""

from __future__ import annotations

import psutil

ROLES = ("scheduler", "expert servers", "rest")


def role_of(process: psutil.Process) -> str:
    words = " ".join([process.name(), *process.cmdline()])
    if "expert_server" in words:
        return "expert servers"
    return "scheduler" if "scheduler" in words else "rest"


def cpu_by_role(root_pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of ``root_pid`` and its descendants, per role (the
    processes that ended are not counted: take the difference of two reads around work)."""
    out = dict.fromkeys(ROLES, 0.0)
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in processes:
        try:
            times = p.cpu_times()
            out[role_of(p)] += times.user + times.system
        except psutil.Error:
            continue
    return out


def tree_cpu_seconds(root_pid: int) -> float:
    """User + system CPU seconds so far of ``root_pid`` and its descendants."""
    return sum(cpu_by_role(root_pid).values())
