"""Benchmark: PD disaggregation with EaaS against PD and against monolithic serving, each behind
SGLang's router, in one run (docs/deployment.md, docs/benchmarks.md).

Three local deployments of the generated bench checkpoint (``python -m sglang_eaas.deploy``'s
``Deployment``), one after the other on the same machine:

* ``monolithic``: one plain SGLang instance (experts inside it), the router in front;
* ``pd``: a prefill and a decode instance (``--disaggregation-mode``, KV over SGLang's Mooncake
  backend on TCP), experts inside each, the router in PD mode;
* ``pd+eaas``: the same two instances with ``--eaas``, both clients of one pool of expert
  servers behind a standalone monitor.

Against each router, SGLang's own ``python -m sglang.bench_serving`` (unchanged) with its
``random-ids`` dataset and with a ShareGPT-format file made here from held-out stdlib sources
(``bench_lib/sharegpt.py``: no download). Printed per deployment and dataset: bench_serving's
output tok/s, mean TTFT and mean TPOT, their ratios against ``monolithic``, what each output
token costs the deployment (CPU milliseconds of all its processes per output token, and by part)
and the throughput this machine's cores bound it to (cores x 1000 / that). The three share the
same cores, so PD's separate prefill and decode machines are not there to gain from, and each
process more costs CPU time the others would have used.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sglang_eaas import cpu_runtime
from sglang_eaas.deploy import DeployError, Deployment, parse_config
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model

from bench_lib import serving_client, sharegpt
from bench_lib.process_cpu import tree_cpu_seconds
from bench_lib.report import Report, default_out, say, spread

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")
SETTINGS = ("monolithic", "pd", "pd+eaas")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each run takes about 10 minutes on 2 CPU cores (three deployments): about 30 "
        "with the default 3 runs.")
    parser.add_argument("--runs", type=int, default=3,
                        help="runs, each deploying every setting with its own monolithic "
                        "baseline; default 3")
    parser.add_argument("--concurrency", type=int, default=8,
                        help="bench_serving --max-concurrency; default 8")
    parser.add_argument("--prompts-per-slot", type=int, default=4,
                        help="requests per concurrency slot (--num-prompts = this x "
                        "concurrency); default 4")
    parser.add_argument("--input-len", type=int, default=128,
                        help="random-ids: bench_serving --random-input-len; default 128")
    parser.add_argument("--output-len", type=int, default=32,
                        help="random-ids: --random-output-len, ShareGPT: --sharegpt-output-len; "
                        "default 32")
    parser.add_argument("--expert-servers", type=int, default=2,
                        help="expert servers of pd+eaas; default 2")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated subset of {', '.join(SETTINGS)} (monolithic is "
                        "the ratios' baseline and always runs); default all")
    parser.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs" / "bench-pd",
                        help="deployment and bench_serving logs; default .cache/logs/bench-pd")
    parser.add_argument("--out", type=Path, default=default_out("pd"),
                        help="markdown report; default %(default)s")
    args = parser.parse_args()
    args.settings = ["monolithic", *[s for s in args.settings.split(",") if s != "monolithic"]]
    unknown = sorted(set(args.settings) - set(SETTINGS))
    if unknown:
        parser.error(f"--settings: unknown {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    if min(args.concurrency, args.prompts_per_slot, args.input_len, args.expert_servers,
           args.runs) < 1 \
            or args.output_len < 4:
        parser.error("--concurrency, --prompts-per-slot, --input-len, --expert-servers and "
                     "--runs must be >= 1, --output-len >= 4 (bench_serving's minimum)")
    return args


def config(model: Path, setting: str, servers: int) -> dict:
    cpu = ["--device", "cpu"] if cpu_runtime.is_active() else []
    sglang: dict = {"args": [*cpu, "--max-total-tokens", "16384"], "eaas": setting == "pd+eaas"}
    if setting == "monolithic":
        sglang["plain"] = {"count": 1}
    else:
        sglang.update(prefill={"count": 1}, decode={"count": 1},
                      transfer_backend="mooncake_tcp" if cpu else "mooncake")
    tier = {"monitor": "standalone", "expert_servers": {"count": servers}}
    return {"model": str(model), **(tier if sglang["eaas"] else {}), "sglang": sglang}


def dataset_args(dataset: str, args: argparse.Namespace, sharegpt_file: Path) -> list[str]:
    if dataset == "random-ids":
        return serving_client.random_ids(args.input_len, args.output_len)
    return ["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_file),
            "--sharegpt-output-len", str(args.output_len), "--sharegpt-context-len", "2048"]


def role(part: str) -> str:
    """The column a part's CPU time goes to: monitor, expert servers, an instance, router."""
    return "experts" if part.startswith("expert-server") else part.rsplit("-", 1)[0]


def bench_serving(url: str, model: Path, dataset: str, args: argparse.Namespace,
                  sharegpt_file: Path, parts: dict[str, int], log: Path) -> dict:
    """One ``python -m sglang.bench_serving`` run against ``url``; its result record, with the
    deployment's CPU milliseconds per output token (``cpu_ms_per_token``), also by part."""
    cpu0 = {name: tree_cpu_seconds(pid) for name, pid in parts.items()}
    record = serving_client.run(url, model, dataset_args(dataset, args, sharegpt_file),
                                args.prompts_per_slot * args.concurrency, args.concurrency, log,
                                args.output_len)
    by_role: dict[str, float] = {}
    for name, pid in parts.items():
        by_role[role(name)] = by_role.get(role(name), 0.0) + tree_cpu_seconds(pid) - cpu0[name]
    # its warm-up request is in the CPU time too: one request more than the run's
    tokens = record["total_output_tokens"] * (1 + 1 / max(record["completed"], 1))
    return {**record, "cpu_ms_per_token": 1000 * sum(by_role.values()) / tokens,
            "cpu_ms_by_role": {r: 1000 * c / tokens for r, c in by_role.items()}}


def table(runs: list[dict[str, dict[str, dict]]], dataset: str) -> str:
    """Median [min-max] over the runs; each ratio against the same run's monolithic."""
    cores = os.cpu_count()
    lines = ["| deployment | out tok/s | ratio | mean TTFT ms | ratio | mean TPOT ms | ratio | "
             f"completed | CPU ms / out token | of which (median) | {cores}-core bound tok/s |",
             "|---|" + "---:|" * 8 + "---|---:|"]
    for setting in runs[0]:
        records = [run[setting][dataset] for run in runs]
        bases = [run["monolithic"][dataset] for run in runs]
        cells = [f"{spread([r[k] for r in records], '.1f')} | "
                 f"{spread([r[k] / b[k] for r, b in zip(records, bases)], '.2f', 'x')}"
                 for k in KEYS]
        cpu = [r["cpu_ms_per_token"] for r in records]
        by_role = {name: statistics.median(r["cpu_ms_by_role"][name] for r in records)
                   for name in records[0]["cpu_ms_by_role"]}
        split = ", ".join(f"{name} {ms:.1f}" for name, ms in by_role.items())
        lines.append(f"| {setting} | " + " | ".join(cells) + " | "
                     f"{spread([r['completed'] for r in records], '.0f')} | {spread(cpu, '.1f')} | "
                     f"{split} | {spread([cores * 1000 / c for c in cpu], '.0f')} |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    conversations = args.prompts_per_slot * args.concurrency * 4  # bench_serving drops some
    sharegpt_file = sharegpt.write(args.log_dir / "sharegpt.json", conversations)
    datasets = ("random-ids", "sharegpt")
    runs: list[dict[str, dict[str, dict]]] = []
    for run in range(args.runs):
        results: dict[str, dict[str, dict]] = {}
        runs.append(results)
        for setting in args.settings:
            say(f"run {run + 1}/{args.runs}: deploying {setting}")
            started = time.monotonic()
            cfg = parse_config(config(model, setting, args.expert_servers), setting)
            try:
                with Deployment(cfg, args.log_dir / setting.replace("+", "-"),
                                progress=lambda line: print("  " + line, flush=True)) as deployed:
                    say(f"{setting} serving in {time.monotonic() - started:.0f} s at "
                        f"{deployed.url}")
                    parts = {e.name: e.pid for e in deployed.endpoints()}
                    results[setting] = {}
                    for dataset in datasets:
                        name = setting.replace("+", "-")
                        log = args.log_dir / f"bench-serving-{name}-{dataset}.log"
                        record = bench_serving(deployed.url, model, dataset, args,
                                               sharegpt_file, parts, log)
                        results[setting][dataset] = record
                        say(f"  {dataset}: {record['output_throughput']:.1f} output tok/s, "
                            f"TTFT {record['mean_ttft_ms']:.0f} ms, TPOT "
                            f"{record['mean_tpot_ms']:.1f} ms, "
                            f"{record['cpu_ms_per_token']:.1f} CPU ms per output token")
            except DeployError as exc:
                print(f"bench: error: {setting} did not deploy: {exc}", file=sys.stderr)
                return 1
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"bench: error while measuring {setting}: {exc}", file=sys.stderr)
                return 1
    common = (f"`python -m sglang.bench_serving --backend sglang --num-prompts "
              f"{args.prompts_per_slot * args.concurrency} --max-concurrency {args.concurrency}` "
              f"against each deployment's router; bench checkpoint `{model.name}`; pd+eaas: "
              f"{args.expert_servers} expert servers; ratio = setting / the same run's "
              f"monolithic; median [min-max] of {args.runs} runs, each deploying all three in "
              f"turn")
    report.add(f"random-ids (`--random-input-len {args.input_len} --random-output-len "
               f"{args.output_len} --random-range-ratio 1.0`), {common}:\n\n"
               + table(runs, "random-ids"))
    report.add(f"ShareGPT format, {conversations} conversations cut from held-out stdlib "
               f"sources (`--sharegpt-output-len {args.output_len}`), {common}:\n\n"
               + table(runs, "sharegpt"))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
