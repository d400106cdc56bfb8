"""Benchmark: SGLang's own serving benchmark (``python -m sglang.bench_serving``, unchanged)
against monolithic SGLang and SGLang with --eaas, in one run.

Starts each server on the generated bench checkpoint, one after the other, and runs SGLang's
``bench_serving`` client against it for each concurrency (``--max-concurrency``), with its
``random-ids`` dataset (random prompt token ids, no download) and the checkpoint's tokenizer.
Prints bench_serving's own numbers (output tok/s, mean TTFT, mean TPOT) per server and
concurrency and their eaas/monolithic ratios. bench_serving's full output goes to
.cache/logs/bench-serving-NAME-cC.log.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from sglang_eaas import cpu_runtime
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError

from bench_lib import serving_client
from bench_lib.report import Report, default_out, say

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The default run takes about 5 minutes on 2 CPU cores (two server starts).")
    parser.add_argument("--eaas-args", default="--eaas --eaas-expert-servers local:2",
                        help="the SGLang arguments of the eaas server; default %(default)r")
    parser.add_argument("--concurrency", default="8,32",
                        help="comma-separated bench_serving --max-concurrency values; "
                        "default 8,32")
    parser.add_argument("--prompts-per-slot", type=int, default=4,
                        help="requests per concurrency slot (--num-prompts = this x "
                        "concurrency); default 4")
    parser.add_argument("--input-len", type=int, default=32,
                        help="bench_serving --random-input-len; default 32")
    parser.add_argument("--output-len", type=int, default=32,
                        help="bench_serving --random-output-len; default 32")
    parser.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs",
                        help="server and bench_serving logs; default .cache/logs")
    parser.add_argument("--out", type=Path, default=default_out("serving"),
                        help="markdown report; default %(default)s")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if min(args.concurrency) < 1 or args.prompts_per_slot < 1:
        parser.error("--concurrency and --prompts-per-slot must be >= 1")
    return args


def bench_serving(server: SGLangServer, model: Path, concurrency: int, args: argparse.Namespace,
                  log: Path) -> dict:
    """One ``python -m sglang.bench_serving`` run; its result record (the JSON it writes)."""
    return serving_client.run(
        server.url, model, serving_client.random_ids(args.input_len, args.output_len),
        args.prompts_per_slot * concurrency, concurrency, log, args.output_len)


def table(results: dict[str, dict[int, dict]]) -> str:
    mono, eaas = results["monolithic"], results["eaas"]
    lines = ["| concurrency | mono out tok/s | eaas out tok/s | ratio | mono TTFT ms | eaas TTFT "
             "ms | ratio | mono TPOT ms | eaas TPOT ms | ratio |",
             "|---:|" + "---:|" * 9]
    for c in mono:
        cells = []
        for key in KEYS:
            m, e = mono[c][key], eaas[c][key]
            cells += [f"{m:.1f}", f"{e:.1f}", f"{e / m:.2f}x"]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    servers = {"monolithic": base, "eaas": (*base, *shlex.split(args.eaas_args))}
    results: dict[str, dict[int, dict]] = {}
    try:
        for name, extra in servers.items():
            log_path = args.log_dir / f"bench-serving-{name}.log"
            say(f"starting {name} SGLang (log: {log_path})")
            started = time.monotonic()
            with SGLangServer(model, *extra, log_path=log_path) as server:
                say(f"{name} ready in {time.monotonic() - started:.0f} s; running "
                    "sglang.bench_serving")
                results[name] = {}
                for c in args.concurrency:
                    record = bench_serving(server, model, c, args,
                                           args.log_dir / f"bench-serving-{name}-c{c}.log")
                    results[name][c] = record
                    say(f"  concurrency {c}: {record['output_throughput']:.1f} output tok/s, "
                        f"TPOT {record['mean_tpot_ms']:.1f} ms")
    except ServerError as exc:
        print(f"bench: error: a server failed to start: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench: error while measuring: {exc}", file=sys.stderr)
        return 1
    report.add(f"bench checkpoint `{model.name}`; `python -m sglang.bench_serving --backend "
               f"sglang --dataset-name random-ids --random-input-len {args.input_len} "
               f"--random-output-len {args.output_len} --random-range-ratio 1.0 --num-prompts "
               f"{args.prompts_per_slot}xC --max-concurrency C`; eaas = `{args.eaas_args}`; "
               "ratio = eaas / monolithic:\n\n" + table(results))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
