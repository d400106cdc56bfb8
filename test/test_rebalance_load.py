"""``tools.rebalance`` plans on what the expert servers computed since its last pass
(``balance/server_load.py``): the differencing on plain records (a restarted server counted
from zero, a TP layer divided by its parts, a corrupt state file, a dry run that writes
nothing), then the real command against a monitor and two real expert servers whose entries
come from a client's steps, counted here from the routed ids."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import open_log
from tier_steps import one_step, routed_batch, wait_until
from sglang_eaas.balance.server_load import (Counters, Since, default_state_path, expert_load,
                                             measured_ratio, read_counters, read_state, since,
                                             write_state)
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import probe
from sglang_eaas.tools.rebalance import Remembered

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]


def _counters(server="a:1", pid=10, incarnation="i1", at=100.0, **entries) -> Counters:
    """``entries``: ``l0={2: 5}`` -> MoE layer 0, expert 2: 5 entries."""
    return Counters(server, pid, incarnation, at,
                    {int(k[1:]): dict(v) for k, v in entries.items()})


# -- the differencing ------------------------------------------------------------------------
def test_entries_since_the_last_pass_and_a_restart_counted_from_zero():
    earlier = _counters(l0={1: 10, 2: 4}, l1={3: 7})
    now = _counters(at=160.0, l0={1: 15, 2: 4, 5: 2}, l1={3: 7})
    assert since(now, earlier) == Since("a:1", {0: {1: 5, 5: 2}}, 100.0)
    assert since(now, None) == Since("a:1", now.entries, None, "not remembered")
    for restarted in (_counters(incarnation="i2", l0={1: 15}),  # registered anew
                      _counters(pid=11, l0={1: 15}),  # another process
                      _counters(l0={1: 3})):  # same ids, a counter went down: not the same
        assert since(restarted, earlier) == Since("a:1", restarted.entries, None, "restarted")


def test_the_load_per_expert_sums_servers_and_divides_a_tp_layer_by_its_parts():
    # layer 0 EP: each entry on one holder; layer 1 TP over 2 parts: both servers count the
    # entry for its expert; expert 9 is an ESFT adapter expert (past the model's 8)
    measured = [Since("a", {0: {0: 3, 1: 1}, 1: {0: 4, 2: 6}}, 1.0),
                Since("b", {0: {1: 2, 9: 50}, 1: {0: 4, 2: 6}}, 1.0)]
    load = expert_load(measured, [0, 1], 8, {1: 2})
    assert load.tolist() == [[3, 3, 0, 0, 0, 0, 0, 0], [4, 0, 6, 0, 0, 0, 0, 0]]
    assert measured_ratio(measured, 0, 8) == pytest.approx(4 / 3)  # 4 and 2: mean 3
    assert measured_ratio(measured, 1, 8) == pytest.approx(1.0)
    assert measured_ratio(measured, 5, 8) is None  # nothing measured in that layer


def test_the_state_file_round_trip_and_a_corrupt_one(tmp_path):
    path = tmp_path / "deep" / "state.json"
    assert read_state(path) == ({}, "")  # no file: no state, nothing said
    counters = [_counters(l0={1: 2}), _counters("b:2", 20, "j", 101.5, l1={0: 9})]
    write_state(path, "127.0.0.1:5000", counters)
    assert read_state(path) == ({c.server: c for c in counters}, "")
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]  # no temp left
    for text in ("{not json", '{"servers": [{"server": "a"}]}', "[]",
                 '{"servers": [{"server": "a", "pid": 1, "incarnation": "", "read_at": 0, '
                 '"entries": {"0": {"1": -4}}}]}'):
        path.write_text(text)
        state, warning = read_state(path)
        assert state == {} and "is not one this tool wrote" in warning and "\n" not in warning
    path.write_bytes(b"\xff\xfe")
    assert "is not one this tool wrote" in read_state(path)[1]
    path.unlink()
    path.mkdir()  # not a file
    assert read_state(path)[1].startswith(f"cannot read the state file {path} (")


def test_the_default_state_path_is_per_monitor(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    one, two = default_state_path("10.0.0.1:5000"), default_state_path("10.0.0.1:5001")
    assert one.parent == tmp_path / "sglang-eaas" / "rebalance" and one != two
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_state_path("h:1").is_relative_to(os.path.expanduser("~/.cache"))


def test_a_dry_run_remembers_in_memory_only_a_real_pass_keeps_silent_servers(tmp_path):
    path = tmp_path / "state.json"
    dry = Remembered(path, "m:1", dry_run=True)
    dry.remember([_counters(l0={1: 2})], ["a:1"])
    assert not path.exists() and dry.counters["a:1"].entries == {0: {1: 2}}
    real = Remembered(path, "m:1", dry_run=False)
    real.remember([_counters(l0={1: 2}), _counters("b:2", l0={3: 1}), _counters("c:3")],
                  ["a:1", "b:2", "c:3"])
    # b:2 did not answer this time; c:3 left the tier
    real.remember([_counters(at=200.0, l0={1: 9})], ["a:1", "b:2"])
    state, _ = read_state(path)
    assert sorted(state) == ["a:1", "b:2"]
    assert state["a:1"].read_at == 200.0 and state["b:2"].entries == {0: {3: 1}}


def test_a_corrupt_state_file_is_one_warning_and_no_state(tmp_path, capsys):
    path = tmp_path / "state.json"
    path.write_text('{"servers": 3}')
    assert Remembered(path, "m:1", dry_run=False).counters == {}
    out = capsys.readouterr().out
    assert out.startswith("rebalance: warning: the state file") and out.count("\n") == 1


def test_a_server_that_does_not_answer_is_said(tmp_path):
    from sglang_eaas.addresses import free_port

    address = f"127.0.0.1:{free_port()}"
    read, failed = read_counters([address], TOKEN, timeout=2.0)
    assert read == [] and "unreachable" in failed[address]


# -- the real command against real servers --------------------------------------------------
PLACEMENT = [[0, 1, 2, 3], [4, 5, 6, 7]]  # no replica: the measured split is the ids' split


@pytest.fixture(scope="module")
def tier(tiny_qwen3, info):
    """A monitor, two expert servers and a client that follows the monitor's tables; the
    monitor keeps a stopped server for long."""
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=120.0)).start()
    log = open_log("rebalance-load")
    servers = start_local_servers(tiny_qwen3, PLACEMENT, "float32", max_clients=2,
                                  extra_args=("--monitor", monitor.address, "--heartbeat", "0.5"),
                                  stdout=log)
    client = EaasClient([s.address for s in servers], info, ModelIdentity.of(tiny_qwen3),
                        torch.float32, "rebalance-load", result_timeout=30.0,
                        monitor=monitor.address, heartbeat=0.5)
    try:
        deadline = time.monotonic() + 30
        while {s.address for s in servers} - {m.id for m in monitor.registry.snapshot().servers()}:
            assert time.monotonic() < deadline, "the servers did not register"
            time.sleep(0.05)
        yield monitor, servers, client
    finally:
        client.close()
        for server in servers:
            os.kill(server.process.pid, signal.SIGCONT)
            server.stop()
        monitor.close()
        log.close()


def _serve(client, info, batches: dict[int, tuple[int, int, list[int]]]) -> dict[int, np.ndarray]:
    """One step per layer: ``{layer: (tokens, seed, experts)}``; each layer's entries per expert
    as routed (the reference: counted from the ids sent)."""
    sent = {}
    for layer, (tokens, seed, experts) in batches.items():
        x, ids, w = routed_batch(info, tokens, seed=seed, experts=experts)
        assert not one_step(client, layer, x, ids, w)[1]
        sent[layer] = np.bincount(ids.flatten().numpy(), minlength=info.num_experts)
    return sent


def _rebalance(monitor, state, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_eaas.tools.rebalance", "--monitor",
                           monitor.address, "--state", str(state), "--grace", "0.5", *args],
                          env={**os.environ, "SGLANG_EAAS_TOKEN": TOKEN}, capture_output=True,
                          text=True, timeout=180)


LINE = re.compile(r"  MoE layer (\d+): busiest server measured (-|[\d.]+x the mean), modelled "
                  r"([\d.]+)x -> plan ([\d.]+)x \((\d+) replicas to add\)")


def _layers(stdout: str) -> dict[int, tuple[str, float, float, int]]:
    return {int(m[0]): (m[1], float(m[2]), float(m[3]), int(m[4])) for m in LINE.findall(stdout)}


def _held(servers, layer: int) -> list[list[int]]:
    """What each server holds of ``layer`` now, as it says."""
    return [list(probe(s.address, TOKEN).holdings[layer]) for s in servers]


def _split(entries: np.ndarray, held: list[list[int]]) -> str:
    """The busiest server's entries over the mean, as the command prints it (each expert on
    one server)."""
    per_server = [entries[ids].sum() for ids in held]
    return f"{max(per_server) / np.mean(per_server):.2f}x the mean"


def test_passes_plan_on_the_load_since_the_last_one(tier, info, tmp_path):
    monitor, servers, client = tier
    state = tmp_path / "rebalance.json"
    first = _serve(client, info, {0: (48, 1, None), 1: (40, 2, None)})
    total = sum(int(v.sum()) for v in first.values())

    # a dry run, then a real pass: both on everything since the servers started; 8 slots for
    # 8 experts: the plan may swap experts between the servers, never replicate one
    held = {layer: _held(servers, layer) for layer in first}
    assert held == {0: PLACEMENT, 1: PLACEMENT}
    runs = [_rebalance(monitor, state, "--slots", "4", "--dry-run"),
            _rebalance(monitor, state, "--slots", "4")]
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert "no earlier pass remembered" in run.stdout, run.stdout
        assert (f"rebalance: 2 expert servers, 4 slots per MoE layer each, {total} entries the "
                "servers computed since they started; policy moeless") in run.stdout, run.stdout
        lines = _layers(run.stdout)
        assert sorted(lines) == [0, 1], run.stdout
        for layer, entries in first.items():
            measured, modelled, after, _ = lines[layer]
            assert measured == _split(entries, held[layer]), run.stdout
            assert f"{modelled:.2f}x the mean" == measured and after <= modelled, run.stdout
    assert _layers(runs[0].stdout) == _layers(runs[1].stdout)
    remembered, warning = read_state(state)
    assert not warning and set(remembered) == {s.address for s in servers}
    for s in servers:
        stats = probe(s.address, TOKEN)
        assert (remembered[s.address].pid, remembered[s.address].incarnation) == (
            stats.pid, stats.incarnation)

    # new traffic on two experts server 0 holds now in layer 0, two of server 1's in layer 1
    held = {layer: _held(servers, layer) for layer in first}
    assert all(sorted(sum(h, [])) == list(range(8)) for h in held.values()), held
    wait_until(lambda: all(list(client.table.holdings[s.address][layer]) == held[layer][i]
                           for layer in held for i, s in enumerate(servers)), 30,
               "the client's table of the new placement",
               step=lambda: (client.begin_step(), client.end_step()))
    second = _serve(client, info, {0: (24, 3, held[0][0][:2]), 1: (16, 4, held[1][1][:2])})
    run = _rebalance(monitor, state, "--slots", "6", "--dry-run")
    assert run.returncode == 0, run.stderr
    new = sum(int(v.sum()) for v in second.values())
    assert re.search(rf"{new} entries the servers computed since the last pass at "
                     r"\d\d:\d\d:\d\d; policy", run.stdout), run.stdout
    assert "since they started" not in run.stdout and "no earlier pass" not in run.stdout
    for layer, (measured, modelled, after, adds) in _layers(run.stdout).items():
        assert measured == "2.00x the mean" and modelled == 2.0, run.stdout  # one server only
        assert after < 1.5 and adds >= 1, run.stdout
    assert read_state(state)[0] == remembered  # the dry run left the state as it was


def test_a_silent_server_is_said_and_none_answering_is_refused(tier, info, tmp_path):
    monitor, servers, client = tier
    state = tmp_path / "rebalance.json"
    _serve(client, info, {0: (8, 5, None), 1: (8, 6, None)})
    os.kill(servers[1].process.pid, signal.SIGSTOP)
    try:
        run = _rebalance(monitor, state, "--slots", "4", "--dry-run", "--stats-timeout", "1")
        assert run.returncode == 0, run.stderr
        assert re.search(rf"expert server {servers[1].address} did not answer for its load "
                         r"counters \(.+\); the pass goes on without its load", run.stdout)
        assert "rebalance: 2 expert servers" in run.stdout and len(_layers(run.stdout)) == 2
        os.kill(servers[0].process.pid, signal.SIGSTOP)
        run = _rebalance(monitor, state, "--slots", "4", "--stats-timeout", "1")
        assert run.returncode == 1 and not state.exists()
        assert run.stderr.strip().endswith("none of the 2 expert servers answered for their "
                                           "load counters; nothing moved"), run.stderr
        assert "Traceback" not in run.stderr
    finally:
        for s in servers:
            os.kill(s.process.pid, signal.SIGCONT)
