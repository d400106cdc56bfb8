"""bench_live_balance's actions on a running tier: the workload (greedy ``/generate`` requests
from a small thread pool) and one pass of ``python -m sglang_eaas.tools.rebalance``, its output
read back into a record.

The rebalance prints per MoE layer either ``busiest server measured M x the mean, modelled B x
-> plan A x (N replicas to add)`` or (before it said what it measured) ``busiest server B x the
mean -> A x (N replicas to add)``; both are read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

from sglang_eaas import envs

NEW_LINE = re.compile(r"MoE layer (\d+): busiest server measured ([\d.]+|nan|inf)x the mean, "
                      r"modelled ([\d.]+|nan|inf)x -> plan ([\d.]+|nan|inf)x \((\d+) replicas")
OLD_LINE = re.compile(r"MoE layer (\d+): busiest server ([\d.]+|nan|inf)x the mean -> "
                      r"([\d.]+|nan|inf)x \((\d+) replicas")
SLOTS = re.compile(r"(\d+) slots per MoE layer each")


def workload(url: str, prompts: list[str], max_new_tokens: int, concurrency: int,
             say: Callable[[str], None]) -> list[list[int]]:
    """Every prompt as one greedy request (``ignore_eos``: ``max_new_tokens`` each),
    ``concurrency`` at a time; the output token ids, in prompt order."""
    body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True}}
    done = [0]

    def one(prompt: str) -> list[int]:
        response = requests.post(f"{url}/generate", json={"text": prompt, **body}, timeout=900)
        if response.status_code != 200:
            raise RuntimeError(f"/generate answered HTTP {response.status_code}: "
                               f"{response.text[:300]}")
        done[0] += 1
        if done[0] % concurrency == 0 or done[0] == len(prompts):
            say(f"    {done[0]}/{len(prompts)} requests done")
        return list(response.json()["output_ids"])

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


@dataclass
class Rebalanced:
    """One rebalance pass: slots per MoE layer per server it planned with; per MoE layer the
    busiest-server ratio it measured (``None``: the older output does not say), modelled for
    the current placement and for its plan, and replicas it added; its whole output."""

    slots: int | None = None
    measured: dict[int, float] = field(default_factory=dict)
    modelled: dict[int, float] = field(default_factory=dict)
    planned: dict[int, float] = field(default_factory=dict)
    adds: dict[int, int] = field(default_factory=dict)
    output: str = ""
    state: bool = False  # run with --state


def rebalance(monitor: str, token: str, state: Path | None, log: Path,
              say: Callable[[str], None], slots: int | None = None) -> Rebalanced:
    """One pass (``--state state`` and ``--slots slots`` where given) with the token in its
    environment; its output goes to ``log`` and, line by line, to ``say``."""
    command = [sys.executable, "-m", "sglang_eaas.tools.rebalance", "--monitor", monitor]
    if state is not None:
        command += ["--state", str(state)]
    if slots is not None:
        command += ["--slots", str(slots)]
    env = {**os.environ, envs.TOKEN.name: token}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    log.write_text(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    for line in done.stdout.splitlines():
        say("    " + line)
    if done.returncode != 0:
        raise RuntimeError(f"the rebalance exited with code {done.returncode}: "
                           f"{(done.stderr or done.stdout).strip()[-400:]}")
    out = parse(done.stdout)
    out.state = state is not None
    return out


def parse(output: str) -> Rebalanced:
    out = Rebalanced(output=output)
    slots = SLOTS.search(output)
    out.slots = int(slots.group(1)) if slots else None
    for m in NEW_LINE.finditer(output):
        layer = int(m.group(1))
        out.measured[layer], out.modelled[layer] = float(m.group(2)), float(m.group(3))
        out.planned[layer], out.adds[layer] = float(m.group(4)), int(m.group(5))
    for m in OLD_LINE.finditer(output):
        layer = int(m.group(1))
        out.modelled[layer], out.planned[layer] = float(m.group(2)), float(m.group(3))
        out.adds[layer] = int(m.group(4))
    return out
