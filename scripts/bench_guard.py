"""Benchmark guard for anyone who changes the data path: the default ``--eaas`` path of this tree
against the same path at another commit, each as a ratio to monolithic SGLang, in one run.

The other commit is checked out in a git worktree (``.cache/guard/COMMIT``, kept for the next
run) and used through ``PYTHONPATH``, in this venv: the same SGLang, torch and checkpoint. Each
run starts, in turn, monolithic SGLang and SGLang ``--eaas`` (``--eaas-args``) from each tree,
the order of the trees swapped every other run, and drives each with SGLang's own
``python -m sglang.bench_serving`` (random prompt token ids, greedy) at every concurrency. It
prints each tree's eaas/monolithic ratios of output throughput and of TPOT (median [min-max] of
``--runs``), and this tree's ratio over the other's. Monolithic runs from its own tree too: the
CPU runtime is part of the plugin. Not a test: timings swing between runs, so compare the
ratios of one run.

With each run it reads the CPU seconds of each server's processes around every bench_serving
run, split into SGLang's scheduler (the rank), the expert servers and the rest, and prints
them per 1000 output tokens (median of the runs): where the cores go, which a throughput ratio
alone does not say.

``--no-expert-compute`` adds, in each run, this tree's ``--eaas`` path with expert servers whose
kernel returns zeros without computing (``bench_lib/no_expert_compute``; outputs wrong, only
times count): everything the path costs except the experts' arithmetic, so its ratio to
monolithic bounds what any expert kernel could reach on this host.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sglang_eaas import cpu_runtime
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError

from bench_lib import serving_client
from bench_lib.process_cpu import ROLES, cpu_by_role
from bench_lib.report import Report, default_out, git_commit, say, spread

ROOT = Path(__file__).resolve().parent.parent
THIS = "this tree"
BOUND = "this tree, experts computing nothing"  # --no-expert-compute
NO_COMPUTE = Path(__file__).resolve().parent / "bench_lib" / "no_expert_compute"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each run starts 4 servers (about a minute each on 2 CPU cores) and runs "
        "bench_serving at every concurrency on each: about 8 minutes per run with the "
        "defaults; the first run at a commit also compiles its extension. Run it on an "
        "otherwise idle machine.")
    p.add_argument("--against", metavar="COMMIT",
                   help="the commit (hash, tag or branch) to compare this tree with, e.g. the "
                   "last release")
    p.add_argument("--no-expert-compute", action="store_true",
                   help="also run this tree's --eaas path with expert servers that return zeros "
                   "without computing (a bound: what no expert kernel can beat; its outputs are "
                   "wrong, its times are the point)")
    p.add_argument("--runs", type=int, default=3, help="runs; default 3")
    p.add_argument("--concurrency", default="8,32",
                   help="comma-separated bench_serving --max-concurrency values; default 8,32 "
                   "(add 1 for batch-1 TPOT)")
    p.add_argument("--eaas-args", default="--eaas",
                   help="SGLang's arguments for the eaas servers; default %(default)r (the "
                   "default path)")
    p.add_argument("--prompts-per-slot", type=int, default=4,
                   help="requests per concurrency slot (--num-prompts = this x concurrency); "
                   "default 4")
    p.add_argument("--input-len", type=int, default=32,
                   help="bench_serving --random-input-len; default 32")
    p.add_argument("--output-len", type=int, default=64,
                   help="bench_serving --random-output-len; default 64")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs",
                   help="server and bench_serving logs; default .cache/logs")
    p.add_argument("--out", type=Path, default=default_out("guard"),
                   help="markdown report; default %(default)s")
    args = p.parse_args()
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: give comma-separated integers, e.g. 8,32")
    if min(args.concurrency) < 1 or args.runs < 1 or args.prompts_per_slot < 1:
        p.error("--concurrency, --runs and --prompts-per-slot must be >= 1")
    if min(args.input_len, args.output_len) < 1:
        p.error("--input-len and --output-len must be >= 1")
    if args.against is None and not args.no_expert_compute:
        p.error("give --against COMMIT, --no-expert-compute, or both")
    args.against_hash = None
    if args.against is not None:
        found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                                f"{args.against}^{{commit}}"], capture_output=True, text=True)
        if found.returncode != 0:
            p.error(f"--against {args.against!r}: no such commit in {ROOT}")
        args.against_hash = found.stdout.strip()
    return args


def checkout(commit: str) -> Path:
    """A worktree of ``commit`` under .cache/guard (made once), its C extension built in place;
    the folders to put on PYTHONPATH to use it."""
    tree = ROOT / ".cache" / "guard" / commit[:12]
    if not (tree / "setup.py").exists():
        say(f"checking out {commit[:12]} in {tree}")
        if tree.exists():
            shutil.rmtree(tree)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                        commit], check=True, capture_output=True)
    if not list((tree / "ibgda").glob("_host_atomics*.so")):
        say(f"building {commit[:12]}'s extension")
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                       check=True, capture_output=True)
    return tree


def python_path(tree: Path) -> str:
    """PYTHONPATH that makes a child process import the plugin from ``tree``; checked, so the
    two sides can never silently be the same code."""
    path = ":".join(str(p) for p in (tree / "python", tree, tree / "sgl-kernel-ext"))
    probe = "import sglang_eaas; print(sglang_eaas.__file__)"
    found = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": path},
                           capture_output=True, text=True)
    where = found.stdout.strip() or found.stderr.strip()
    if not where.startswith(str(tree)):
        raise subprocess.CalledProcessError(found.returncode, "import sglang_eaas",
                                            stderr=f"it imports from {where}, not {tree}")
    return path


def measure(tree_env: dict, model: Path, extra: tuple[str, ...], name: str,
            args) -> dict[int, dict]:
    """One server started, bench_serving at every concurrency; its records by concurrency."""
    log = args.log_dir / f"bench-guard-{name}.log"
    say(f"starting {name} (log: {log})")
    started = time.monotonic()
    with SGLangServer(model, *extra, log_path=log, env=tree_env) as server:
        say(f"  ready in {time.monotonic() - started:.0f} s")
        out = {}
        for c in args.concurrency:
            before = cpu_by_role(server.process.pid)
            out[c] = serving_client.run(
                server.url, model, serving_client.random_ids(args.input_len, args.output_len),
                args.prompts_per_slot * c, c, args.log_dir / f"bench-guard-{name}-c{c}.log",
                args.output_len)
            after = cpu_by_role(server.process.pid)
            tokens = out[c].get("total_output_tokens") or args.prompts_per_slot * c \
                * args.output_len
            out[c]["cpu_per_1k"] = {r: (after[r] - before[r]) * 1000 / tokens for r in ROLES}
            say(f"  c={c}: {out[c]['output_throughput']:.1f} output tok/s, TPOT "
                f"{out[c]['mean_tpot_ms']:.1f} ms; CPU s per 1000 tokens: " + ", ".join(
                    f"{r} {v:.2f}" for r, v in out[c]["cpu_per_1k"].items()))
    return out


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    other = f"{args.against} ({args.against_hash[:9]})" if args.against_hash else None
    trees = {THIS: {}}  # tree -> its environment
    try:
        if other:
            trees[other] = {"PYTHONPATH": python_path(checkout(args.against_hash))}
    except subprocess.CalledProcessError as exc:
        print(f"bench_guard: error: could not set up {other}: {exc.stderr or exc}",
              file=sys.stderr)
        return 1
    bound = {}  # the bound's environment: this tree, and the folder of its sitecustomize
    if args.no_expert_compute:
        bound = {"PYTHONPATH": os.pathsep.join(
            p for p in (str(NO_COMPUTE), os.environ.get("PYTHONPATH", "")) if p)}
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    eaas = (*base, *shlex.split(args.eaas_args))
    # ratios[tree][c] = ([throughput ratio per run], [TPOT ratio per run])
    rows = [*trees, *([BOUND] if bound else [])]
    ratios = {tree: {c: ([], []) for c in args.concurrency} for tree in rows}
    # cpu[(tree, kind)][c][role] = [CPU seconds per 1000 output tokens, per run]
    cpu = {(tree, kind): {c: {r: [] for r in ROLES} for c in args.concurrency}
           for tree in trees for kind in ("monolithic", "eaas")}
    if bound:
        cpu[BOUND, "eaas"] = {c: {r: [] for r in ROLES} for c in args.concurrency}
    args.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for run in range(args.runs):
            order = list(trees) if run % 2 == 0 else list(reversed(trees))
            for tree in order:
                tag = "this" if tree == THIS else args.against_hash[:9]
                say(f"run {run + 1}/{args.runs}: {tree}")
                mono = measure(trees[tree], model, base, f"{tag}-monolithic", args)
                measured = [(tree, measure(trees[tree], model, eaas, f"{tag}-eaas", args))]
                if tree == THIS and bound:
                    measured.append((BOUND, measure(bound, model, eaas, "no-expert-compute",
                                                    args)))
                for c in args.concurrency:
                    for r, v in mono[c]["cpu_per_1k"].items():
                        cpu[tree, "monolithic"][c][r].append(v)
                    for row, ours in measured:
                        for r, v in ours[c]["cpu_per_1k"].items():
                            cpu[row, "eaas"][c][r].append(v)
                        ratios[row][c][0].append(ours[c]["output_throughput"]
                                                 / mono[c]["output_throughput"])
                        ratios[row][c][1].append(ours[c]["mean_tpot_ms"]
                                                 / mono[c]["mean_tpot_ms"])
    except ServerError as exc:
        print(f"bench_guard: error: a server failed to start: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"bench_guard: error while measuring: {exc}", file=sys.stderr)
        return 1
    lines = [f"`--eaas` path (`{args.eaas_args}`) of this tree (`{git_commit()}`)"
             + (f" and of {other}" if other else "")
             + (", and of this tree with expert servers whose kernel returns zeros without "
                "computing (a bound: every cost but the experts' arithmetic; its outputs are "
                "wrong)" if bound else "")
             + ", each against monolithic SGLang from the same tree; bench checkpoint; "
             f"`sglang.bench_serving --dataset-name random-ids --random-input-len "
             f"{args.input_len} --random-output-len {args.output_len}`, "
             f"{args.prompts_per_slot}xC prompts at concurrency C; median [min-max] of "
             f"{args.runs} runs (higher throughput ratio and lower TPOT ratio are better):", "",
             "| tree | C | output tok/s, eaas / monolithic | TPOT, eaas / monolithic |",
             "|---|---:|---:|---:|"]
    for tree in rows:
        for c in args.concurrency:
            lines.append(f"| {tree} | {c} | {spread(ratios[tree][c][0], '.2f', 'x')} | "
                         f"{spread(ratios[tree][c][1], '.2f', 'x')} |")
    if other:
        lines += ["", f"This tree over {other} (ratio of the medians):"]
        for c in args.concurrency:
            ours, theirs = ratios[THIS][c], ratios[other][c]
            speed = statistics.median(ours[0]) / statistics.median(theirs[0])
            tpot = statistics.median(ours[1]) / statistics.median(theirs[1])
            lines.append(f"- c={c}: throughput ratio {speed:.2f}x, TPOT ratio {tpot:.2f}x")
    lines += ["", "CPU seconds per 1000 output tokens (user + system, read around each "
              "bench_serving run; median of the runs): SGLang's scheduler (the rank), the expert "
              "servers, the rest (launcher, tokenizer, detokenizer):", "",
              "| tree | server | C | scheduler | expert servers | rest | all |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for (tree, kind), per_c in cpu.items():
        for c, by in per_c.items():
            med = {r: statistics.median(v) for r, v in by.items()}
            lines.append(f"| {tree} | {kind} | {c} | " + " | ".join(
                f"{med[r]:.2f}" for r in ROLES) + f" | {sum(med.values()):.2f} |")
    report.add("\n".join(lines))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
