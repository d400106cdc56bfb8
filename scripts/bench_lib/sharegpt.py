"""A ShareGPT-format file made on this machine, for ``python -m sglang.bench_serving
--dataset-name sharegpt --dataset-path FILE`` without a download.

ShareGPT's format is a JSON list of ``{"id", "conversations": [{"from": "human", "value"},
{"from": "gpt", "value"}, ...]}``; bench_serving keeps the first two turns, takes the human one
as the prompt and the gpt one's token count as the output length. Here each conversation is a
piece of the interpreter's standard library sources (``sglang_eaas.corpus``, the held-out files:
text the trained checkpoint never saw): a run of lines as the prompt and the lines after it as
the answer, with lengths drawn from a seeded generator, so the file is the same on every run of
the same Python.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from sglang_eaas.corpus import corpus_files, is_held_out, read_text, stdlib_root


def conversations(count: int, seed: int = 0, prompt_lines: tuple[int, int] = (4, 24),
                  answer_lines: tuple[int, int] = (2, 12)) -> list[dict]:
    """``count`` two-turn conversations cut from held-out stdlib sources."""
    root = stdlib_root()
    rng = random.Random(seed)
    files = [rel for rel in corpus_files(root) if is_held_out(rel)]
    out: list[dict] = []
    while len(out) < count:
        rel = rng.choice(files)
        lines = [line for line in read_text(root, rel).splitlines() if line.strip()]
        ask, answer = rng.randint(*prompt_lines), rng.randint(*answer_lines)
        if len(lines) < ask + answer:
            continue
        start = rng.randrange(len(lines) - ask - answer + 1)
        out.append({"id": f"{rel}:{start}", "conversations": [
            {"from": "human", "value": "\n".join(lines[start:start + ask])},
            {"from": "gpt", "value": "\n".join(lines[start + ask:start + ask + answer])},
        ]})
    return out


def write(path: Path, count: int, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(conversations(count, seed), indent=1))
    return path
