"""Benchmark: decode throughput of a replicated deployment while expert servers are killed one by
one (or while replicas are moved between servers, ``--fault replace``), against the same
deployment without failures (the EaaS paper's Fig. 10 protocol, §5.4, at CPU scale). With
``--hog``, instead: the failure detector's table (``bench_lib/detection.py``), detection times
against false suspicions and losses, quiet and with the cores saturated.

One SGLang server (--eaas, embedded monitor) on the bench checkpoint with N local expert servers,
each expert on R of them. A closed loop of C concurrent streaming requests runs for D seconds
twice: first with no failure (the baseline), then with K servers killed (kill -9, or SIGSTOP with
--fault stop) at even intervals; the replicas take over, nothing is restarted. From the streamed
chunks' arrival times it reports the average decode throughput of both runs and the drop, for each
failure the longest stall of any request between two of its tokens and the time from the failure
to full throughput, the failed requests, and a plot of throughput over time (PNG).

``--fault replace`` fails nothing: at the same instants it re-places experts live
(``balance.apply``): in every MoE layer each server hands a quarter of its experts to the next
server that lacks them (added there from a peer's copy, then dropped at the giver), the move
issue 12 asks to measure: the longest gap between two decode steps during a re-placement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path


from sglang_eaas import cpu_runtime, envs
from sglang_eaas.balance.apply import apply_placement
from sglang_eaas.config import RESULT_TIMEOUT
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.membership import current_snapshot
from sglang_eaas.protocol.control import probe
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model
from sglang_eaas.addresses import free_port
from sglang_eaas.holdings import Holdings
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer, ServerError

from bench_lib.report import Report, default_out, pyplot, save_figure, say
from bench_lib.streams import Run, closed_loop, longest_gap, throughput

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3.0  # seconds at the start of each run left out of the averages (prefill ramp)
FULL = 0.9  # "full throughput": a 1 s window at >= this share of the baseline's median window
DONE = {"kill": "killed (kill -9)", "stop": "hung (SIGSTOP)", "replace": "re-placements"}



def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The default run takes about 3 minutes on 2 CPU cores (one server start, two "
        "60 s runs); --hog about 10 (2 timings x 2 conditions x 3 runs of about a minute), 5 "
        "more per condition added; --hog --sglang about 2 plus 3 windows per condition. Run "
        "it on an otherwise idle machine (--hog makes its own load).")
    p.add_argument("--servers", type=int, default=4, help="expert servers; default 4")
    p.add_argument("--replicas", type=int, default=3,
                   help="holders of each expert (at most --servers); default 3")
    p.add_argument("--kills", type=int, default=2,
                   help="servers failed one by one in the fault run (at most --replicas - 1, so "
                   "every expert keeps a holder); default 2")
    p.add_argument("--fault", choices=["kill", "stop", "replace"], default="kill",
                   help="kill -9, SIGSTOP (a hung server, found by the monitor's heartbeats), or "
                   "replace: no failure, --kills live re-placements of a quarter of every "
                   "server's experts instead; default kill")
    p.add_argument("--duration", type=float, default=60.0,
                   help="seconds of load per run; default 60")
    p.add_argument("--concurrency", type=int, default=None,
                   help="concurrent streaming requests, each replaced when it ends; default 8 "
                   "(12 with --sglang)")
    p.add_argument("--input-len", type=int, default=16, help="prompt tokens; default 16")
    p.add_argument("--output-len", type=int, default=256,
                   help="tokens per request (ignore_eos); default 256")
    p.add_argument("--bin", type=float, default=0.5,
                   help="seconds per point of the throughput plot; default 0.5")
    p.add_argument("--hog", type=int, nargs="?", const=2 * (os.cpu_count() or 1), default=None,
                   metavar="N",
                   help="instead of the throughput runs, the failure detector's table "
                   "(bench_lib/detection.py): detection time of kill -9, SIGSTOP and a "
                   "partition from the monitor against false suspicions and losses, for the "
                   "one-stage timings of before and today's defaults, quiet and with N busy "
                   "processes (default: twice the cores) running")
    p.add_argument("--memory-pressure", type=float, default=0.0, metavar="GB",
                   help="with --hog: a third condition, the hog plus a process holding and "
                   "touching this many GB; default none")
    p.add_argument("--fsync-writer", action="store_true",
                   help="with --hog: one more condition, the hog plus a process writing and "
                   "fsyncing a file under .cache (a neighbour's checkpoint or log)")
    p.add_argument("--sglang", action="store_true",
                   help="with --hog: instead of the detector's table, the heartbeats' cadence "
                   "with SGLang in the loop (bench_lib/detection_serving.py): a monitor with "
                   "the default timings, 2 expert servers holding every expert, SGLang --eaas "
                   "with default flags serving --concurrency greedy streams (default 12 here), "
                   "a --window per condition and run")
    p.add_argument("--runs", type=int, default=3,
                   help="with --hog: measurements per timings and condition; default 3")
    p.add_argument("--window", type=float, default=20.0,
                   help="with --hog: seconds of serving with no fault per measurement, for "
                   "the false suspicions and the heartbeats' cadence; default 20")
    p.add_argument("--tokens", type=int, default=2048,
                   help="with --hog: rows per step of the stepping client; default 2048, the "
                   "expert servers' --max-tokens: each server's longest batch")
    p.add_argument("--log-dir", type=Path, default=ROOT / ".cache" / "logs",
                   help="where the server logs go; default .cache/logs")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown report; default .cache/bench/faults.md (replacement.md with "
                   "--fault replace, detection.md with --hog)")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of throughput over time; default: --out with .png (bench_paste "
                   "copies it to docs/img/)")
    args = p.parse_args()
    if args.hog is not None:
        if not 1 <= args.hog <= 256 or args.runs < 1 or args.window < 5 or args.tokens < 1:
            p.error("--hog needs 1-256 processes, --runs >= 1, --window >= 5, --tokens >= 1")
        if args.memory_pressure < 0:
            p.error("--memory-pressure must be >= 0 GB")
        args.concurrency = 12 if args.concurrency is None else args.concurrency
        if args.concurrency < 1:
            p.error("--concurrency must be >= 1")
        args.out = args.out or default_out("detection-sglang" if args.sglang else "detection")
        return args
    if args.memory_pressure or args.fsync_writer or args.sglang:
        p.error("--memory-pressure, --fsync-writer and --sglang apply with --hog")
    args.concurrency = 8 if args.concurrency is None else args.concurrency
    args.out = args.out or default_out("replacement" if args.fault == "replace" else "faults")
    args.plot = args.plot or args.out.with_suffix(".png")
    if not 1 <= args.replicas <= args.servers:
        p.error("--replicas must be between 1 and --servers")
    if args.fault != "replace" and not 0 <= args.kills < args.replicas:
        p.error("--kills must be below --replicas, or some expert loses its last holder")
    if args.fault == "replace" and (args.kills < 0 or args.replicas >= args.servers):
        p.error("--fault replace needs --kills >= 0 and --replicas below --servers (a server "
                "that lacks an expert to move it to)")
    if (min(args.concurrency, args.input_len) < 1 or args.output_len < 2
            or args.duration <= 2 * WARMUP):
        p.error(f"--concurrency and --input-len must be >= 1, --output-len >= 2, --duration > "
                f"{2 * WARMUP:.0f}")
    return args


def placement(servers: int, replicas: int, experts: int) -> dict[str, list[int]]:
    """Expert e on servers e, e+1, ..., e+R-1 (mod N): any R-1 failures leave a holder."""
    return {f"local:{s}": [e for e in range(experts)
                           if any((e + j) % servers == s for j in range(replicas))]
            for s in range(servers)}


def fault_label(args) -> str:
    return (f"{args.kills} live re-placements" if args.fault == "replace" else
            f"{args.kills} servers {DONE[args.fault]}")


def rotated(current: Holdings, step: int) -> Holdings:
    """``current`` with, in every MoE layer, every ``4``th expert of each server (offset by
    ``step``) moved to the next server (by id) that holds no copy of it: each expert keeps its
    number of holders, so coverage never changes."""
    servers = sorted(current)
    target = {s: {layer: set(ids) for layer, ids in layers.items()} for s, layers in
              current.items()}
    for i, giver in enumerate(servers):
        taker = servers[(i + 1) % len(servers)]
        for layer, ids in current[giver].items():
            for e in sorted(ids)[step % 4::4]:
                if e in target[giver][layer] and e not in target[taker].setdefault(layer, set()):
                    target[giver][layer].discard(e)
                    target[taker][layer].add(e)
    return Holdings(target)


def load(url: str, args, vocab: int, seed: int, faults=lambda run: None) -> Run:
    """``--concurrency`` closed loops of streaming requests (random prompt token ids) for
    ``--duration`` seconds; ``faults(run)`` runs meanwhile (in its own thread)."""
    rngs = [random.Random(seed * 1000 + worker) for worker in range(args.concurrency)]

    def prompt_of(worker: int, n: int) -> list[int]:
        return [rngs[worker].randrange(vocab) for _ in range(args.input_len)]

    return closed_loop(url, prompt_of, args.output_len, args.concurrency, args.duration,
                       during=faults)


def windows(run: Run, duration: float) -> list[float]:
    """Throughput of every 1 s window after the warm-up, in 0.1 s steps."""
    return [throughput(run, t / 10, t / 10 + 1) for t in range(int(WARMUP * 10),
                                                                  int((duration - 1) * 10))]


def recovery(run: Run, kill_at: float, full: float, duration: float) -> float | None:
    """Seconds from ``kill_at`` to the first 1 s window at full throughput."""
    t = kill_at
    while t + 1 <= duration:
        if throughput(run, t, t + 1) >= full:
            return t - kill_at
        t += 0.1
    return None


def plot(path: Path, base: Run, faulty: Run, kills: list[float], args) -> None:
    plt = pyplot()
    if plt is None:
        return
    edges = [i * args.bin for i in range(int(args.duration / args.bin))]
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=110)
    faulty_label = fault_label(args)
    for run, label in ((base, "no failure"), (faulty, faulty_label)):
        ax.plot([e + args.bin / 2 for e in edges],
                [throughput(run, e, e + args.bin) for e in edges], label=label)
    for i, at in enumerate(kills):
        ax.axvline(at, color="red", linestyle="--", linewidth=1,
                   label="failure" if i == 0 else None)
    ax.set_xlabel("seconds")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{args.servers} expert servers, each expert on {args.replicas}; "
                 f"{args.concurrency} concurrent streams")
    ax.legend(loc="lower right")
    ax.set_ylim(bottom=0)
    save_figure(fig, path)


def detection_study(args, report: Report, model: Path) -> int:
    """``--hog``: the failure detector's table (bench_lib/detection.py)."""
    from bench_lib import detection
    from bench_lib.hog import Hog

    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    conditions = {"quiet": None,
                  f"hog: {args.hog} busy processes": lambda: Hog(args.hog)}
    if args.fsync_writer:
        disk = ROOT / ".cache"
        conditions["hog + a writer fsyncing 1 MB blocks"] = lambda: Hog(args.hog,
                                                                        write_to=str(disk))
    if args.memory_pressure:
        conditions[f"hog + {args.memory_pressure:g} GB held"] = lambda: Hog(
            args.hog, args.memory_pressure)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.sglang:
        return _serving_study(args, report, model, conditions)
    results: dict[tuple[str, str], list] = {}
    log_path = args.log_dir / "bench-detection-servers.log"
    notes = []
    with open(log_path, "w") as log:
        for run in range(args.runs):
            for condition, make in conditions.items():
                with (make() if make else contextlib.nullcontext()):
                    for timings, values in detection.TIMINGS.items():
                        say(f"run {run + 1}/{args.runs}, {condition}, {timings}")
                        measured = detection.measure(model, values, args.window, args.tokens,
                                                     log)
                        notes += [f"{timings}, {condition}, run {run + 1}: {n}"
                                  for n in measured.notes]
                        results.setdefault((timings, condition), []).append(measured)
    report.add("\n".join([
        f"Failure detection (`bench_faults.py --hog`): a TCP monitor, {detection.SERVERS} expert "
        f"servers on the bench checkpoint (each expert on {detection.REPLICAS}), one behind a "
        f"relay that is cut for the partition, and an in-process client stepping every MoE "
        f"layer on {args.tokens} rows; per measurement a {args.window:g} s window with no "
        f"fault, then kill -9, SIGSTOP (then SIGCONT) and a partition of one server from the "
        f"monitor alone. Timings are heartbeat / suspect / loss; the client's result timeout "
        f"is {RESULT_TIMEOUT:g} s. Median [min-max] of {args.runs} runs; every loss in the "
        f"window is false (nothing failed there):",
        "", *detection.table(results, args.window), "",
        "Against the strongest baseline for detection time (the one-stage timings, which drop "
        "a member soonest), in the same run:", *detection.ratios(results),
        *(["", "Notes: " + "; ".join(notes)] if notes else [])]))
    report.save()
    return 0


def _serving_study(args, report: Report, model: Path, conditions: dict) -> int:
    """``--hog --sglang``: the heartbeats' cadence with SGLang serving
    (bench_lib/detection_serving.py)."""
    from bench_lib import detection_serving as serving
    from sglang_eaas.membership import HEARTBEAT, LOSS_TIMEOUT, SUSPECT_TIMEOUT

    results = serving.serve(model, conditions, args.runs, args.window, args.concurrency,
                            args.log_dir)
    report.add("\n".join([
        f"Heartbeats with SGLang in the loop (`bench_faults.py --hog --sglang`): a monitor with "
        f"the default timings (heartbeat {HEARTBEAT:g} s, suspect {SUSPECT_TIMEOUT:g} s, loss "
        f"{LOSS_TIMEOUT:g} s), 2 expert servers each holding every expert of the bench "
        f"checkpoint, SGLang --eaas with default flags serving {args.concurrency} closed loops "
        f"of greedy streams ({serving.INPUT_LEN} random prompt tokens, {serving.OUTPUT_LEN} "
        f"output tokens); a {args.window:g} s window per condition and run, median [min-max] "
        f"of {args.runs} runs. Nothing failed: every suspicion and loss is false. A gap over "
        f"{serving.ONE_STAGE_LOSS:g} s would have been a false loss for the one-stage detector "
        f"of before (an embedded monitor's loss timeout):",
        "", *serving.table(results)]))
    report.save()
    return 0


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    if args.hog is not None:
        return detection_study(args, report, model)
    config = json.loads((model / "config.json").read_text())
    plan = placement(args.servers, args.replicas,
                     MoeModelInfo.from_model_path(model).num_experts)
    placement_file = args.log_dir / "bench-faults-placement.json"
    placement_file.parent.mkdir(parents=True, exist_ok=True)
    placement_file.write_text(json.dumps({"servers": plan}))
    monitor = f"127.0.0.1:{free_port()}"
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    base_args = CPU_ARGS if cpu_runtime.is_active() else ()
    log_path = args.log_dir / "bench-faults.log"
    say(f"starting SGLang --eaas with {args.servers} expert servers (log: {log_path})")
    try:
        server = SGLangServer(model, *base_args, "--eaas", "--eaas-placement", str(placement_file),
                              "--eaas-monitor", f"embedded:{monitor}", log_path=log_path).start()
    except ServerError as exc:
        print(f"bench: error: SGLang failed to start: {exc}", file=sys.stderr)
        return 1
    try:
        servers = sorted(m.id for m in current_snapshot(monitor, envs.TOKEN.get()).servers())
        kill_at = [args.duration * (i + 1) / (args.kills + 1) for i in range(args.kills)]
        took: list[float] = []  # --fault replace: how long each move took
        if args.fault == "replace":
            victims = [f"move {i + 1}" for i in range(args.kills)]
            pids = {}
        else:
            victims = servers[:args.kills]
            pids = {a: probe(a, envs.TOKEN.get()).pid for a in victims}
        sig = signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP

        def faults(run: Run) -> None:
            for i, (at, victim) in enumerate(zip(kill_at, victims)):
                time.sleep(max(0.0, run.started + at - time.perf_counter()))
                if args.fault == "replace":
                    current = current_snapshot(monitor, envs.TOKEN.get()).holdings()
                    done = apply_placement(current, rotated(current, i), envs.TOKEN.get(),
                                           grace=1.0)
                    took.append(done.seconds)
                    say(f"  {victim} at {time.perf_counter() - run.started:.1f} s: "
                        f"{sum(len(c.adds) for c in done.changes)} replicas added "
                        f"({done.from_peer} from peers) and as many dropped in "
                        f"{done.seconds:.2f} s")
                    continue
                os.kill(pids[victim], sig)
                say(f"  {args.fault} {victim} at {time.perf_counter() - run.started:.1f} s")

        say(f"baseline: {args.concurrency} streams for {args.duration:.0f} s, no failure")
        base = load(server.url, args, config["vocab_size"], seed=1)
        say(f"fault run: the same, {args.fault} {len(victims)} servers at "
            f"{', '.join(f'{t:.0f}' for t in kill_at)} s")
        faulty = load(server.url, args, config["vocab_size"], seed=1, faults=faults)
    finally:
        for pid in (pids.values() if "pids" in locals() else ()):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()

    span = (WARMUP, args.duration)
    base_avg, fault_avg = throughput(base, *span), throughput(faulty, *span)
    full = FULL * statistics.median(windows(base, args.duration))
    base_gap = longest_gap(base, *span)
    drop = 1 - fault_avg / base_avg
    lines = [
        f"bench checkpoint `{model.name}`; {args.servers} local expert servers, each expert on "
        f"{args.replicas} (embedded monitor, result timeout {RESULT_TIMEOUT:g} s); "
        f"{args.concurrency} concurrent streaming requests ({args.input_len} random prompt "
        f"tokens, {args.output_len} output tokens, each replaced when it ends) for "
        f"{args.duration:.0f} s per run; averages leave out the first {WARMUP:.0f} s:",
        "",
        "| run | decode tok/s | vs no failure | failed requests | longest wait between two "
        "tokens of a request |",
        "|---|---:|---:|---:|---:|",
        f"| no failure | {base_avg:.1f} | 1.00x | {len(base.failed)} | "
        f"{base_gap * 1e3:.0f} ms |",
        f"| {fault_label(args)} | {fault_avg:.1f} | "
        f"{fault_avg / base_avg:.3f}x | {len(faulty.failed)} | "
        f"{longest_gap(faulty, *span) * 1e3:.0f} ms |",
        "",
        ("| move | at | took | longest wait between two tokens of a request, during the move "
         "and the 3 s after | time to full throughput |" if args.fault == "replace" else
         "| failure | at | server | longest wait between two tokens of a request, the 3 s "
         "after | time to full throughput |"),
        "|---:|---:|---|---:|---:|",
    ]
    stalls = []
    for i, (at, victim) in enumerate(zip(kill_at, victims)):
        # a move lasts: its window is the move and the 3 s after it
        stall = longest_gap(faulty, at, at + (took[i] if i < len(took) else 0.0) + 3)
        stalls.append(stall)
        back = recovery(faulty, at, full, args.duration)
        what = f"{took[i]:.1f} s" if args.fault == "replace" and i < len(took) else victim
        lines.append(f"| {i + 1} | {at:.0f} s | {what} | {stall * 1e3:.0f} ms | "
                     + (f"{back:.1f} s |" if back is not None else "not within the run |"))
    lines += [
        "",
        f"Full throughput: a 1 s window at {FULL:.0%} of the no-failure run's median window "
        f"({full:.1f} tok/s). Goals (issue 10): an average drop of at most 2% (average "
        f"throughput {-drop:+.1%}: {'met' if drop <= 0.02 else 'NOT met'}); longest stall "
        f"<= result timeout + 0.5 s = "
        f"{RESULT_TIMEOUT + 0.5:g} s ({max(stalls, default=0):.2f} s: "
        f"{'met' if max(stalls, default=0) <= RESULT_TIMEOUT + 0.5 else 'NOT met'}); zero failed "
        f"requests ({len(faulty.failed)}: {'met' if not faulty.failed else 'NOT met'}).",
    ]
    if args.fault == "replace":
        lines[-1] = (
            f"Re-placement (issue 12): the longest wait between two tokens of a request during "
            f"a move or the 3 s after, {max(stalls, default=0) * 1e3:.0f} ms, against "
            f"{base_gap * 1e3:.0f} ms anywhere in the run without moves "
            f"({max(stalls, default=0) / base_gap:.2f}x); failed requests "
            f"{len(faulty.failed)}; average throughput {-drop:+.1%}.")
    if faulty.failed:
        lines.append("First failures: " + "; ".join(faulty.failed[:3]))
    report.add("\n".join(lines))
    plot(args.plot, base, faulty, kill_at, args)
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
