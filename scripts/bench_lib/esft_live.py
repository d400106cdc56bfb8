"""bench_esft's live part: base-only SGLang ``--eaas`` against ``--eaas --eaas-esft`` serving 0, 1,
5, 20 ESFT adapters loaded at runtime, under the same closed loop of streaming requests.

Both servers have the same expert tier: ``--eaas-expert-servers local:N`` (the even placement)
and an embedded monitor, and (unless asked) no radix cache: prompts repeat, and a run with
fewer adapters has fewer distinct (prompt, adapter) pairs, so cache hits would make its prefills
cheaper than the others'. Both stay up for the whole run (an idle deployment takes about 1% of
the machine's CPU, measured), but only one is ever loaded: the machine's cores are shared by
SGLang, the expert servers and the load generator. For each adapter count, in increasing order:
the ESFT server loads adapters through ``POST /load_lora_adapter`` up to it, then ``rounds``
pairs of runs, one on each server, back to back (the base-only one first in even rounds), so
each ratio compares two runs a few seconds apart and the machine's drift over the run (large
on this VM) falls on both. With N adapters every request names one of them (``lora_path``),
dealt round-robin so each adapter gets 1/N of the requests, each with a prompt of its domain;
the base-only and the 0-adapter runs send the prompts of all adapters, without an adapter.

Per run: decode throughput is the tokens arriving after the first ``WARMUP`` seconds over the
rest of the run; TPOT is (last - first token) / (tokens - 1) of the requests that finished
and had their first token after ``WARMUP``; TTFT is first token - send, of the requests sent
after ``WARMUP``. Around each run, the expert servers' kernel time and layer calls and the
deployment's CPU time by process are read (``esft_probes.py``: CPU per 1000 tokens counts the
whole run); after each load, the expert servers' weight bytes.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import requests

from sglang_eaas import cpu_runtime, envs
from sglang_eaas.addresses import free_port
from sglang_eaas.tools.server_process import CPU_ARGS, SGLangServer

from bench_lib.esft_probes import cpu_seconds, expert_servers, expert_weight_bytes, kernel_totals
from bench_lib.esft_workload import Adapter
from bench_lib.streams import closed_loop

WARMUP = 3.0  # seconds of each run left out (requests starting up, new adapter experts)
BASE = "base-only"


@dataclass
class Measured:
    """One configuration's runs: per run decode tok/s, mean TPOT and TTFT (ms), and the expert
    servers' kernel time per layer call (µs: their ``expert_load`` nanoseconds over their
    ``batches``, each one server's call for one MoE layer of one step)."""

    label: str
    tok_s: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    kernel_us: list[float] = field(default_factory=list)
    cpu_ms: dict[str, list[float]] = field(default_factory=dict)  # role -> per 1000 tokens
    requests: int = 0
    failed: int = 0
    first_failure: str = ""


@dataclass
class Live:
    """What the live part measured: per adapter count (``"0"``, ``"1"``..) the ESFT server's
    runs and the base-only runs paired with them (``base[label]``, run i next to run i), the
    expert servers' weight bytes (``base-only`` and per count), adapter load seconds."""

    runs: dict[str, Measured]
    base: dict[str, Measured]
    weight_bytes: dict[str, int] = field(default_factory=dict)
    load_seconds: list[float] = field(default_factory=list)
    changed_outputs: tuple[int, int, int] = (0, 0, 0)
    logs: list[Path] = field(default_factory=list)


def _start(model: Path, esft: bool, args, log_path: Path) -> tuple[SGLangServer, str]:
    monitor = f"127.0.0.1:{free_port()}"
    base = CPU_ARGS if cpu_runtime.is_active() else ()
    extra = (("--eaas-esft",) if esft else ()) + (
        () if args.radix_cache else ("--disable-radix-cache",))
    server = SGLangServer(model, *base, "--eaas", "--eaas-expert-servers",
                          f"local:{args.servers}", "--eaas-monitor", f"embedded:{monitor}",
                          *extra, log_path=log_path).start()
    return server, monitor


def _load(url: str, adapter: Adapter) -> float:
    started = time.perf_counter()
    reply = requests.post(f"{url}/load_lora_adapter", json={
        "lora_name": adapter.name, "lora_path": str(adapter.path)}, timeout=300)
    if not reply.ok or not reply.json().get("success"):
        raise RuntimeError(f"loading ESFT adapter {adapter.name} failed: HTTP "
                           f"{reply.status_code} {reply.text[:300]}")
    return time.perf_counter() - started


def _workload(names: list[str | None], prompts: dict[str, list[list[int]]],
              concurrency: int) -> tuple[Callable, Callable]:
    """(prompt_of, fields_of): request i = worker + n x concurrency goes to ``names[i % len]``
    (None: no adapter, the prompts of every adapter in turn)."""
    every = [p for ps in zip(*prompts.values()) for p in ps]  # interleaved over the adapters

    def index(worker: int, n: int) -> int:
        return worker + n * concurrency

    def prompt_of(worker: int, n: int) -> list[int]:
        i = index(worker, n)
        name = names[i % len(names)]
        pool = every if name is None else prompts[name]
        return pool[(i // len(names)) % len(pool)]

    def fields_of(worker: int, n: int) -> dict:
        name = names[index(worker, n) % len(names)]
        return {} if name is None else {"lora_path": name}

    return prompt_of, fields_of


def _measure(url: str, group: int, servers: list[str], names: list[str | None], prompts, args,
             result: Measured, say: Callable[[str], None]) -> None:
    prompt_of, fields_of = _workload(names, prompts, args.concurrency)
    cpu_before, before = cpu_seconds(group), kernel_totals(servers)
    run = closed_loop(url, prompt_of, args.output_len, args.concurrency, args.duration,
                      fields_of=fields_of)
    ns, calls = (b - a for a, b in zip(before, kernel_totals(servers)))
    result.kernel_us.append(ns / calls / 1e3 if calls else float("nan"))
    generated = sum(len(times) for times in run.arrivals)
    for role, seconds in cpu_seconds(group).items():
        result.cpu_ms.setdefault(role, []).append(
            (seconds - cpu_before[role]) * 1e6 / max(generated, 1))
    tokens = sum(t - run.started >= WARMUP for times in run.arrivals for t in times)
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in run.finished
             if len(t) > 1 and t[0] - run.started >= WARMUP]
    ttfts = [times[0] - sent for times, sent in zip(run.arrivals, run.sent)
             if times and sent - run.started >= WARMUP]
    result.tok_s.append(tokens / (args.duration - WARMUP))
    result.tpot_ms.append(statistics.mean(tpots) * 1e3 if tpots else float("nan"))
    result.ttft_ms.append(statistics.mean(ttfts) * 1e3 if ttfts else float("nan"))
    result.requests += len(run.finished)
    result.failed += len(run.failed)
    result.first_failure = result.first_failure or (run.failed[0] if run.failed else "")
    say(f"  {result.label}: {result.tok_s[-1]:.1f} tok/s, TPOT {result.tpot_ms[-1]:.1f} ms, "
        f"TTFT {result.ttft_ms[-1]:.1f} ms, expert kernel {result.kernel_us[-1]:.1f} us per layer "
        f"call, {len(run.finished)} requests, {len(run.failed)} "
        "failed")


def _changed(url: str, adapters: list[Adapter], prompts) -> tuple[int, int, int]:
    """(adapters whose greedy 16 tokens' logprobs on their first prompt differ from the base
    model's, those whose tokens differ too, adapters): the adapter runs really run adapters."""
    def generate(ids, name):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0},
                "return_logprob": True, **({"lora_path": name} if name else {})}
        reply = requests.post(f"{url}/generate", json=body, timeout=120)
        reply.raise_for_status()
        out = reply.json()
        return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]

    logprobs = tokens = 0
    for a in adapters:
        (ids_a, lp_a), (ids_b, lp_b) = (generate(prompts[a.name][0], name)
                                        for name in (a.name, None))
        logprobs += lp_a != lp_b
        tokens += ids_a != ids_b
    return logprobs, tokens, len(adapters)


def run_live(model: Path, adapters: list[Adapter], prompts: dict[str, list[list[int]]], args,
             say: Callable[[str], None]) -> Live:
    os.environ.setdefault(envs.TOKEN.name, os.urandom(16).hex())
    labels = [str(n) for n in args.adapters]
    live = Live({n: Measured(f"ESFT, {n} adapters") for n in labels},
                {n: Measured(BASE) for n in labels})
    live.logs = [args.log_dir / "bench-esft-base.log", args.log_dir / "bench-esft.log"]
    servers = []
    try:
        for esft, log in zip((False, True), live.logs):
            say(f"starting SGLang {'--eaas --eaas-esft' if esft else '--eaas (base-only)'} "
                f"with {args.servers} local expert servers (log: {log})")
            servers.append(_start(model, esft, args, log))
        (base, base_monitor), (esft, monitor) = servers
        tiers = {base.url: expert_servers(base_monitor), esft.url: expert_servers(monitor)}
        for server in (base, esft):  # one at a time
            say(f"warm-up: {args.warmup:g} s on {server.url}")
            closed_loop(server.url, _workload([None], prompts, args.concurrency)[0],
                        args.output_len, args.concurrency, args.warmup)
        live.weight_bytes[BASE] = expert_weight_bytes(base_monitor)
        loaded = 0
        for count, label in zip(args.adapters, labels):
            live.load_seconds += [_load(esft.url, a) for a in adapters[loaded:count]]
            loaded = count
            live.weight_bytes[label] = expert_weight_bytes(monitor)
            names = [a.name for a in adapters[:count]] or [None]
            say(f"{count} adapters loaded: {args.rounds} pairs of runs")
            for round_ in range(args.rounds):  # odd rounds: the ESFT run first
                pair = [(base, [None], live.base[label]), (esft, names, live.runs[label])]
                for server, served, result in pair[::-1] if round_ % 2 else pair:
                    _measure(server.url, server.process.pid, tiers[server.url], served,
                             prompts, args, result, say)
        if loaded:
            live.changed_outputs = _changed(esft.url, adapters[:loaded], prompts)
    finally:
        for server, _ in servers:
            server.stop()
    return live
