"""bench_balance's live part: one SGLang ``--eaas`` deployment, each policy's placement made live
in turn (``balance.apply``), and a closed loop of streaming decode requests under each.

SGLang serves the trained checkpoint with an embedded monitor and N local expert servers that
start with the even placement (``--eaas-placement``). For each placement in order: the moves
from the live one to it (adds from a peer, then drops), a short settle, then ``concurrency``
closed loops of streaming ``/generate`` requests (text prompts, greedy, ``ignore_eos``) for
``duration`` seconds, in ``rounds`` rounds, every other one in reverse order (so that a drift of
the machine over the run cancels out of the means). Throughput counts the tokens that arrive
after the first ``WARMUP`` seconds; TPOT is (last - first token) / (tokens - 1) of the requests
that finished.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


from sglang_eaas import cpu_runtime, envs
from sglang_eaas.balance.apply import apply_placement
from sglang_eaas.membership import current_snapshot
from sglang_eaas.addresses import free_port
from sglang_eaas.holdings import Holdings
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer

from bench_lib.streams import closed_loop

WARMUP = 3.0  # seconds of each run left out of the throughput (requests starting up)
SETTLE = 2.0  # seconds after a re-placement before the load starts (dropped experts' grace)
WARMUP_RUN = 20.0  # seconds of load before the first measured run


@dataclass
class LiveResult:
    """One placement over the rounds: replicas added to get there from the placement served
    before it, seconds the apply took, decode tok/s and TPOT per round, failed requests."""

    label: str
    moved: list[int] = field(default_factory=list)
    apply_seconds: list[float] = field(default_factory=list)
    tok_s: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    failed: int = 0
    first_failure: str = ""


def _prompts(prompts: list[str], concurrency: int) -> Callable[[int, int], str]:
    """Worker ``w``'s ``n``-th request: the prompts dealt round-robin over the workers."""
    return lambda worker, n: prompts[(worker + n * concurrency) % len(prompts)]


def _server_names(live: Holdings, even: Holdings) -> dict[str, str]:
    """Live server id -> the benchmark's name, matched by what each holds in the even
    placement it started with."""
    names = {}
    for live_id, held in live.items():
        for name, want in even.items():
            if held == want:
                names[live_id] = name
    if len(set(names.values())) != len(even):
        raise RuntimeError(f"the live servers do not hold the even placement: {live}")
    return names


def run_live(model: Path, even: Holdings, placements: list[tuple[str, Holdings]],
             prompts: list[str], args, say: Callable[[str], None]) -> list[LiveResult]:
    """``placements``: (label, holdings by the benchmark's server names) in the order to
    serve."""
    placement_file = args.log_dir / "bench-balance-placement.json"
    placement_file.parent.mkdir(parents=True, exist_ok=True)
    placement_file.write_text(json.dumps(even.to_message()))
    monitor = f"127.0.0.1:{free_port()}"
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    token = envs.TOKEN.get()
    log_path = args.log_dir / "bench-balance.log"
    say(f"starting SGLang --eaas with {len(even)} expert servers (log: {log_path})")
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    server = SGLangServer(model, *base, "--eaas", "--eaas-placement", str(placement_file),
                          "--eaas-monitor", f"embedded:{monitor}", log_path=log_path).start()
    try:
        def snapshot():
            return current_snapshot(monitor, token).holdings()

        names = _server_names(snapshot(), even)
        ids = {name: live_id for live_id, name in names.items()}
        say(f"warm-up: {WARMUP_RUN:.0f} s of requests")
        closed_loop(server.url, _prompts(prompts, args.live_concurrency),
                    args.live_output_len, args.live_concurrency,
                    WARMUP_RUN)
        results = {label: LiveResult(label) for label, _ in placements}
        for round_ in range(args.live_rounds):  # odd rounds in reverse: drift cancels
            for label, target in placements[::-1] if round_ % 2 else placements:
                serve(server.url, snapshot, ids, names, label, target, prompts, args,
                      results[label], say)
    finally:
        server.stop()
    return list(results.values())


def serve(url: str, snapshot, ids: dict, names: dict, label: str, target: Holdings,
          prompts: list[str], args, result: LiveResult, say: Callable[[str], None]) -> None:
    """Make ``target`` live, then run the closed loop under it; adds to ``result``."""
    done = apply_placement(snapshot(), Holdings({ids[s]: per for s, per in target.items()}),
                           envs.TOKEN.get(), grace=1.0)
    time.sleep(SETTLE)
    if Holdings({names[k]: v for k, v in snapshot().items()}) != target:
        say(f"  warning: {label}: the monitor does not show the target placement yet")
    run = closed_loop(url, _prompts(prompts, args.live_concurrency), args.live_output_len,
                      args.live_concurrency,
                      args.live_duration)
    tokens = sum(t - run.started >= WARMUP for times in run.arrivals for t in times)
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in run.finished if len(t) > 1]
    result.moved.append(sum(len(c.adds) for c in done.changes))
    result.apply_seconds.append(done.seconds)
    result.tok_s.append(tokens / (args.live_duration - WARMUP))
    result.tpot_ms.append(statistics.mean(tpots) * 1e3 if tpots else float("nan"))
    result.failed += len(run.failed)
    result.first_failure = result.first_failure or (run.failed[0] if run.failed else "")
    say(f"  {label}: {result.moved[-1]} replicas added in {done.seconds:.2f} s; "
        f"{result.tok_s[-1]:.1f} tok/s, TPOT {result.tpot_ms[-1]:.1f} ms, {len(run.failed)} "
        f"failed")
