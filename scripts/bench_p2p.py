"""Benchmark: round-trip latency of the slot protocol over every ibgda backend against memcpy,
ZMQ and gloo.

The paper's section 5.5 on this machine: a client sends a (bs, 7168) bfloat16 tensor to a server
that returns it at once, and times the round trip; the median per batch size is reported.
"shm" is the project's real slot protocol over the shm transport, waiting as the product does by
default: the client publishes a request (ClientSlot.send) and waits for its result (wait: busy-
polls, yielding the core between polls, for POLL_SPIN_US, then sleeps on the result doorbell);
the server process, waiting the same way on its region doorbell, copies the request's hidden
states into the slot's result buffer and publishes; the client checks the result header (result).
Every client and every server is its own process. Variants: "shm-sleep" (both ends sleep on the
futex doorbell at once: --poll-spin-us 0 / --eaas-poll-spin-us 0), "mooncake" (Mooncake Transfer
Engine over TCP on 127.0.0.1), "device" (the device kernels under the Triton CPU interpreter:
bs 1-8 only, a tenth of the iterations).

Baselines, same run, same sizes, 1 client x 1 server: "memcpy", two copy_ of the payload between
preallocated tensors in one process (what a round trip must at least copy); "zmq-ipc" and
"zmq-tcp", a pyzmq REQ/REP echo over ipc:// and tcp://127.0.0.1 with zero-copy sends; "gloo",
a torch.distributed send/recv echo between two processes on 127.0.0.1. Layouts CxS (every slot
backend but device): C concurrent clients, each sending to all S servers, then waiting for all.

Goal (paper): at bs=128, shm within 2x of memcpy and at least 5x faster than ZMQ and gloo.
"""

from __future__ import annotations

import argparse
import functools
import re
import signal
from pathlib import Path
from typing import Callable

from bench_lib.p2p_peers import (
    DEVICE_BATCH_SIZES, HIDDEN, SLOT, VARIANTS, Plan, run_gloo, run_memcpy, run_slots, run_zmq,
)
from bench_lib.p2p_processes import exit_on_sigterm
from bench_lib.report import Report, default_out

GOAL_BS = 128


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def main_table(plan: Plan, r: dict[str, dict[int, float]]) -> str:
    """Medians (us) of every method, 1x1, with the ratios the goal is stated in."""
    lines = ["| bs | payload KiB | memcpy us | shm us | zmq-ipc us | zmq-tcp us | gloo us "
             "| shm/memcpy | zmq-ipc/shm | zmq-tcp/shm | gloo/shm |",
             "|---:" * 11 + "|"]
    for bs in plan.batch_sizes:
        shm = r["shm"][bs]
        cells = [str(bs), str(bs * HIDDEN * 2 // 1024)]
        cells += [f"{r[m][bs]:.1f}" for m in ("memcpy", "shm", "zmq-ipc", "zmq-tcp", "gloo")]
        cells += [ratio(shm, r["memcpy"][bs])]
        cells += [ratio(r[m][bs], shm) for m in ("zmq-ipc", "zmq-tcp", "gloo")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def backend_table(r: dict[str, dict[int, float]], variants: list[str]) -> str:
    """Medians (us) of every backend, 1x1, with their ratios to memcpy and from zmq-tcp."""
    header = ["bs", "memcpy us"] + [f"{v} us" for v in variants]
    header += [f"{v}/memcpy" for v in variants] + [f"zmq-tcp/{v}" for v in variants]
    lines = ["| " + " | ".join(header) + " |", "|---:" * len(header) + "|"]
    for bs in r["memcpy"]:
        got = [r[v].get(bs) for v in variants]
        cells = [str(bs), f"{r['memcpy'][bs]:.1f}"]
        cells += ["-" if g is None else f"{g:.1f}" for g in got]
        cells += ["-" if g is None else ratio(g, r["memcpy"][bs]) for g in got]
        cells += ["-" if g is None else ratio(r["zmq-tcp"][bs], g) for g in got]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def layout_table(plan: Plan, layouts: dict[str, dict[int, float]]) -> str:
    """Medians (us) per layout, each with its ratio to 1x1."""
    names = list(layouts)
    header = ["bs", "1x1 us"] + [c for n in names[1:] for c in (f"{n} us", f"{n}/1x1")]
    lines = ["| " + " | ".join(header) + " |", "|---:" * len(header) + "|"]
    for bs in plan.batch_sizes:
        base = layouts["1x1"][bs]
        cells = [str(bs), f"{base:.1f}"]
        cells += [c for n in names[1:] for c in (f"{layouts[n][bs]:.1f}",
                                                 ratio(layouts[n][bs], base))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_verdict(r: dict[str, dict[int, float]], variant: str = "shm") -> str:
    """Whether ``variant`` (an shm one) at bs=128 is within 2x of memcpy and >= 5x faster than
    zmq and gloo."""
    shm = r[variant][GOAL_BS]
    misses = []
    if shm / r["memcpy"][GOAL_BS] > 2:
        misses.append(f"{variant}/memcpy {shm / r['memcpy'][GOAL_BS]:.2f}x > 2x")
    misses += [f"{m}/{variant} {r[m][GOAL_BS] / shm:.2f}x < 5x"
               for m in ("zmq-ipc", "zmq-tcp", "gloo") if r[m][GOAL_BS] / shm < 5]
    verdict = "met" if not misses else "NOT met (" + "; ".join(misses) + ")"
    return (f"Goal at bs={GOAL_BS} ({variant} within 2x of memcpy, >= 5x faster than zmq and "
            f"gloo): {verdict}")


def batch_sizes_arg(text: str) -> tuple[int, ...]:
    """``--batch-sizes``: comma-separated integers between 1 and the slot's max_tokens."""
    sizes = tuple(int(b) for b in text.split(",") if b.strip().isdigit())
    if len(sizes) != len(text.split(",")) or not 1 <= min(sizes) <= max(sizes) <= SLOT.max_tokens:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated integers from 1 to {SLOT.max_tokens}")
    return sizes


def layouts_arg(text: str) -> list[tuple[int, int]]:
    """``--layouts``: comma-separated CLIENTSxSERVERS, 1x1 dropped (it is always measured)."""
    layouts = []
    for item in filter(None, text.split(",")):
        match = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", item.strip())
        if not match:
            raise argparse.ArgumentTypeError(f"layout {item!r} is not CLIENTSxSERVERS, e.g. 2x2")
        layouts.append((int(match[1]), int(match[2])))
    return [layout for layout in dict.fromkeys(layouts) if layout != (1, 1)]


def variants_arg(text: str) -> list[str]:
    """``--backends``: comma-separated names out of VARIANTS; shm is always measured."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown}; choose from "
                                         f"{', '.join(VARIANTS)}")
    return list(dict.fromkeys(["shm", *names]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The default run takes 2-6 minutes on 2 CPU cores, process starts "
        "included. Run it on an otherwise idle machine: other load skews every number.",
    )
    parser.add_argument("--batch-sizes", type=batch_sizes_arg,
                        default=",".join(str(1 << i) for i in range(10)),
                        help="comma-separated tokens per message (rows of the 7168-wide bf16 "
                        "tensor), at most 512 (the slot size); default 1,2,4,...,512")
    parser.add_argument("--iterations", type=int, default=200,
                        help="timed round trips per point (the median is reported); default 200")
    parser.add_argument("--warmup", type=int, default=10,
                        help="untimed round trips before each point (the first round trip also "
                        "checks the echo); default 10")
    parser.add_argument("--layouts", type=layouts_arg, default="2x2,1x3",
                        help="comma-separated CLIENTSxSERVERS shm layouts for the layout table, "
                        "besides 1x1 (always measured); each client sends to all its servers, "
                        "then waits for all; clients run concurrently; '' for none; "
                        "default 2x2,1x3")
    parser.add_argument("--backends", type=variants_arg, default="shm,shm-sleep,mooncake,device",
                        help="slot-protocol variants to measure: 'shm' (the default wait: "
                        "busy-poll, yielding, then sleep), 'shm-sleep' (sleep on the futex "
                        "doorbells at once), "
                        "'mooncake' (Transfer Engine, loopback TCP), 'device' (Triton kernels "
                        "under the CPU interpreter: batch sizes 1-8 and a tenth of the "
                        "iterations only); default %(default)s")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in every process; default 1")
    parser.add_argument("--out", type=Path, default=default_out("p2p"),
                        help="markdown file receiving the report (the header with command, "
                        "commit, date and machine, then the tables); default %(default)s")
    args = parser.parse_args()
    if args.iterations < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--iterations and --threads must be >= 1, --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    report = Report(args.out)
    plan = Plan(args.batch_sizes, args.iterations, args.warmup, args.threads)
    results: dict[str, dict[int, float]] = {}
    runs: dict[str, Callable[[], dict[int, float]]] = {
        "memcpy": functools.partial(run_memcpy, plan),
        "zmq-ipc": functools.partial(run_zmq, plan, "ipc"),
        "zmq-tcp": functools.partial(run_zmq, plan, "tcp"),
        "gloo": functools.partial(run_gloo, plan),
    }
    runs["shm"] = functools.partial(run_slots, plan, "shm", 1, 1)
    device_plan = Plan(tuple(b for b in plan.batch_sizes if b in DEVICE_BATCH_SIZES),
                       max(1, plan.iterations // 10), min(plan.warmup, 2), plan.threads)
    for variant in args.backends:
        for c, s in [(1, 1)] + ([] if variant == "device" else args.layouts):
            runs[variant if (c, s) == (1, 1) else f"{variant}-{c}x{s}"] = functools.partial(
                run_slots, device_plan if variant == "device" else plan, variant, c, s)
    for name, run in runs.items():
        print(f"bench_p2p: measuring {name}", flush=True)
        results[name] = run()
    report.add(f"1 client x 1 server (shm: slot protocol, shm backend), medians of "
               f"{plan.iterations} round trips in microseconds:\n\n{main_table(plan, results)}")
    if GOAL_BS in plan.batch_sizes:
        for variant in ("shm", "shm-sleep"):
            if variant in results:
                report.add(goal_verdict(results, variant))
    report.add("Every backend, 1 client x 1 server, medians in microseconds (device: "
               f"{device_plan.iterations} round trips):\n\n"
               + backend_table(results, args.backends))
    for variant in args.backends:
        if variant == "device" or not args.layouts:
            continue
        layouts = {"1x1": results[variant]}
        layouts.update((f"{c}x{s}", results[f"{variant}-{c}x{s}"]) for c, s in args.layouts)
        report.add(f"{variant} layouts (clients x servers), slowest client's median in "
                   f"microseconds:\n\n{layout_table(plan, layouts)}")
    report.save()


if __name__ == "__main__":
    main()
