"""Concurrent greedy streaming requests against an SGLang server, with something done to the
tier while they decode (a fault, a move, a switch)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import requests


def stream(url: str, prompt, tokens: int, first: threading.Barrier) -> tuple[list[int], dict]:
    """One greedy streaming /generate of ``tokens`` new tokens: (output ids, finish reason);
    waits at ``first`` once its first token came."""
    key = "text" if isinstance(prompt, str) else "input_ids"
    body = {key: prompt, "stream": True, "sampling_params": {
        "max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}}
    ids, reason, waited = [], None, False
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            ids, reason = chunk["output_ids"], chunk["meta_info"]["finish_reason"]
            if not waited:
                waited = True
                first.wait(timeout=120)  # every stream has its first token: the fault comes
    return ids, reason


def concurrent_streams(url: str, prompts, tokens: int, fault: Callable[[], object] = lambda: None
                       ) -> list[list[int]]:
    """``prompts`` streamed at once; ``fault()`` runs once every stream has its first token,
    and must return while some are still decoding (asserted). The output ids, in order."""
    first = threading.Barrier(len(prompts) + 1)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream, url, p, tokens, first) for p in prompts]
        first.wait(timeout=120)
        fault()
        under_way = sum(not f.done() for f in futures)
        results = [f.result() for f in futures]
    assert under_way, "every stream had finished before the fault"  # it is mid-stream
    assert all(reason == {"type": "length", "length": tokens} for _, reason in results), (
        [reason for _, reason in results])
    return [ids for ids, _ in results]
