"""The trained checkpoint (models/tiny-moe-stdlib: 32 experts, top-4, routing learned from the
CPython sources, so its expert load is skewed) served by SGLang, monolithic and with --eaas over
two local expert servers and an embedded monitor: greedy tokens identical in float32, the load
windows it records show the skew, and a live rebalance (``tools.rebalance``, replicas loaded
from a peer and dropped while requests run) changes no token."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
from conftest import TRAINED as MODEL, start_server
from sglang_eaas.balance.load import read_dump, total
from sglang_eaas.addresses import free_port

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang through the CPU runtime

PROMPTS = (
    'def read_config(path):\n    """',
    "import os\nimport sys\n\n\ndef main(",
    "class Queue:\n    def __init__(self",
    "    for key, value in sorted(",
    "try:\n    import",
    "# Licensed to the Python Software Foundation",
)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def monolithic(monolithic_trained):
    return monolithic_trained


@pytest.fixture(scope="module")
def eaas(tmp_path_factory):
    monitor = f"127.0.0.1:{free_port()}"
    dump = tmp_path_factory.mktemp("load") / "load.jsonl"
    server = start_server(MODEL, "--eaas", "--eaas-expert-servers", "local:2", "--eaas-monitor",
                          f"embedded:{monitor}", "--eaas-load-dump", str(dump),
                          "--eaas-load-window", "4", name="trained-eaas")
    server.monitor, server.dump = monitor, dump
    yield server
    server.stop()


def _tokens(server) -> list[list[int]]:
    return [server.generate(p, NEW_TOKENS)["output_ids"] for p in PROMPTS]


def test_eaas_is_token_identical_and_records_the_skew(monolithic, eaas):
    expected = _tokens(monolithic)
    assert _tokens(eaas) == expected
    loads = total(read_dump(eaas.dump))  # [layers, experts] tokens routed by SGLang's router
    per_layer = loads.sum(axis=1)
    assert (per_layer == per_layer[0]).all() and per_layer[0] > 0  # top-4 of every token
    skew = loads.max(axis=1) / loads.mean(axis=1)
    assert (skew > 1.5).all(), skew  # learned routing, not noise


def test_a_live_rebalance_changes_no_token(monolithic, eaas, tmp_path):
    """tools.rebalance moves replicas while requests run; the tokens stay the monolithic
    ones, during and after."""
    expected = _tokens(monolithic)
    during: list[list[list[int]]] = []
    worker = threading.Thread(target=lambda: during.extend(_tokens(eaas) for _ in range(2)))
    worker.start()
    run = subprocess.run([sys.executable, "-m", "sglang_eaas.tools.rebalance", "--monitor",
                          eaas.monitor, "--slots", "20", "--grace", "0.5", "--state",
                          str(tmp_path / "state.json")], env=dict(os.environ),
                         capture_output=True, text=True, timeout=300)
    worker.join(600)
    assert run.returncode == 0, run.stderr
    added = re.search(r"rebalance: (\d+) replicas added \((\d+) from peers", run.stdout)
    assert added and int(added.group(1)) > 0 and added.group(1) == added.group(2), run.stdout
    assert "entries the servers computed since they started" in run.stdout, run.stdout
    ratios = re.findall(r"busiest server measured ([\d.]+)x the mean, modelled ([\d.]+)x -> "
                        r"plan ([\d.]+)x", run.stdout)
    assert ratios and all(float(a) <= float(b) + 1e-9 for _, b, a in ratios), run.stdout
    assert during == [expected, expected]
    assert _tokens(eaas) == expected
    log = eaas.log_path.read_text()
    assert re.search(r"expert server \S+ now holds experts per MoE layer", log)
