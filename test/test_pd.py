"""PD disaggregation with EaaS: SGLang's router in front of a prefill and a decode instance
(``--disaggregation-mode prefill|decode``, KV over SGLang's Mooncake backend on TCP), both
``--eaas`` clients of one pool of expert servers behind a standalone monitor.

On the trained checkpoint (top-4, float32): greedy tokens through router -> prefill -> decode
equal monolithic SGLang's without PD, one request at a time and eight streams at once; and
with every expert held by two servers, one killed (SIGKILL) while the eight streams decode loses
no request and changes no token.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from conftest import TRAINED, open_log, start_server
from streams import concurrent_streams
from sglang_eaas.addresses import free_port
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.protocol.control import probe

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang through the CPU runtime

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
PROMPTS = (
    "def fib(n):",
    "import json\n\n\ndef load(path):",
    "class Stack:\n    def push(self",
    "    while True:\n        line =",
)
STREAMS = (*PROMPTS, "from collections import", "# Copyright", "def __repr__(self):",
           "    raise ValueError(")  # eight
NEW_TOKENS = 24
STREAM_TOKENS = 40
EVERY_EXPERT = {layer: list(range(32)) for layer in range(4)}
PD = ("--disaggregation-transfer-backend", "mooncake_tcp")


class Router:
    """``python -m sglang_router.launch_router --pd-disaggregation`` on a free loopback port."""

    def __init__(self, prefill_url: str, bootstrap_port: int, decode_url: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open_log("pd-router")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url,
             "--host", "127.0.0.1", "--port", str(self.port),
             # its Prometheus exporter listens too (default port 29000: one router a host)
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while not self._ready():
            assert self.process.poll() is None, "the router exited; see its log"
            assert time.monotonic() < deadline, "the router did not become ready"
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def generate(self, prompt: str, tokens: int) -> list[int]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": tokens,
                                                     "temperature": 0.0, "ignore_eos": True}}
        response = requests.post(f"{self.url}/generate", json=body, timeout=300)
        response.raise_for_status()
        return response.json()["output_ids"]

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(30)
        self.log.close()


@pytest.fixture(scope="module")
def pd():
    """Monitor, two expert servers each holding every expert, prefill, decode and the router."""
    monitor_address = f"127.0.0.1:{free_port()}"
    log = open_log("pd-expert-tier")
    monitor = subprocess.Popen([sys.executable, "-m", "sglang_eaas.monitor", "--listen",
                                monitor_address], stdout=log, stderr=subprocess.STDOUT)
    servers = start_local_servers(TRAINED, [EVERY_EXPERT, EVERY_EXPERT], "float32",
                                  max_clients=4, stdout=log,
                                  extra_args=("--monitor", monitor_address))
    bootstrap = free_port()
    eaas = ("--eaas", "--eaas-monitor", monitor_address)
    started = []
    try:
        prefill = start_server(TRAINED, *eaas, *PD, "--disaggregation-mode", "prefill",
                               "--disaggregation-bootstrap-port", str(bootstrap),
                               name="pd-prefill")
        started.append(prefill)
        decode = start_server(TRAINED, *eaas, *PD, "--disaggregation-mode", "decode",
                              name="pd-decode")
        started.append(decode)
        router = Router(prefill.url, bootstrap, decode.url)
        yield router, servers
        router.stop()
    finally:
        for process in (*reversed(started), *servers):
            process.stop()
        monitor.terminate()
        monitor.wait(30)
        log.close()


def test_pd_with_eaas_is_token_identical_to_monolithic(pd, monolithic_trained):
    router, servers = pd
    expected = [monolithic_trained.generate(p, NEW_TOKENS)["output_ids"] for p in PROMPTS]
    assert [router.generate(p, NEW_TOKENS) for p in PROMPTS] == expected
    # Both instances are clients of the one pool: each server has the prefill's and the
    # decode's rank joined.
    assert [probe(s.address, TOKEN).clients for s in servers] == [2, 2]


def test_a_replicated_expert_server_killed_during_pd_serving_loses_no_request(
        pd, monolithic_trained):
    router, servers = pd
    expected = concurrent_streams(monolithic_trained.url, STREAMS, STREAM_TOKENS)
    assert concurrent_streams(router.url, STREAMS, STREAM_TOKENS) == expected

    def kill():
        time.sleep(0.3)  # a few decode steps in
        os.kill(servers[0].process.pid, signal.SIGKILL)

    assert concurrent_streams(router.url, STREAMS, STREAM_TOKENS, kill) == expected
    assert servers[0].process.wait(10) == -signal.SIGKILL
    # The survivor served the decode instance's steps after the kill.
    assert probe(servers[1].address, TOKEN).clients == 2
