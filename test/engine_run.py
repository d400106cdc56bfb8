"""Run by test_engine in a process of its own (SGLang's ``Engine.shutdown`` kills every child of
its process, which must not be pytest's): ``sglang_eaas.Engine`` serving ``MODEL``.

1. an engine whose shared monitor nothing answers at must fail at launch, naming the keyword;
2. ``sglang_eaas.Engine(**KWARGS)``: greedy tokens for each prompt alone, then as one batch;
3. ``shutdown()``, then what is left of what it started (this process lives on).

Prints ``RESULT {json}`` as its last line.

    python engine_run.py '{"model": M, "kwargs": {...}, "prompts": [...], "tokens": N,
                           "unreachable": "127.0.0.1:PORT"}'
"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil

import sglang_eaas
from sglang_eaas.addresses import accepts




def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def expert_servers() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "sglang_eaas.expert_server" in child.cmdline():
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def failed_launch(model: str, kwargs: dict, unreachable: str) -> dict:
    """A shared monitor nothing answers at: the launch fails before any worker starts."""
    started = time.monotonic()
    try:
        sglang_eaas.Engine(model_path=model, **{**kwargs, "eaas_expert_servers": None},
                           eaas_monitor=unreachable)
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - started,
                "children": [c.pid for c in psutil.Process().children(recursive=True)]}
    return {"error": None}


def main() -> int:
    spec = json.loads(sys.argv[1])
    model, kwargs, prompts = spec["model"], spec["kwargs"], spec["prompts"]
    result = {"failed_launch": failed_launch(model, kwargs, spec["unreachable"])}
    engine = sglang_eaas.Engine(model_path=model, **kwargs)
    params = {"max_new_tokens": spec["tokens"], "temperature": 0.0, "ignore_eos": True}
    result["alone"] = [engine.generate(p, params)["output_ids"] for p in prompts]
    result["batched"] = [out["output_ids"] for out in engine.generate(prompts, params)]
    servers = expert_servers()
    monitor = engine.server_args._eaas.monitor
    result.update(servers=[s.pid for s in servers], monitor=monitor,
                  monitor_answered=accepts(monitor))
    engine.shutdown()
    result["left"] = [c.pid for c in psutil.Process().children(recursive=True) if alive(c)]
    result["servers_alive"] = [s.pid for s in servers if alive(s)]
    result["monitor_answers_after"] = accepts(monitor)
    result["shm_left"] = [name for name in os.listdir("/dev/shm")
                          if any(name.startswith(f"ibgda-{s.pid}-") for s in servers)]
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
