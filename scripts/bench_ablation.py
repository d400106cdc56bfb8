"""Benchmark: what each of --eaas's optimisations is worth, against monolithic SGLang.

In one run on the generated bench checkpoint, one server after the other (the same workload as
scripts/bench_eaas.py: for each batch size B, B concurrent streaming greedy ``/generate``
requests of random prompt ids):

* monolithic SGLang;
* ``eaas``: ``--eaas --eaas-expert-servers local:N`` as it comes: the expert servers' fast
  kernel with group shrink, and two-batch overlap unless the local servers and SGLang share
  the cores (a small machine), where ``--eaas`` serves without it;
* one switch changed at a time: two-batch overlap the other way (``--enable-two-batch-overlap``
  or ``--eaas-disable-overlap``), ``--eaas-disable-shrink`` (the kernel walks every expert of
  a layer), ``--eaas-kernel reference`` (SGLang's op order, expert by expert in Python: what
  the servers ran before the fast kernel).

Prints tok/s and TPOT per configuration and batch size, each as a ratio to monolithic SGLang
measured in the same run, and the throughput change of each switch against ``eaas`` (the
paper's ablation reports the loss with an optimisation off), and saves a bar chart (PNG) next
to the report. CUDA-graph capture, the paper's third switch, has no CPU counterpart: SGLang's
CPU runtime runs eagerly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import requests

from sglang_eaas import cpu_runtime
from sglang_eaas.cores import shares_cores, usable_cores
from sglang_eaas.tools.server_process import CPU_ARGS, ServerError

from bench_eaas import (
    Result,
    add_workload_args,
    bench_server,
    bench_workload,
    check_workload_args,
)
from bench_lib.report import Report, default_out, pyplot, save_figure

ROOT = Path(__file__).resolve().parent.parent
EAAS = "eaas"


def configurations(servers: int) -> dict[str, tuple[str, ...]]:
    """Name -> SGLang arguments beyond the CPU runtime's."""
    eaas = ("--eaas", "--eaas-expert-servers", f"local:{servers}")
    overlap = (("with two-batch overlap", "--enable-two-batch-overlap")
               if shares_cores(servers, 1) else
               ("no two-batch overlap", "--eaas-disable-overlap"))
    return {
        "monolithic": (),
        EAAS: eaas,
        overlap[0]: (*eaas, overlap[1]),
        "no group shrink": (*eaas, "--eaas-disable-shrink"),
        "reference kernel": (*eaas, "--eaas-kernel", "reference"),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The default run takes about 8 minutes on 2 CPU cores (five server starts). "
        "Run it on an otherwise idle machine: other load skews the ratios.")
    add_workload_args(parser, batch_sizes="1,8,32", rounds=3)
    parser.add_argument("--only", default="",
                        help="comma-separated configuration names to run (monolithic always "
                        "runs: it is the baseline); default all")
    parser.add_argument("--out", type=Path, default=default_out("ablation"),
                        help="markdown report (the chart goes next to it, same name .png); "
                        "default %(default)s")
    args = check_workload_args(parser, parser.parse_args())
    known = configurations(args.servers)
    args.only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in args.only if n not in known]
    if unknown:
        parser.error(f"--only: unknown configurations {unknown} (known: {', '.join(known)})")
    return args


def table(results: dict[str, dict[int, Result]]) -> str:
    mono = results["monolithic"]
    lines = ["| configuration | batch | tok/s | vs monolithic | TPOT ms | vs monolithic |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, by_batch in results.items():
        for batch, r in by_batch.items():
            m = mono[batch]
            lines.append(f"| {name} | {batch} | {r.tok_per_s:.1f} | "
                         f"{r.tok_per_s / m.tok_per_s:.2f}x | {r.tpot_ms:.1f} | "
                         f"{r.tpot_ms / m.tpot_ms:.2f}x |")
    return "\n".join(lines)


def changes(results: dict[str, dict[int, Result]]) -> str:
    """Per switch and batch size: the throughput change against ``eaas`` as it comes."""
    base = results.get(EAAS)
    if base is None:
        return ""
    lines = ["| against eaas | " + " | ".join(f"batch {b}" for b in base) + " |",
             "|---|" + "---:|" * len(base)]
    for name, by_batch in results.items():
        if name in ("monolithic", EAAS):
            continue
        lines.append(f"| {name} | " + " | ".join(
            f"{(by_batch[b].tok_per_s / base[b].tok_per_s - 1) * 100:+.1f}%" for b in base)
            + " |")
    return "\n".join(lines)


def chart(results: dict[str, dict[int, Result]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    mono = results["monolithic"]
    batches = list(mono)
    names = list(results)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(9.5, 4), dpi=100)
    for i, name in enumerate(names):
        ratios = [results[name][b].tok_per_s / mono[b].tok_per_s for b in batches]
        ax.bar([x + i * width for x in range(len(batches))], ratios, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(batches))],
                  [f"batch {b}" for b in batches])
    ax.set_ylabel("output tok/s / monolithic SGLang")
    ax.set_title("--eaas ablation on the bench checkpoint (2 CPU cores)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model, workload = bench_workload(args)
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    chosen = {name: extra for name, extra in configurations(args.servers).items()
              if name == "monolithic" or not args.only or name in args.only}
    results: dict[str, dict[int, Result]] = {}
    try:
        for name, extra in chosen.items():
            results[name] = bench_server(name.replace(", ", "-").replace(" ", "-"), model,
                                         (*base, *extra), args.log_dir, args.batch_sizes,
                                         workload, args.rounds)
    except ServerError as exc:
        print(f"bench: error: a server failed to start: {exc}", file=sys.stderr)
        return 1
    except (requests.RequestException, RuntimeError) as exc:
        print(f"bench: error while measuring: {exc}", file=sys.stderr)
        return 1
    png = args.out.with_suffix(".png")
    chart(results, png)
    args_of = "; ".join(f"{n}: `{' '.join(e) or '(no --eaas)'}`" for n, e in chosen.items())
    report.add(f"bench checkpoint `{model.name}`; per batch size B: B concurrent streaming "
               f"requests of {args.input_len} random prompt tokens and {args.output_len} output "
               f"tokens, median of {args.rounds} rounds after one warm-up round. "
               f"Configurations: {args_of}.\n\n" + table(results))
    if changes(results):
        report.add(f"Throughput change with one switch changed, against `eaas` (on this "
                   f"machine `--eaas` serves "
                   f"{'without' if shares_cores(args.servers, 1) else 'with'} two-batch "
                   f"overlap: {usable_cores()} cores for {args.servers} local expert servers "
                   f"and 1 SGLang rank):\n\n" + changes(results))
    report.add(f"Chart: `{png.name}`.")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
