"""Two hosts on one machine (docs/deployment.md, "Two hosts"): network namespaces joined by a
veth pair, etcd and two expert servers in one, SGLang in the other. SGLang finds the servers
through the etcd monitor across the network and reaches their slots over Mooncake's Transfer
Engine on TCP; its greedy tokens on the trained checkpoint (top-4, float32) equal monolithic
SGLang's on one host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_LOGS, TRAINED
from netns import OWNER_IP

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang through the CPU runtime

HERE = Path(__file__).resolve().parent
PROMPTS = ("def fib(n):", "class Stack:\n    def push(self", "import json\n\n\ndef load(path):")
NEW_TOKENS = 24


def in_host(host: str, script: str, *args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", host, sys.executable, str(HERE / script),
                             *args], env=os.environ.copy(), text=True, **popen)


def test_sglang_on_one_host_serves_with_expert_servers_and_etcd_on_another(
        two_hosts, monolithic_trained):
    expert_host, sglang_host = two_hosts
    logs = TEST_LOGS
    logs.mkdir(parents=True, exist_ok=True)
    experts = in_host(expert_host, "netns_expert_host.py", str(TRAINED), OWNER_IP, str(logs),
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        ready = experts.stdout.readline().split()
        assert ready[:1] == ["ready"], "the expert host did not start; see two-hosts-*.log"
        etcd_url, addresses = ready[1], ready[2:]
        assert etcd_url.startswith(f"etcd://{OWNER_IP}:")
        assert len(addresses) == 2 and all(a.startswith(f"{OWNER_IP}:") for a in addresses)
        sglang = in_host(sglang_host, "netns_sglang_host.py", str(TRAINED), etcd_url,
                         str(logs / "two-hosts-sglang.log"), str(NEW_TOKENS),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        out, _ = sglang.communicate(json.dumps(PROMPTS), timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("tokens ")]
        assert sglang.returncode == 0 and lines, f"SGLang host failed: {out[-2000:]}"
        tokens = json.loads(lines[-1].split(" ", 1)[1])
    finally:
        experts.stdin.close()
        served = experts.stdout.read().split()
        experts.wait(60)
    expected = [monolithic_trained.generate(p, NEW_TOKENS)["output_ids"] for p in PROMPTS]
    assert tokens == expected
    # The expert math was done on the other host: its servers answered SGLang's slot requests.
    assert served[:1] == ["served"] and int(served[1]) > 0
