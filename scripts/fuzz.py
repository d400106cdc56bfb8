"""Fuzz a live expert server: slot headers and payloads, control messages (docs/fuzzing.md).

Starts two expert servers and a well-behaved client on loopback (shm slots), writes random and
mutated requests into fuzzing clients' slots, then sends malformed control messages, and checks
that the server never crashed, kept serving the good client correctly and counted every
rejection exactly. Bounded in cases and in time; exits 1 if any check failed.

    python scripts/fuzz.py                                  # 10^5 slot cases, 10^4 messages
    python scripts/fuzz.py --slot-cases 2000 --control-cases 500 --seed 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from sglang_eaas.tools.fuzz.run import FuzzConfig, FuzzResult, run_fuzz
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model

from bench_lib.report import Report, default_out

ROOT = Path(__file__).resolve().parent.parent


def positive(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/fuzz.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--slot-cases", type=positive, default=100_000,
                   help="requests written into fuzzing clients' slots; default %(default)s")
    p.add_argument("--control-cases", type=positive, default=10_000,
                   help="malformed control messages; default %(default)s")
    p.add_argument("--seed", type=int, default=0, help="random seed; default %(default)s")
    p.add_argument("--time-limit", type=float, default=600.0, metavar="S",
                   help="seconds for both fuzz phases together (the slot fuzz gets at most 3/4), "
                   "after which the run stops and reports what it did; default %(default)s")
    p.add_argument("--model", type=Path, default=None, metavar="PATH",
                   help="checkpoint to serve (default: the tiny Qwen3-MoE under .cache/models, "
                   "generated on first use)")
    p.add_argument("--fuzz-clients", type=int, default=6,
                   help="fuzzing clients writing into their slots at once; default %(default)s")
    p.add_argument("--out", type=Path, default=default_out("fuzz"),
                   help="where the report is saved; default %(default)s")
    args = p.parse_args(argv)
    if args.time_limit <= 0:
        p.error("--time-limit must be > 0 seconds")
    if args.fuzz_clients < 2:
        p.error("--fuzz-clients must be >= 2 (a garbage flag is watched over another's case)")
    return args


def counts_table(result: FuzzResult) -> str:
    """What the fuzzers expected against what the fuzzed server counted, per reason."""
    stats = result.stats
    rows = [("slot: accepted requests (fuzzers + good client)",
             result.slot.expected["ok"] + (result.good.sent_per_server or [0])[0],
             stats.counter("requests"))]
    for reason in sorted(k for k in result.slot.expected if k != "ok"):
        rows.append((f"slot: rejected {reason}", result.slot.expected[reason],
                     stats.counter(f"rejected_{reason.lower()}")))
    refused = stats.control_refused
    for reason in sorted(set(result.control.expected) | set(refused)):
        rows.append((f"control: refused {reason}", result.control.expected[reason],
                     refused.get(reason, 0)))
    rows.append(("control: refused connections", result.control.refused_connections,
                 stats.refused_connections))
    lines = ["| counter | fuzzer expected | server counted |", "|---|---:|---:|"]
    lines += [f"| {what} | {expected} | {got} |" for what, expected, got in rows]
    return "\n".join(lines)


def cases_table(title: str, by_kind: dict[str, int]) -> str:
    lines = [f"| {title} | cases |", "|---|---:|"]
    lines += [f"| {kind} | {n} |" for kind, n in sorted(by_kind.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model or cached_model(ROOT / ".cache" / "models", PRESETS["tiny"])
    report = Report(args.out)
    config = FuzzConfig(model, args.slot_cases, args.control_cases, args.seed, args.time_limit,
                        args.fuzz_clients, log_dir=ROOT / ".cache" / "logs" / "fuzz")
    started = time.monotonic()
    result = run_fuzz(config, progress=lambda line: print(line, flush=True))
    slot, control, good = result.slot, result.control, result.good
    report.add(
        f"Model `{model}`; seed {args.seed}. Slot fuzz: {slot.cases} cases from "
        f"{args.fuzz_clients} clients in {result.phase_seconds['slot fuzz']:.1f} s "
        f"({1e6 * result.phase_seconds['slot fuzz'] / max(slot.cases, 1):.0f} us per case), "
        f"slots restored {dict(slot.restores)}. Control fuzz: {control.refused_messages} "
        f"malformed messages ({control.accepted} good ones between them) over "
        f"{control.connections} connections in {result.phase_seconds['control fuzz']:.1f} s. "
        f"Good client: {good.correct} of {good.requests} results correct."
        + ("" if result.complete else " **Stopped by --time-limit before the counts.**"))
    report.add(counts_table(result))
    report.add(cases_table("slot case", dict(slot.by_kind)))
    report.add(cases_table("control case (one connection each)", dict(control.by_kind)))
    report.add("\n".join(f"- {'PASS' if c.passed else 'FAIL'}: {c.what}"
                         + ("" if c.passed else f" ({c.detail})") for c in result.checks))
    report.save()
    print(f"total {time.monotonic() - started:.0f} s", flush=True)
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
