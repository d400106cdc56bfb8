"""What an SGLang server costs the host's memory, per process: start ``sglang.launch_server``
on a generated checkpoint as a user would (CPU runtime defaults, no ``--max-total-tokens``),
send a few greedy requests, and print each process's RSS, PSS (a page shared by n processes
counts 1/n: what the process tree costs the host) and USS (its pages alone), and the tree's sum.

    .venv/bin/python scripts/server_memory.py                       # --tp 1 on the tiny Qwen3
    .venv/bin/python scripts/server_memory.py -- --tp 2 --ep 2      # any launch_server flags
    SGLANG_EAAS_FORKSERVER=off .venv/bin/python scripts/server_memory.py -- --tp 2 --ep 2

The last: SGLang's own spawn, each process importing SGLang anew (docs/cpu-runtime.md, "Memory
of a server"). Not a test: the suite's bound is asserted by test_tp_ep.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import psutil

from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model
from sglang_eaas.tools.server_process import CPU_DEVICE_ARGS, SGLangServer

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def label(process: psutil.Process) -> str:
    """SGLang's title of the process (``sglang::scheduler_TP0``), else what it runs."""
    line = " ".join(process.cmdline())
    for known in ("sglang.launch_server", "multiprocessing.forkserver",
                  "multiprocessing.resource_tracker"):
        if known in line:
            return known
    return line[:60].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="generated checkpoint to serve (default: tiny, 21 MB in float32)")
    parser.add_argument("--dtype", default="float32", help="--dtype of the server")
    parser.add_argument("server_args", nargs="*",
                        help="more launch_server flags, after '--' (e.g. -- --tp 2 --ep 2)")
    args = parser.parse_args()
    model = cached_model(ROOT / ".cache" / "models", PRESETS[args.preset], log=print)
    log = ROOT / ".cache" / "logs" / "server_memory.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting launch_server {' '.join(args.server_args)} (log: {log})", flush=True)
    with SGLangServer(model, *CPU_DEVICE_ARGS, "--dtype", args.dtype, *args.server_args,
                      log_path=log) as server:
        for prompt in ("The expert servers", "Once upon a time"):
            server.generate(prompt, max_new_tokens=16)
        root = psutil.Process(server.process.pid)
        rows, total = [], [0, 0, 0]
        for process in (root, *root.children(recursive=True)):
            try:
                full, name = process.memory_full_info(), label(process)
            except psutil.NoSuchProcess:
                continue
            rows.append((process.pid, name, full.rss, full.pss, full.uss))
            total = [total[0] + full.rss, total[1] + full.pss, total[2] + full.uss]
    print("\n| pid | process | RSS GiB | PSS GiB | USS GiB |\n|---:|---|---:|---:|---:|")
    for pid, name, *sizes in rows:
        print(f"| {pid} | {name} | " + " | ".join(f"{s / GIB:.2f}" for s in sizes) + " |")
    print("| | **the tree** | " + " | ".join(f"{s / GIB:.2f}" for s in total) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
