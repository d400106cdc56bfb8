"""SGLang's own serving benchmark, ``python -m sglang.bench_serving`` (unchanged), as a child
process: one run against a URL, its log kept, its result record returned."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path


def random_ids(input_len: int, output_len: int) -> list[str]:
    """bench_serving's dataset flags for prompts of ``input_len`` random token ids and outputs of
    exactly ``output_len`` tokens."""
    return ["--dataset-name", "random-ids", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--random-range-ratio", "1.0"]


def run(url: str, tokenizer: Path, dataset_args: list[str], num_prompts: int,
        concurrency: int, log: Path, output_len: int | None = None) -> dict:
    """One ``python -m sglang.bench_serving --backend sglang`` run against ``url`` with
    ``dataset_args`` (``--dataset-name ...`` and its flags); the JSON record it writes (with
    ``--output-details``: every request's output length, text and error). Raises RuntimeError
    naming the log when it fails, or (``output_len`` given) when a request it counts as
    successful did not stream ``output_len`` tokens (``short_outputs``)."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.jsonl"
        command = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
                   "--base-url", url, *dataset_args, "--num-prompts", str(num_prompts),
                   "--max-concurrency", str(concurrency), "--tokenizer", str(tokenizer),
                   "--seed", "0", "--output-file", str(result_file), "--disable-tqdm",
                   "--output-details"]
        with open(log, "w") as out:
            out.write(f"$ {shlex.join(command)}\n")
            out.flush()
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
        if done.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"sglang.bench_serving exited with {done.returncode}; see {log}")
        record = json.loads(result_file.read_text().splitlines()[-1])
    problem = short_outputs(record, output_len) if output_len is not None else ""
    if problem:
        raise RuntimeError(f"sglang.bench_serving: {problem}; see {log}")
    return record


def short_outputs(record: dict, output_len: int) -> str:
    """Why ``record``'s requests are not all complete ("" when they are): bench_serving counts
    a request as successful on HTTP 200 alone, so a stream the server ended early (an abort
    mid-request) passes as a success with fewer tokens, or, aborted before any text, with the
    requested count and no text. Every one must have ``output_len`` tokens, text and no
    error."""
    lens = record.get("output_lens") or []
    texts = record.get("generated_texts") or [None] * len(lens)
    errors = record.get("errors") or [""] * len(lens)
    bad = [i for i, (n, text, error) in enumerate(zip(lens, texts, errors))
           if n != output_len or not text or error]
    if not lens:
        return "its record has no per-request output lengths (--output-details)"
    if not bad:
        return ""
    i = bad[0]
    return (f"{len(bad)} of {len(lens)} requests did not stream {output_len} tokens with text "
            f"(request {i}: {lens[i]} tokens, {len(texts[i] or '')} characters of text, error "
            f"{errors[i]!r})")
