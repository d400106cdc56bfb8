"""SGLang's own offline benchmarks with the plugin's flags, typed as docs/plugin.md ("SGLang's
benchmarks") has users type them: ``python -m sglang.benchmark.one_batch`` (its correctness
test prints the same prompts, logits and text with ``--eaas`` as without), ``...offline_throughput``
and ``...one_batch_server`` each run to their end with ``--eaas``, on two local expert servers
they start, on the trained checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import TRAINED

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang on the CPU runtime
EAAS = ("--eaas", "--eaas-expert-servers", "local:2")
READY = re.compile(r"^sglang-eaas expert server ready on \S+: experts \[[\d, ]+\] of 32, .*\n",
                   re.M)


def _bench(name: str, cwd, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", f"sglang.benchmark.{name}", "--model-path", str(TRAINED),
         "--device", "cpu", "--dtype", "float32", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name} {' '.join(args)}:\n{done.stderr[-3000:]}"
    return done


def test_one_batch_prints_what_sglang_alone_prints(tmp_path):
    args = ("--correctness-test", "--output-len", "8")
    alone = _bench("one_batch", tmp_path, *args).stdout
    eaas = _bench("one_batch", tmp_path, *args, *EAAS).stdout
    assert len(READY.findall(eaas)) == 2, eaas
    assert READY.sub("", eaas) == alone  # input ids, logits, texts
    assert alone.count("========== Prompt ") == 3


def test_offline_throughput_runs_every_prompt(tmp_path):
    from bench_lib import sharegpt

    dataset = sharegpt.write(tmp_path / "sharegpt.json", 8)
    out = _bench("offline_throughput", tmp_path, *EAAS, "--dataset-name", "sharegpt",
                 "--dataset-path", str(dataset), "--num-prompts", "8",
                 "--sharegpt-output-len", "8").stdout
    assert len(READY.findall(out)) == 2, out
    assert re.search(r"^Successful requests:\s+8\s*$", out, re.M), out
    assert re.search(r"^Total generated tokens:\s+64\s*$", out, re.M), out


def test_one_batch_server_runs_its_batch(tmp_path):
    out = _bench("one_batch_server", tmp_path, *EAAS, "--dataset-name", "random-ids",
                 "--batch-size", "2", "--input-len", "16", "--output-len", "8").stdout
    assert len(READY.findall(out)) == 2, out
    (record,) = [json.loads(line) for line in (tmp_path / "result.jsonl").read_text().splitlines()]
    assert (record["batch_size"], record["input_len"], record["output_len"]) == (2, 16, 8)
