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
        concurrency: int, log: Path) -> dict:
    """One ``python -m sglang.bench_serving --backend sglang`` run against ``url`` with
    ``dataset_args`` (``--dataset-name ...`` and its flags); the JSON record it writes.
    Raises RuntimeError naming the log when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.jsonl"
        command = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang",
                   "--base-url", url, *dataset_args, "--num-prompts", str(num_prompts),
                   "--max-concurrency", str(concurrency), "--tokenizer", str(tokenizer),
                   "--seed", "0", "--output-file", str(result_file), "--disable-tqdm"]
        with open(log, "w") as out:
            out.write(f"$ {shlex.join(command)}\n")
            out.flush()
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
        if done.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"sglang.bench_serving exited with {done.returncode}; see {log}")
        return json.loads(result_file.read_text().splitlines()[-1])
