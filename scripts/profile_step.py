"""Profile: where SGLang's scheduler process spends its time while it serves with ``--eaas``,
by function, sampled with py-spy (issue 35: what the per-step work of the default path costs).

Starts SGLang (``--eaas-args``, the bench checkpoint), drives it with ``--concurrency`` closed
loops of greedy streaming requests (``bench_lib/streams.py``: 32 random prompt token ids, 64
output tokens, each replaced when it ends), and while they run samples the scheduler process
(``py-spy record --format raw``, ``--rate`` per second, for ``--seconds``, after a warm-up).
Prints, for the functions of this plugin and the
scheduler's own loop, the share of the samples in which each is on the stack (inclusive) and
is the frame running (self), the top ``--top`` by inclusive share. A share is of the
scheduler's busy samples (py-spy leaves idle threads out), so the numbers add across threads.
Needs py-spy (``pip install py-spy``, in the bench extras) and the right to ptrace (root, or
``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from sglang_eaas import cpu_runtime
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError

from bench_lib.report import Report, default_out, say
from bench_lib.streams import closed_loop

ROOT = Path(__file__).resolve().parent.parent
FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")
SHOWN = ("sglang_eaas/", "scheduler", "model_runner", "tp_worker", "output_streamer")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="About 2 minutes on 2 CPU cores (a server start, a warm-up, --seconds of "
        "sampling). Run it on an otherwise idle machine.")
    p.add_argument("--eaas-args", default="--eaas",
                   help="SGLang's arguments (beyond the CPU ones); default %(default)r")
    p.add_argument("--concurrency", type=int, default=8,
                   help="concurrent streaming requests; default 8")
    p.add_argument("--seconds", type=float, default=30.0,
                   help="seconds of sampling; default 30")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds of load before sampling starts; default 5")
    p.add_argument("--rate", type=int, default=200, help="samples per second; default 200")
    p.add_argument("--top", type=int, default=30, help="functions listed; default 30")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs",
                   help="the server's log and py-spy's samples; default .cache/logs")
    p.add_argument("--out", type=Path, default=default_out("profile-step"),
                   help="markdown report; default %(default)s")
    args = p.parse_args()
    if args.concurrency < 1 or args.seconds <= 0 or args.warmup < 0 or args.rate < 1:
        p.error("--concurrency and --rate must be >= 1, --seconds > 0, --warmup >= 0")
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        p.error("py-spy is not installed: pip install py-spy (or pip install -e '.[bench]')")
    return args


def scheduler_pid(server: SGLangServer) -> int:
    """The scheduler process of a single-rank SGLang: the child titled ``sglang::scheduler``."""
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if "scheduler" in child.name() or "scheduler" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    raise RuntimeError("no scheduler process under SGLang's (is it one rank?)")


def frames(stack: str) -> list[tuple[str, str]]:
    """py-spy's raw stack (outermost first, ``;``-separated) as (function, file) pairs."""
    out = []
    for frame in stack.split(";"):
        m = FRAME.match(frame.strip())
        if m:
            out.append((m["func"], m["file"]))
    return out


def shares(raw: str) -> tuple[int, dict, dict]:
    """Samples in all, and per (function, file) the samples with it on the stack and with it
    the running frame."""
    total, inclusive, own = 0, collections.Counter(), collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        seen = frames(stack)
        for key in set(seen):
            inclusive[key] += n
        if seen:
            own[seen[-1]] += n
    return total, inclusive, own


def short(file: str) -> str:
    for marker in ("sglang_eaas/", "sglang/"):
        if marker in file:
            return marker + file.split(marker, 1)[1]
    return file


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    raw_file = args.log_dir / "profile-step.raw"
    say(f"starting SGLang {args.eaas_args}")
    try:
        with SGLangServer(model, *base, *shlex.split(args.eaas_args),
                          log_path=args.log_dir / "profile-step-server.log") as server:
            pid = scheduler_pid(server)
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            rng = random.Random(0)
            span = args.warmup + args.seconds + 20  # past py-spy's own start
            load = threading.Thread(target=lambda: closed_loop(
                server.url, lambda w, n: [rng.randrange(vocab) for _ in range(32)], 64,
                args.concurrency, span), daemon=True)
            load.start()
            time.sleep(args.warmup)
            say(f"sampling the scheduler (pid {pid}) for {args.seconds:g} s")
            done = subprocess.run([spy, "record", "-p", str(pid), "-d", str(int(args.seconds)),
                                   "-r", str(args.rate), "-f", "raw", "-o", str(raw_file),
                                   "--nonblocking"], capture_output=True, text=True)
            if done.returncode != 0 or not raw_file.exists():
                print(f"profile_step: error: py-spy failed: {done.stderr.strip()[-400:]}",
                      file=sys.stderr)
                return 1
            if not load.is_alive():
                say("note: the load ended before the sampling did")
    except (ServerError, RuntimeError) as exc:
        print(f"profile_step: error: {exc}", file=sys.stderr)
        return 1
    total, inclusive, own = shares(raw_file.read_text())
    if not total:
        print("profile_step: error: py-spy recorded no samples", file=sys.stderr)
        return 1
    picked = [key for key in inclusive if any(s in key[1] for s in SHOWN)]
    picked.sort(key=lambda key: -inclusive[key])
    rows = ["| function | file | on the stack | running |", "|---|---|---:|---:|"]
    for func, file in picked[:args.top]:
        rows.append(f"| `{func}` | {short(file)} | {100 * inclusive[func, file] / total:.1f}% | "
                    f"{100 * own[func, file] / total:.1f}% |")
    plugin = sum(n for key, n in own.items() if "sglang_eaas" in key[1])
    report.add(
        f"SGLang `{args.eaas_args}` on the bench checkpoint `{model.name}`, "
        f"{args.concurrency} closed loops of greedy streams (32 random prompt tokens, 64 "
        f"output tokens); its scheduler process sampled by py-spy at {args.rate}/s for "
        f"{args.seconds:g} s after {args.warmup:g} s of load: {total} busy samples, of which "
        f"{100 * plugin / total:.1f}% ran in this plugin's own code (self time). Top "
        f"{min(args.top, len(picked))} functions of the plugin, the scheduler and the model "
        "runner by inclusive share:\n\n" + "\n".join(rows))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
