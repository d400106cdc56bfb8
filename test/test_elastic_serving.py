"""SGLang with --eaas resized 2 -> 4 -> 2 expert servers through its admin API while 16
streams generate (docs/elastic.md): no request fails and every output is token-identical to
the same prompt's before any resize (float32, a top-4 model, so partial sums from several
servers add in another order when the placement changes)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import requests
from conftest import model_path, start_server

from sglang_eaas.protocol.operations import TOKEN_HEADER
from sglang_eaas.tools import scale
from sglang_eaas.tools.make_tiny_model import PRESETS

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang through the CPU runtime

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
STREAMS = 16
NEW_TOKENS = 16
PROMPTS = [f"Request {i}: the experts of layer {i % 4} answer" for i in range(STREAMS)]


@pytest.fixture(scope="module")
def server():
    made = start_server(model_path(PRESETS["tiny-top4"]), "--eaas", "--eaas-expert-servers",
                        "local:2", name="elastic-serving")
    yield made
    made.stop()


def _tier(server) -> dict:
    reply = requests.get(f"{server.url}/eaas/tier", headers={TOKEN_HEADER: TOKEN}, timeout=30)
    reply.raise_for_status()
    return reply.json()


def test_resized_under_load_token_identical(server, capsys):
    expected = {p: server.generate(p, NEW_TOKENS)["output_ids"] for p in PROMPTS}
    assert len(_tier(server)["active"]) == 2
    failures, outputs, stop = [], [], threading.Event()

    def stream(i: int):
        while not stop.is_set():
            prompt = PROMPTS[i]
            try:
                outputs.append((prompt, server.generate(prompt, NEW_TOKENS)["output_ids"]))
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                failures.append(f"{prompt}: {exc}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        assert scale.main([server.url, "to", "4", "--id", "out-1"]) == 0
        tier = _tier(server)
        assert len(tier["active"]) == 4 and tier["operation"]["state"] == "done"
        # the same id again: the same operation, nothing started
        assert scale.main([server.url, "to", "4", "--id", "out-1"]) == 0
        assert "already asked for" in capsys.readouterr().out
        time.sleep(2)
        assert scale.main([server.url, "to", "2", "--id", "in-1"]) == 0
        assert len(_tier(server)["active"]) == 2
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert not failures, failures[:3]
    assert len(outputs) >= 2 * STREAMS
    wrong = [p for p, out in outputs if out != expected[p]]
    assert not wrong, f"{len(wrong)} of {len(outputs)} outputs differ, e.g. {wrong[0]!r}"


def test_admin_api_refusals(server):
    url = f"{server.url}/eaas/scale"
    assert requests.post(url, json={"servers": 3}, timeout=30).status_code == 401
    bad = requests.post(url, json={"servers": 0}, headers={TOKEN_HEADER: TOKEN}, timeout=30)
    assert bad.status_code == 400 and "servers" in bad.json()["error"]
    missing = requests.get(f"{server.url}/eaas/operations/nope", headers={TOKEN_HEADER: TOKEN},
                           timeout=30)
    assert missing.status_code == 404
    assert scale.main([server.url, "to", "2", "--id", "same"]) == 0  # already 2: a no-op
    assert scale.main([server.url, "to", "3", "--id", "same"]) == 1  # that id asked for 2
    # out of bounds: refused before anything starts, in one sentence (the tiny top-4 model's
    # 16 experts, held once: at most 16 servers hold something)
    for body, why in [({"servers": 1000}, "984 servers would hold nothing"),
                      ({"servers": 17}, "1 servers would hold nothing"),
                      ({"retire": ["127.0.0.1:1"]}, "do not serve in the tier"),
                      ({"servers": 3, "colour": "red"}, "the body is"),
                      ({"servers": 3, "id": "no spaces"}, "an operation id is")]:
        reply = requests.post(url, json=body, headers={TOKEN_HEADER: TOKEN}, timeout=30)
        assert reply.status_code == 400 and why in reply.json()["error"], (body, reply.text)
        assert "\n" not in reply.json()["error"]
    tier = _tier(server)
    assert len(tier["active"]) == 2 and tier["max_servers"] == 16
    listed = requests.get(f"{server.url}/eaas/operations", headers={TOKEN_HEADER: TOKEN},
                          timeout=30).json()
    assert [op["id"] for op in listed["operations"]][:1] == ["same"]
    assert listed["operations"][0]["state"] == "done" and not listed["holder"]


def test_the_autoscaler_scales_out_under_a_load_step_and_in_when_it_ends():
    """Targets no request can meet (1 ms to first token) under a load of 4 streams: two
    violated 1 s windows scale the tier out by one; when the load stops, empty windows are
    slack and, after the cooldown, it scales back in. Every decision reaches /eaas/tier and
    /metrics."""
    made = start_server(
        model_path(PRESETS["tiny-top4"]), "--eaas", "--eaas-expert-servers", "local:1",
        "--enable-metrics", "--eaas-autoscale", "--eaas-autoscale-ttft", "0.001",
        "--eaas-autoscale-tpot", "10", "--eaas-autoscale-window", "1",
        "--eaas-autoscale-cooldown", "8", "--eaas-autoscale-max-servers", "2",
        "--eaas-autoscale-busy-out", "0",  # the tiny model's servers idle: not the point here
        name="elastic-autoscale")
    stop, failures = threading.Event(), []

    def stream(i: int):
        while not stop.is_set():
            try:
                made.generate(PROMPTS[i], 4)
            except Exception as exc:  # noqa: BLE001
                failures.append(str(exc))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(_tier(made)["active"]) < 2:
            assert time.monotonic() < deadline, f"no scale-out: {_tier(made)}"
            time.sleep(0.5)
        tier = _tier(made)
        assert tier["autoscale"]["direction"] == "out" and tier["autoscale"]["desired"] == 2
        assert "attainment 0%" in tier["autoscale"]["reason"]
        stop.set()
        for t in threads:
            t.join(120)
        while len(_tier(made)["active"]) > 1:
            assert time.monotonic() < deadline + 120, f"no scale-in: {_tier(made)}"
            time.sleep(0.5)
        assert _tier(made)["autoscale"]["direction"] == "in"
        metrics = requests.get(f"{made.url}/metrics", timeout=30).text
        assert 'sglang_eaas_autoscale_decisions_total{direction="out"}' in metrics
        assert "sglang_eaas_autoscale_desired_servers" in metrics
        assert not failures, failures[:3]
    finally:
        stop.set()
        made.stop()
