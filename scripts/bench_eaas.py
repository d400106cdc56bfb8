"""Benchmark: decode throughput and TPOT of SGLang with --eaas against monolithic SGLang.

One run starts monolithic SGLang on the generated bench MoE checkpoint, measures, stops it, then
starts SGLang with ``--eaas --eaas-expert-servers local:N`` on the same checkpoint and measures
the same workload: for each batch size B, B concurrent streaming ``/generate`` requests (random
prompt token ids, greedy, ignore_eos). Times are taken on the client from the streamed chunks.
Prints a markdown table with the eaas/monolithic ratios. Logs go to .cache/logs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from sglang_eaas import cpu_runtime
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError

from bench_lib.report import Report, default_out, say

ROOT = Path(__file__).resolve().parent.parent
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Workload:
    """What every measured round sends. ``vocab_size`` comes from the checkpoint's config.json:
    an out-of-range prompt id kills SGLang's scheduler instead of failing the request."""

    input_len: int
    output_len: int
    vocab_size: int


@dataclass(frozen=True)
class RequestTiming:
    """Client-side timestamps (``time.perf_counter``) of one streamed request."""

    sent: float
    first_token: float
    done: float
    tokens: int


@dataclass(frozen=True)
class Result:
    """One batch size on one server: output tokens/s over the round and mean TPOT in ms."""

    tok_per_s: float
    tpot_ms: float



def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The default run takes 3-4.5 minutes on 2 CPU cores (two server starts "
        "included). Run it on an otherwise idle machine: other load skews the ratios.",
    )
    add_workload_args(parser, batch_sizes="1,8", rounds=2)
    parser.add_argument("--out", type=Path, default=default_out("eaas"),
                        help="markdown file receiving the report (the header with command, "
                        "commit, date and machine, then the table); default %(default)s")
    return check_workload_args(parser, parser.parse_args())


def add_workload_args(parser: argparse.ArgumentParser, batch_sizes: str, rounds: int) -> None:
    """The options of a run of this workload (also scripts/bench_ablation.py's)."""
    parser.add_argument("--servers", type=int, default=2,
                        help="expert servers of the eaas runs (--eaas-expert-servers local:N); "
                        "default 2")
    parser.add_argument("--batch-sizes", default=batch_sizes,
                        help=f"comma-separated numbers of concurrent requests; default "
                        f"{batch_sizes}")
    parser.add_argument("--input-len", type=int, default=32,
                        help="prompt length in tokens (random token ids); default 32")
    parser.add_argument("--output-len", type=int, default=64,
                        help="tokens generated per request (ignore_eos); default 64")
    parser.add_argument("--rounds", type=int, default=rounds,
                        help=f"measured rounds per batch size; the median is reported; default "
                        f"{rounds}")
    parser.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs",
                        help="where the server logs go; default .cache/logs")


def check_workload_args(parser: argparse.ArgumentParser,
                        args: argparse.Namespace) -> argparse.Namespace:
    """``add_workload_args``'s options checked (``parser.error`` names the bad one)."""
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.servers < 1 or min(args.batch_sizes) < 1 or args.rounds < 1:
        parser.error("--servers, --batch-sizes and --rounds must be >= 1")
    if args.input_len < 1 or args.output_len < 2:
        parser.error("--input-len must be >= 1 and --output-len >= 2 (TPOT needs two tokens)")
    return args


def bench_workload(args: argparse.Namespace) -> tuple[Path, Workload]:
    """The bench checkpoint (generated once, cached) and the workload the options describe."""
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    return model, Workload(args.input_len, args.output_len, vocab_size)


def stream_generate(url: str, input_ids: list[int], max_new_tokens: int,
                    start: threading.Barrier) -> RequestTiming:
    """Send one greedy streaming ``/generate`` after ``start`` releases; time its chunks."""
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                            "ignore_eos": True},
    }
    start.wait()
    sent = time.perf_counter()
    first_token, tokens = 0.0, 0
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data:"):])
            if not first_token:
                first_token = time.perf_counter()
            tokens = chunk["meta_info"]["completion_tokens"]
    return RequestTiming(sent, first_token, time.perf_counter(), tokens)


def run_round(url: str, batch: int, workload: Workload, max_new_tokens: int,
              rng: random.Random) -> list[RequestTiming]:
    """``batch`` concurrent requests with distinct random prompts (no prefix-cache hits)."""
    prompts = [[rng.randrange(workload.vocab_size) for _ in range(workload.input_len)]
               for _ in range(batch)]
    start = threading.Barrier(batch)
    timings: list[RequestTiming | BaseException | None] = [None] * batch

    def worker(i: int) -> None:
        try:
            timings[i] = stream_generate(url, prompts[i], max_new_tokens, start)
        except BaseException as exc:  # re-raised in the main thread below
            timings[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(batch)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for timing in timings:
        if isinstance(timing, BaseException):
            raise timing
    return timings


def summarize(timings: list[RequestTiming], output_len: int) -> Result:
    """Output tokens/s over the whole round; TPOT = (done - first token) / (n - 1), averaged."""
    for t in timings:
        if t.tokens != output_len:
            raise RuntimeError(f"a request returned {t.tokens} tokens, expected {output_len}")
    wall = max(t.done for t in timings) - min(t.sent for t in timings)
    tpot = statistics.mean((t.done - t.first_token) / (t.tokens - 1) for t in timings)
    return Result(len(timings) * output_len / wall, tpot * 1e3)


def measure(url: str, batch_sizes: list[int], workload: Workload, rounds: int,
            seed: int) -> dict[int, Result]:
    """Per batch size: one short warm-up round, then ``rounds`` measured rounds (median)."""
    rng = random.Random(seed)
    results = {}
    for batch in batch_sizes:
        run_round(url, batch, workload, WARMUP_TOKENS, rng)
        per_round = [summarize(run_round(url, batch, workload, workload.output_len, rng),
                               workload.output_len) for _ in range(rounds)]
        results[batch] = Result(statistics.median(r.tok_per_s for r in per_round),
                                statistics.median(r.tpot_ms for r in per_round))
        say(f"  batch {batch}: {results[batch].tok_per_s:.1f} tok/s, "
            f"TPOT {results[batch].tpot_ms:.1f} ms (median of {rounds})")
    return results


def bench_server(name: str, model: Path, extra_args: tuple[str, ...], log_dir: Path,
                 batch_sizes: list[int], workload: Workload, rounds: int) -> dict[int, Result]:
    """Start one server, measure it, stop it."""
    log_path = log_dir / f"bench-{name}.log"
    say(f"starting {name} SGLang (about 35-60 s; log: {log_path})")
    started = time.monotonic()
    with SGLangServer(model, *extra_args, log_path=log_path) as server:
        say(f"{name} ready in {time.monotonic() - started:.0f} s at {server.url}; measuring")
        return measure(server.url, batch_sizes, workload, rounds, seed=0)


def table(mono: dict[int, Result], eaas: dict[int, Result]) -> str:
    """Markdown table: one row per batch size, eaas/monolithic ratios next to the numbers."""
    lines = [
        "| batch | mono tok/s | eaas tok/s | ratio | mono TPOT ms | eaas TPOT ms | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for batch in mono:
        m, e = mono[batch], eaas[batch]
        lines.append(
            f"| {batch} | {m.tok_per_s:.1f} | {e.tok_per_s:.1f} | {e.tok_per_s / m.tok_per_s:.2f}x"
            f" | {m.tpot_ms:.1f} | {e.tpot_ms:.1f} | {e.tpot_ms / m.tpot_ms:.2f}x |"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model, workload = bench_workload(args)
    base_args = CPU_ARGS if cpu_runtime.is_active() else ()
    eaas_args = (*base_args, "--eaas", "--eaas-expert-servers", f"local:{args.servers}")
    say(f"model {model.name}; batch sizes {args.batch_sizes}, {args.input_len} prompt tokens, "
        f"{args.output_len} output tokens, {args.rounds} rounds")
    try:
        mono = bench_server("monolithic", model, base_args, args.log_dir, args.batch_sizes,
                            workload, args.rounds)
        eaas = bench_server(f"eaas-local{args.servers}", model, eaas_args, args.log_dir,
                            args.batch_sizes, workload, args.rounds)
    except ServerError as exc:
        print(f"bench: error: a server failed to start: {exc}", file=sys.stderr)
        return 1
    except (requests.RequestException, RuntimeError) as exc:
        print(f"bench: error while measuring: {exc}", file=sys.stderr)
        return 1
    report.add(f"bench checkpoint `{model.name}`; per batch size B: B concurrent streaming "
               f"requests of {args.input_len} random prompt tokens and {args.output_len} output "
               f"tokens, median of {args.rounds} rounds after one warm-up round; eaas = --eaas "
               f"--eaas-expert-servers local:{args.servers}; ratio = eaas / monolithic:\n\n"
               + table(mono, eaas))
    report.save()
    return 0

if __name__ == "__main__":
    sys.exit(main())
