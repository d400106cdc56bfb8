"""The trained checkpoint (models/tiny-moe-stdlib: 32 experts, top-4, routing learned from the
CPython sources, so its expert load is skewed) served by SGLang, monolithic and with --eaas over
two local expert servers and an embedded monitor: greedy tokens identical in float32, the load
windows it records show the skew, the balancer in the serving stack (``--eaas-balance
predictive``, acting from the start) re-places experts while the traffic's mix shifts and
changes no token, and a live rebalance (``tools.rebalance``, replicas loaded from a peer and
dropped while requests run, waiting for the balancer's operations) changes no token."""

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
# outside the stdlib the checkpoint was trained on: the mix the test shifts to
PROSE = (
    "The committee met on Tuesday to discuss the budget for the coming year, and",
    "Once upon a time, in a small village at the edge of a great forest, there",
    "The weather was cold and grey when the train finally pulled into the station",
    "In the spring of that year the river rose higher than anyone could remember",
)
# quick to act, so that a short test sees it: looks every 0.5 s, a low trigger, 3 s cooldown
BALANCER = ("--eaas-balance", "predictive", "--eaas-balance-period", "0.5",
            "--eaas-balance-horizon", "2", "--eaas-balance-trigger", "1.05",
            "--eaas-balance-cooldown", "3")


@pytest.fixture(scope="module")
def monolithic(monolithic_trained):
    return monolithic_trained


@pytest.fixture(scope="module")
def eaas(tmp_path_factory):
    monitor = f"127.0.0.1:{free_port()}"
    dump = tmp_path_factory.mktemp("load") / "load.jsonl"
    server = start_server(MODEL, "--eaas", "--eaas-expert-servers", "local:2", "--eaas-monitor",
                          f"embedded:{monitor}", "--eaas-load-dump", str(dump),
                          "--eaas-load-window", "4", "--enable-metrics", *BALANCER,
                          name="trained-eaas")
    server.monitor, server.dump = monitor, dump
    yield server
    server.stop()


def _tokens(server, prompts=PROMPTS) -> list[list[int]]:
    return [server.generate(p, NEW_TOKENS)["output_ids"] for p in prompts]


def _streams(server, prompts, seconds: float, until=lambda: False) -> list[tuple[str, list]]:
    """One worker per prompt sending it again and again for ``seconds`` (or until ``until()``
    after the first round): every (prompt, tokens) it got; a failed request raises."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    deadline = time.monotonic() + seconds

    def worker(prompt: str) -> list[tuple[str, list]]:
        out = []
        while not out or (time.monotonic() < deadline and not until()):
            out.append((prompt, server.generate(prompt, NEW_TOKENS)["output_ids"]))
        return out

    with ThreadPoolExecutor(len(prompts)) as pool:
        return [pair for pairs in pool.map(worker, prompts) for pair in pairs]


def _metric(server, name: str) -> dict[str, float]:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{server.url}/metrics", timeout=30).text
    return {"/".join(f"{k}={v}" for k, v in sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def test_eaas_is_token_identical_and_records_the_skew(monolithic, eaas):
    expected = _tokens(monolithic)
    assert _tokens(eaas) == expected
    loads = total(read_dump(eaas.dump))  # [layers, experts] tokens routed by SGLang's router
    per_layer = loads.sum(axis=1)
    assert (per_layer == per_layer[0]).all() and per_layer[0] > 0  # top-4 of every token
    skew = loads.max(axis=1) / loads.mean(axis=1)
    assert (skew > 1.5).all(), skew  # learned routing, not noise


def test_the_balancer_re_places_while_the_mix_shifts_and_changes_no_token(monolithic, eaas):
    """Stdlib code, then prose (a mix the checkpoint never saw), 4 streams without pause: the
    predictive balancer re-places experts (its operations in the log), no request fails and
    every token is the monolithic one; /metrics shows the forecast's accuracy and cost."""
    code, prose = list(PROMPTS[:4]), list(PROSE)
    expected = dict(zip(code + prose, _tokens(monolithic, code + prose)))
    before = len(eaas.log_path.read_text())
    got = _streams(eaas, code, seconds=10) + _streams(eaas, prose, seconds=40, until=lambda: (
        re.search(r"eaas balance: \d+ replicas added .* \(operation \S+\)",
                  eaas.log_path.read_text()[before:])))
    assert got and all(tokens == expected[prompt] for prompt, tokens in got)
    log = eaas.log_path.read_text()[before:]
    assert re.search(r"eaas balance \(predictive\): re-placing: ", log), log[-3000:]
    assert re.search(r"eaas balance: \d+ replicas added .* \(operation \S+\)", log), log[-3000:]
    overlap = _metric(eaas, "sglang_eaas_balance_estimate_overlap")
    assert 0 < overlap["estimate=predictive"] <= 1 and 0 < overlap["estimate=reactive"] <= 1
    cost = _metric(eaas, "sglang_eaas_balance_forecast_cost_share")[""]
    assert 0 < cost < 0.5, cost  # measured, not asserted small: docs/balancing.md says what


def test_a_live_rebalance_changes_no_token(monolithic, eaas, tmp_path):
    """tools.rebalance moves replicas while requests run; the tokens stay the monolithic
    ones, during and after."""
    expected = _tokens(monolithic)
    during: list[list[list[int]]] = []
    worker = threading.Thread(target=lambda: during.extend(_tokens(eaas) for _ in range(2)))
    worker.start()
    # The server's own balancer (BALANCER) has usually balanced the tier for this test's mix
    # by then, on 2 servers by which experts each holds alone (1.00-1.07x), and moeless, warm
    # from a placement that good, adds nothing ("the placement stays as it is", 2026-11-29).
    # SGLang's EPLB placement fills every slot it is given with replicas of the hottest experts
    # whatever the placement before, so a pass of it within 24 slots always moves replicas.
    run = subprocess.run([sys.executable, "-m", "sglang_eaas.tools.rebalance", "--monitor",
                          eaas.monitor, "--policy", "eplb", "--slots", "24", "--grace", "0.5",
                          "--state", str(tmp_path / "state.json"), "--wait", "120"],
                         env=dict(os.environ), capture_output=True, text=True, timeout=300)
    worker.join(600)
    assert run.returncode == 0, run.stderr
    added = re.search(r"rebalance: (\d+) replicas added \((\d+) from peers, (\d+) from disk",
                      run.stdout)
    # none from disk: over the fabric from peers (a few may already be on the server itself)
    assert added and int(added.group(1)) > 0 and added.group(3) == "0", run.stdout
    assert "entries the servers computed since they started" in run.stdout, run.stdout
    ratios = re.findall(r"busiest server measured ([\d.]+)x the mean, modelled ([\d.]+)x -> "
                        r"plan ([\d.]+)x", run.stdout)
    assert len(ratios) == 4, run.stdout  # a line per MoE layer (EPLB need not beat moeless)
    assert during == [expected, expected]
    assert _tokens(eaas) == expected
    log = eaas.log_path.read_text()
    assert re.search(r"expert server \S+ now holds experts per MoE layer", log)
