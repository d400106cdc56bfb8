"""A closed loop of streaming ``/generate`` requests: each of ``concurrency`` workers sends one
greedy request (``ignore_eos``), reads its streamed chunks, records each token's arrival time,
and sends the next when it ends, for ``duration`` seconds. What the throughput, TPOT and
longest-wait numbers of ``bench_faults``, ``bench_balance`` and ``bench_esft`` are computed
from."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import requests


@dataclass
class Run:
    """Every token's arrival (``perf_counter``), per request, and when the request was sent
    (``sent[i]`` is ``arrivals[i]``'s); the requests that ran to their length; the ones that
    failed before the loop stopped (their finish reason, cut short)."""

    started: float
    arrivals: list[list[float]] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)
    finished: list[list[float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    # (worker, n, output token ids) of each request that ran to its length
    outputs: list[tuple[int, int, list[int]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def closed_loop(url: str, prompt_of: Callable[[int, int], str | list[int]], output_len: int,
                concurrency: int, duration: float,
                during: Callable[[Run], None] = lambda run: None,
                fields_of: Callable[[int, int], dict] = lambda worker, n: {},
                active: Callable[[int, float], bool] = lambda worker, seconds: True) -> Run:
    """``prompt_of(worker, n)``: the prompt (text or token ids) of a worker's ``n``-th request;
    ``during(run)`` runs meanwhile, in a thread of its own (faults, moves); ``fields_of(worker,
    n)``: more fields of that request's body (e.g. ``lora_path``: an adapter); ``active(worker,
    seconds into the run)``: whether the worker sends its next request now (else it waits:
    a load that steps)."""
    run, stop = Run(time.perf_counter()), threading.Event()

    def loop(worker: int) -> None:
        n = 0
        while not stop.is_set():
            if not active(worker, time.perf_counter() - run.started):
                time.sleep(0.05)
                continue
            prompt, fields = prompt_of(worker, n), fields_of(worker, n)
            n += 1
            body = {"text" if isinstance(prompt, str) else "input_ids": prompt, "stream": True,
                    "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0,
                                        "ignore_eos": True}, **fields}
            times, reason, sent, ids = [], None, time.perf_counter(), []
            try:
                with requests.post(f"{url}/generate", json=body, stream=True,
                                   timeout=120) as response:
                    response.raise_for_status()
                    for line in response.iter_lines():
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        chunk = json.loads(line[len(b"data: "):])
                        meta = chunk["meta_info"]
                        ids = chunk.get("output_ids") or ids
                        times += [time.perf_counter()] * (meta["completion_tokens"] - len(times))
                        reason = meta["finish_reason"]
                        if stop.is_set():
                            break
            except requests.RequestException as exc:
                reason = {"type": "error", "message": str(exc)}
            with run.lock:
                run.arrivals.append(times)
                run.sent.append(sent)
                if (reason or {}).get("type") == "length":
                    run.finished.append(times)
                    run.outputs.append((worker, n - 1, list(ids)))
                elif not stop.is_set():
                    run.failed.append(json.dumps(reason)[:300])

    workers = [threading.Thread(target=loop, args=(w,)) for w in range(concurrency)]
    for w in workers:
        w.start()
    side = threading.Thread(target=during, args=(run,))
    side.start()
    time.sleep(duration)
    stop.set()
    for w in workers:
        w.join()
    side.join()
    return run


def tokens_between(run: Run, start: float, end: float) -> int:
    return sum(start <= t - run.started < end for times in run.arrivals for t in times)


def throughput(run: Run, start: float, end: float) -> float:
    return tokens_between(run, start, end) / (end - start)


def longest_gap(run: Run, start: float, end: float) -> float:
    """The longest wait of any request between two of its tokens (or from the window's start
    to its next token) within [start, end), in seconds."""
    longest = 0.0
    for times in run.arrivals:
        rel = [t - run.started for t in times]
        for a, b in zip(rel, rel[1:]):
            if b >= start and a < end:
                longest = max(longest, b - max(a, start))
    return longest
