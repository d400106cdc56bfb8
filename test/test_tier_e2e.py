"""SGLang with a live expert tier, under faults, over the embedded monitor and over etcd.

Each deployment: one SGLang server (--tp 1) and three expert servers: S0 and S1 hold every
expert of every MoE layer except one, E of layer 1, which only X holds. Eight concurrent
streaming requests are compared with the same requests in the same deployment before any fault
(greedy, so a failure must not change a single token): a server killed mid-stream, one hung
(SIGSTOP) then resumed, one drained, a new one joined; then X, the only holder of E, is killed:
the requests that need E end with HTTP 503 naming the layer and expert, the others are
untouched, and a replacement restores full service. Last, a second SGLang server (--tp 2)
shares the pool: when one of its ranks hangs or dies, every expert server takes that rank's
slots back within the monitor's loss timeout, and the first server's requests go on.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
from conftest import PROMPTS, TEST_LOGS, open_log, start_server
from hf_reference import hf_greedy_routes
from streams import concurrent_streams
from sglang_eaas.balance.apply import apply_placement
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.membership import LOSS_TIMEOUT, connect
from sglang_eaas.protocol.control import probe
from sglang_eaas.tools.etcd_process import EtcdProcess
from sglang_eaas.addresses import free_port

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang through the CPU runtime
TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
STREAMS = (*PROMPTS, "Mixture of experts", "A stateless server", "def mul(a, b):",
           "The monitor sees", "Tokens go to")  # eight
STREAM_TOKENS = 48
LAYER = 1  # the MoE layer whose expert E only X holds
NUM_EXPERTS = 8


def _pick_lonely_expert(model: Path):
    """E, and short token-id requests whose every token avoids E in LAYER / needs it (with
    transformers' greedy output, which SGLang's float32 output equals)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 400) for _ in range(2)] for _ in range(40)]
    routes = hf_greedy_routes(model, prompts, 2)
    use = {e: sum(e in layers[LAYER] for _, layers in routes) for e in range(NUM_EXPERTS)}
    expert = min((e for e in use if use[e] >= 4), key=use.get)
    avoid = [(p, out) for p, (out, layers) in zip(prompts, routes) if expert not in layers[LAYER]]
    need = [p for p, (_, layers) in zip(prompts, routes) if expert in layers[LAYER]]
    return expert, avoid[:4], need[:4]


class Deployment:
    """An SGLang server, its monitor, and the expert servers of the pool (by address)."""

    def __init__(self, kind: str, model: Path, expert: int):
        self.kind, self.model, self.expert = kind, model, expert
        others = [e for e in range(NUM_EXPERTS)]
        self.placement = {  # S0, S1: all but (LAYER, E); X: only (LAYER, E)
            "s": {0: others, 1: [e for e in others if e != expert]},
            "x": {LAYER: [expert]},
        }
        self.log = open_log(f"tier-{kind}-expert-servers")
        self.started = []  # expert servers this test started (the embedded launcher's not)
        self.etcd = None
        if kind == "etcd":
            self.etcd = EtcdProcess(TEST_LOGS / "tier-etcd.log").start()
            self.monitor = self.etcd.url
            for entry in ("s", "s", "x"):
                self.add(entry)
            self.sglang = start_server(model, "--eaas", "--eaas-monitor", self.monitor,
                                       "--enable-metrics", name="tier-etcd")
        else:
            self.monitor = f"127.0.0.1:{free_port()}"
            placement = TEST_LOGS / "tier-placement.json"
            placement.write_text(json.dumps({"servers": {
                f"local:{i}": {str(k): v for k, v in self.placement[e].items()}
                for i, e in enumerate("ssx")}}))
            self.sglang = start_server(model, "--eaas", "--eaas-monitor",
                                       f"embedded:{self.monitor}", "--eaas-placement",
                                       str(placement), "--enable-metrics", name="tier-embedded")
        self.watcher = connect(self.monitor, TOKEN)

    def add(self, entry: str):
        """Start an expert server holding ``placement[entry]``, registered with the monitor."""
        (server,) = start_local_servers(self.model, [self.placement[entry]], "float32",
                                        max_clients=8, stdout=self.log,
                                        extra_args=("--monitor", self.monitor))
        self.started.append(server)
        return server.address

    def servers(self) -> dict[str, object]:
        return {m.id: m for m in self.watcher.watch(-1, 0.0).servers()}

    def holding(self, entry: str) -> list[str]:
        want = {layer: sorted(ids) for layer, ids in self.placement[entry].items()}
        return sorted(a for a, m in self.servers().items()
                      if {k: list(v) for k, v in m.holdings.items() if v} == want)

    def departure(self, address: str, incarnation: str, timeout: float):
        """The monitor's record of ``address``'s ``incarnation`` leaving, once it has left."""
        deadline = time.monotonic() + timeout
        while True:
            snapshot = self.watcher.watch(-1, 0.0)
            gone = next((g for g in snapshot.departures if g.incarnation == incarnation), None)
            if gone is not None and address not in {m.id for m in snapshot.servers()}:
                return gone
            assert time.monotonic() < deadline, f"the monitor has not lost {address}"
            time.sleep(0.1)

    def pid(self, address: str) -> int:
        return probe(address, TOKEN).pid

    def wait_in_use(self, address: str, timeout: float = 30.0) -> None:
        """Until the SGLang client has joined ``address``."""
        deadline = time.monotonic() + timeout
        while probe(address, TOKEN).clients < 1:
            assert time.monotonic() < deadline, f"SGLang did not join {address}"
            time.sleep(0.1)

    def close(self) -> None:
        self.sglang.stop()
        for server in self.started:
            server.stop()
        self.watcher.close()
        if self.etcd is not None:
            self.etcd.stop()
        self.log.close()


@pytest.fixture(scope="module")
def lonely(tiny_qwen3):
    return _pick_lonely_expert(tiny_qwen3)


@pytest.fixture(scope="module", params=["embedded", "etcd"])
def deployment(request, tiny_qwen3, lonely):
    made = Deployment(request.param, tiny_qwen3, lonely[0])
    made.baseline = _streams(made.sglang)  # the no-failure run
    yield made
    made.close()


def _streams(server, fault=lambda: None) -> list[list[int]]:
    """The eight streams at once; ``fault()`` runs once every stream has its first token."""
    return concurrent_streams(server.url, STREAMS, STREAM_TOKENS, fault)


def _metric(server, name: str) -> float:
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_a_server_killed_mid_stream_then_replaced(deployment):
    d = deployment
    victim = d.holding("s")[0]
    incarnation = d.servers()[victim].incarnation
    failovers = _metric(d.sglang, "sglang_eaas_failovers_total")
    tokens = _streams(d.sglang, lambda: os.kill(d.pid(victim), signal.SIGKILL))
    assert tokens == d.baseline
    # out of the monitor's table too (the next tests pick among its servers): over etcd because
    # SGLang reported the closed connection, or the lease would keep it for LOSS_TIMEOUT
    departure = d.departure(victim, incarnation, LOSS_TIMEOUT + 5)
    if d.kind == "etcd":
        assert departure.why.startswith("evicted: "), departure
    assert _metric(d.sglang, "sglang_eaas_failovers_total") >= failovers + 1
    log = d.sglang.log_path.read_text()
    assert re.search(rf"expert server {victim} leaves the table \(", log)
    replacement = d.add("s")  # joins at runtime: in the table at the next step, then traffic
    d.wait_in_use(replacement)
    before = probe(replacement, TOKEN).counter("requests")
    assert _streams(d.sglang) == d.baseline
    assert probe(replacement, TOKEN).counter("requests") > before
    assert re.search(rf"expert server {replacement} joined the table",
                     d.sglang.log_path.read_text())


def test_a_server_hung_mid_stream_comes_back_as_a_new_incarnation(deployment):
    d = deployment
    victim = d.holding("s")[-1]
    pid, first = d.pid(victim), d.servers()[victim].incarnation

    def hang():  # past the suspect timeout and a result timeout: a step that sent to it
        os.kill(pid, signal.SIGSTOP)  # before the suspicion evicts it
        threading.Timer(4.0, os.kill, (pid, signal.SIGCONT)).start()

    failovers = _metric(d.sglang, "sglang_eaas_failovers_total")
    assert _streams(d.sglang, hang) == d.baseline
    assert _metric(d.sglang, "sglang_eaas_failovers_total") >= failovers + 1
    deadline = time.monotonic() + 30
    while d.servers().get(victim) is None or d.servers()[victim].incarnation == first:
        assert time.monotonic() < deadline, "the resumed server did not register again"
        time.sleep(0.2)
    d.wait_in_use(victim)
    assert _streams(d.sglang) == d.baseline


def test_a_server_drained_mid_stream(deployment):
    d = deployment
    victim = d.holding("s")[0]
    pid = d.pid(victim)
    drain = []
    tokens = _streams(d.sglang, lambda: drain.append(subprocess.Popen(
        [sys.executable, "-m", "sglang_eaas.expert_server", "--drain", victim],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    out, err = drain[0].communicate(timeout=60)
    assert drain[0].returncode == 0, err
    assert tokens == d.baseline
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert victim not in d.servers()
    assert re.search(rf"expert server {victim} leaves the table \(draining\)",
                     d.sglang.log_path.read_text())
    d.wait_in_use(d.add("s"))  # back to two holders of everything


def test_the_only_holder_lost_then_replaced(deployment, lonely):
    d = deployment
    expert, avoid, need = lonely
    (x,) = d.holding("x")
    os.kill(d.pid(x), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while x in d.servers():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for prompt in need:
        started = time.monotonic()
        response = requests.post(f"{d.sglang.url}/generate", timeout=60, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0,
                                                     "ignore_eos": True}})
        assert response.status_code == 503, response.text
        assert f"experts [{expert}] of MoE layer {LAYER} have no live expert server" in (
            response.json()["message"])
        assert time.monotonic() - started < 10
    for prompt, out in avoid:  # requests that do not need E go on, and SGLang keeps serving
        assert d.sglang.generate(prompt, 2)["output_ids"] == out
    assert _metric(d.sglang, "sglang_eaas_missing_experts") == 1
    assert _metric(d.sglang, "sglang_eaas_failed_requests_total") >= len(need)
    d.wait_in_use(d.add("x"))
    for prompt, out in avoid:
        assert d.sglang.generate(prompt, 2)["output_ids"] == out
    for prompt in need:
        assert len(d.sglang.generate(prompt, 2)["output_ids"]) == 2
    assert _metric(d.sglang, "sglang_eaas_missing_experts") == 0
    assert _streams(d.sglang) == d.baseline


def test_status_shows_the_live_tier(deployment):
    status = subprocess.run([sys.executable, "-m", "sglang_eaas.status", "--monitor",
                             deployment.monitor], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "3 expert servers, 1 attention clients" in status.stdout
    assert f"layer {LAYER}: 1 with 1 holder, 7 with 2 holders" in status.stdout
    computed = re.findall(r"^(\S+:\d+)\s+(\d+)\s+(\d+)\s+([\d.]+) ms\s+(\d+) \(", status.stdout,
                          re.M)  # server, layer, tokens, ms, busiest expert
    assert {int(layer) for _, layer, *_ in computed} == {0, LAYER}, status.stdout
    assert all(int(tokens) > 0 and float(ms) > 0 for _, _, tokens, ms, _ in computed), (
        status.stdout)
    if deployment.kind == "embedded":  # the monitor's counters (etcd keeps none)
        assert re.search(r"^failure detection: (no suspicion, no loss|\d+ suspicions \(\d+ "
                         r"cleared by a heartbeat\); losses by reason: )", status.stdout, re.M), (
            status.stdout)


def _clients(d: Deployment) -> list[int]:
    return [probe(a, TOKEN).clients for a in d.servers()]


def test_a_client_rank_hung_or_killed(deployment, tiny_qwen3):
    """A second SGLang server (--tp 2) uses the same pool; one of its ranks hangs, resumes,
    then is killed: every expert server takes that rank's slot back, after the monitor's loss
    timeout for the hang (a hung rank is only suspected before: a stall of a loaded host must
    not cost its slots), at once for the kill (its monitor connection closes), and the first
    server's streams are untouched."""
    d = deployment
    alone = _clients(d)
    shared = start_server(tiny_qwen3, "--eaas", "--eaas-monitor", d.monitor.replace(
        "embedded:", ""), "--tp", "2", name=f"tier-{d.kind}-tp2")
    try:
        deadline = time.monotonic() + 30
        while _clients(d) != [n + 2 for n in alone]:
            assert time.monotonic() < deadline, _clients(d)
            time.sleep(0.2)
        rank1 = next(p for p in psutil.Process(shared.process.pid).children(recursive=True)
                     if "scheduler_TP1" in " ".join(p.cmdline()))
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            os.kill(rank1.pid, sig)
            began = time.monotonic()
            # the loss timeout (the hang) or none (the kill), notification, polling
            bound = (LOSS_TIMEOUT if sig == signal.SIGSTOP else 0.0) + 2.0
            while _clients(d) != [n + 1 for n in alone] and not (
                    sig == signal.SIGKILL and _clients(d) == alone):
                assert time.monotonic() - began < bound + 3, _clients(d)
                time.sleep(0.05)
            assert time.monotonic() - began < bound
            assert _streams(d.sglang) == d.baseline
            if sig == signal.SIGSTOP:
                os.kill(rank1.pid, signal.SIGCONT)  # it registers again and joins again
                deadline = time.monotonic() + 30
                while _clients(d) != [n + 2 for n in alone]:
                    assert time.monotonic() < deadline, _clients(d)
                    time.sleep(0.2)
    finally:
        shared.stop()


def test_replicas_moved_mid_stream(deployment):
    """A balancer's move, live (balance/apply.py): X, which holds only expert E of layer 1,
    loads experts 0-3 of layer 0 from an S server while eight streams decode, then that S
    server drops them (the other S still holds them): no stream changes a token. Then the move
    is undone, as live."""
    d = deployment
    s0, (x,) = d.holding("s")[0], d.holding("x")
    before = d.watcher.watch(-1, 0.0).holdings()
    served = probe(x, TOKEN).counter("tokens")
    assert _streams(d.sglang) == d.baseline
    alone = probe(x, TOKEN).counter("tokens") - served  # tokens that needed E in layer 1
    moved = before.with_server(x, {**before[x], 0: [0, 1, 2, 3]})
    moved = moved.with_server(s0, {**before[s0], 0: [4, 5, 6, 7]})
    applied = []
    assert _streams(d.sglang, lambda: applied.append(
        apply_placement(before, moved, TOKEN, grace=0.5))) == d.baseline
    assert applied[0].from_peer == 4 and applied[0].from_disk == 0
    assert sorted((c.server, c.layer, c.adds, c.drops) for c in applied[0].changes) == sorted(
        [(x, 0, (0, 1, 2, 3), ()), (s0, 0, (), (0, 1, 2, 3))])
    deadline = time.monotonic() + 30
    while not re.search(rf"expert server {x} now holds experts per MoE layer \{{0: \[0, 1, 2, "
                        r"3\]", d.sglang.log_path.read_text()):
        assert time.monotonic() < deadline, "SGLang's client did not take the new holdings"
        time.sleep(0.1)
    served = probe(x, TOKEN).counter("tokens")
    assert _streams(d.sglang) == d.baseline
    assert probe(x, TOKEN).counter("tokens") - served > alone  # the replicas are used
    assert d.watcher.watch(-1, 0.0).holdings() == moved
    apply_placement(moved, before, TOKEN, grace=0.5)
    assert _streams(d.sglang) == d.baseline
    assert d.watcher.watch(-1, 0.0).holdings() == before
