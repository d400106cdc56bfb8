"""The tier controller (docs/elastic.md, "The tier controller"), over the TCP monitor and etcd:
one operation at a time, each recorded from start to end and kept; a retried id starting
nothing; a lapsed lease's operation recovered by the next one; expert servers refusing changes
from an older epoch; the TCP monitor learning the running operation and the epoch again after
a restart; a real driver (``tools.switch``) SIGKILLed mid-switch while a client steps through
every MoE layer, every output checked against transformers', and the next operation finishing
what it left; the bounds and bad inputs refused before anything starts, in one sentence."""

from __future__ import annotations

import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import model_path, open_log
from hf_reference import hf_routed_experts
from sglang_eaas.addresses import accepts, free_port
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.controller.bounds import Refusal, check_resize, placement_limit
from sglang_eaas.controller.controller import Busy, Ended, Known, TierController
from sglang_eaas.elastic.switch import layouts
from sglang_eaas.holdings import Holdings
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.membership import connect, current_snapshot
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import AddExperts, Stats, call
from sglang_eaas.protocol.lines import Refused
from sglang_eaas.protocol.monitor import SERVER, Member, Snapshot
from sglang_eaas.protocol.operations import DONE, FAILED, FINAL
from sglang_eaas.tools import scale, switch
from sglang_eaas.tools.make_tiny_model import PRESETS
from test_switch import Steps
from tier_steps import wait_until

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
TTL = 2.0  # the operation lease in these tests (etcd rounds it up to whole seconds)
DRIVER_TTL = "3"  # SGLANG_EAAS_OPERATION_LEASE of the drivers started as processes


@pytest.fixture(scope="module")
def tcp_monitor():
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=2.0)).start()
    yield monitor
    monitor.close()


@pytest.fixture(params=["tcp", "etcd"])
def monitor_url(request) -> str:
    if request.param == "tcp":
        return request.getfixturevalue("tcp_monitor").address
    return request.getfixturevalue("etcd").url


def _controller(url: str, name: str, ttl: float = TTL) -> TierController:
    return TierController(url, TOKEN, name, ttl=ttl)


def _history(url: str) -> list:
    """Every operation the monitor keeps, oldest first."""
    return list(reversed(_controller(url, "reader").operations(256).operations))


def _check_serialised(records) -> None:
    """The history's invariants: every operation ended, epochs grow, and the ones that ended
    themselves never overlap in time (a recovered one ends during its recoverer)."""
    assert all(r.state in FINAL for r in records), [(r.id, r.state) for r in records]
    epochs = [r.epoch for r in records]
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs), epochs
    own = [r for r in records if "lease lapsed" not in r.result]
    for before, after in zip(own, own[1:]):
        assert before.finished_at <= after.started_at + 0.05, (before, after)


def test_one_operation_at_a_time_recorded_and_an_id_retried_starts_nothing(monitor_url):
    first, second = _controller(monitor_url, "first"), _controller(monitor_url, "second")
    release = threading.Event()

    def slow(held):  # holds the lease longer than two ttls: the keeper renews it
        held.progress("waiting for the test")
        assert release.wait(30)
        return Ended("released")

    running = first.start("rebalance", {"n": 1}, slow, "slow-1")
    time.sleep(2.5 * TTL)
    with pytest.raises(Busy) as busy:
        second.run("rebalance", {"n": 2}, lambda held: Ended("never"))
    assert "slow-1" in str(busy.value) and "first" in str(busy.value)
    assert busy.value.holder.id == "slow-1" and busy.value.holder.progress
    with pytest.raises(Known) as known:  # a retry of the same request: nothing starts
        second.run("rebalance", {"n": 1}, lambda held: Ended("never"), "slow-1")
    assert known.value.record.id == "slow-1" and known.value.record.requester == "first"
    with pytest.raises(Refused) as taken:  # the id asked for something else
        second.run("resize", {"servers": 3}, lambda held: Ended("never"), "slow-1")
    assert taken.value.reason == "operation_id_taken"
    waited: list = []
    waiter = threading.Thread(target=lambda: waited.append(second.run(
        "rebalance", {"n": 3}, lambda held: Ended("after it"), wait=30)))
    waiter.start()
    time.sleep(0.5)
    release.set()
    waiter.join(30)
    assert waited and waited[0].state == DONE and waited[0].result == "after it"
    ended = first.wait(running.id, 10)
    assert ended.state == DONE and ended.result == "released"
    assert waited[0].epoch > ended.epoch
    records = [r for r in _history(monitor_url) if r.id in (running.id, waited[0].id)]
    assert [r.id for r in records] == [running.id, waited[0].id]
    _check_serialised(records)


def test_a_lapsed_lease_is_finished_or_rolled_back_by_the_next_operation(monitor_url):
    dead = _controller(monitor_url, "dies").acquire("restart", {"server": "127.0.0.1:9"})
    dead.keeper.stop()  # the driver dies: no renewal, its connection closes
    dead.backend.close()
    began = time.monotonic()
    nxt = _controller(monitor_url, "next").run("rebalance", {}, lambda held: Ended("mine"),
                                               wait=3 * TTL)
    assert nxt.state == DONE and time.monotonic() - began < 3 * TTL
    (lapsed,) = [r for r in _history(monitor_url) if r.id == dead.id]
    assert lapsed.state == FAILED and "127.0.0.1:9 did not come back" in lapsed.result
    assert f"by operation {nxt.id} of next" in lapsed.result
    with pytest.raises(Refused) as lost:  # the dead driver's lease is gone for good
        backend = connect(monitor_url, TOKEN)
        try:
            backend.renew(dead.fence.epoch)
        finally:
            backend.close()
    assert lost.value.reason == "lease_lost"


@pytest.fixture(scope="module")
def top4():
    path = model_path(PRESETS["tiny-top4"])
    return path, MoeModelInfo.from_model_path(path)


def test_a_server_refuses_a_change_from_an_older_epoch(top4, tcp_monitor):
    path, info = top4
    log = open_log("controller-epoch")
    (server,) = start_local_servers(path, [list(range(8))], "float32", max_clients=2,
                                    extra_args=("--monitor", tcp_monitor.address), stdout=log)
    try:
        wait_until(lambda: server.address in {
            m.id for m in tcp_monitor.registry.snapshot().servers()}, 30, "registration")
        layer = info.moe_layers[0]
        call(server.address, AddExperts(layer, [8], epoch=5), TOKEN, 30)
        with pytest.raises(Refused) as stale:
            call(server.address, AddExperts(layer, [9], epoch=3), TOKEN, 30)
        assert stale.value.reason == "stale_epoch" and "epoch 5" in str(stale.value)
        call(server.address, AddExperts(layer, [9]), TOKEN, 30)  # outside the controller
        assert call(server.address, Stats(), TOKEN, 10).counter("operation_epoch") == 5
    finally:
        server.stop()
        log.close()


def _standalone_monitor(address: str, log) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "sglang_eaas.monitor", "--listen", address,
                                "--loss-timeout", "2", "--operation-grace", "4"],
                               stdout=log, stderr=subprocess.STDOUT)
    wait_until(lambda: accepts(address), 30, "the monitor")
    return process


def test_the_tcp_monitor_learns_the_running_operation_and_the_epoch_again_after_a_restart(
        top4):
    path, info = top4
    address = f"127.0.0.1:{free_port()}"
    log = open_log("controller-monitor-restart")
    monitor = _standalone_monitor(address, log)
    (server,) = start_local_servers(path, [list(range(16))], "float32", max_clients=2,
                                    extra_args=("--monitor", address, "--heartbeat", "0.2"),
                                    stdout=log)
    try:
        for _ in range(3):  # three operations before: the servers obeyed epoch 3
            _controller(address, "before").run("rebalance", {}, lambda h: Ended(
                call(server.address, AddExperts(info.moe_layers[0], [0], epoch=h.fence.epoch),
                     TOKEN, 30) and "touched"))
        held = _controller(address, "holder").acquire("rebalance", {})
        held.progress("halfway")
        monitor.kill()
        monitor.wait()
        time.sleep(3 * TTL + 1)  # away for longer than 3 ttls, as a restart on a busy host is
        monitor = _standalone_monitor(address, log)
        wait_until(lambda: server.address in {m.id for m in current_snapshot(
            address, TOKEN).servers()}, 10, "the server's registration again")
        # a new driver is refused while the holder may still come back for its lease
        with pytest.raises(Busy):
            _controller(address, "newcomer").run("rebalance", {}, lambda h: Ended("never"))
        wait_until(lambda: _controller(address, "reader").operations().holder == held.id, 10,
                   "the holder's reclaim")
        assert not held.fence.lost and held.fence.epoch == 4
        (record,) = [r for r in _history(address) if r.id == held.id]
        assert record.requester == "holder" and record.progress == "halfway"
        assert held.finish(DONE, "after the restart").state == DONE
        after = _controller(address, "newcomer").run("rebalance", {}, lambda h: Ended("mine"))
        assert after.epoch == 5  # never below what the servers obeyed
        assert [r.state for r in _history(address)] == [DONE, DONE]
    finally:
        server.stop()
        monitor.kill()
        monitor.wait()
        log.close()


@pytest.mark.parametrize("backend", ["tcp", "etcd"])
def test_a_driver_killed_mid_switch_is_finished_by_the_next_operation(top4, backend, request):
    """Four servers, every expert twice; ``tools.switch --to tp`` SIGKILLed as soon as the
    first MoE layer is TP; ``tools.switch --to ep`` then finishes its switch (every layer TP)
    before its own. A client steps through every layer the whole time: no row fails and every
    output is transformers'."""
    path, info = top4
    url = (request.getfixturevalue("tcp_monitor").address if backend == "tcp"
           else request.getfixturevalue("etcd").url)
    log = open_log(f"controller-kill-{backend}")
    servers = start_local_servers(path, [list(range(8)), list(range(8, 16))] * 2, "float32",
                                  max_clients=4, extra_args=("--monitor", url,
                                                             "--heartbeat", "0.2"), stdout=log)
    env = {**os.environ, "SGLANG_EAAS_OPERATION_LEASE": DRIVER_TTL}
    tool = [sys.executable, "-m", "sglang_eaas.tools.switch", "--monitor", url, "--model-path",
            str(path)]
    client = None
    try:
        wait_until(lambda: len(current_snapshot(url, TOKEN).servers()) == 4, 30, "registration")
        client = EaasClient([s.address for s in servers], info, ModelIdentity.of(path, info),
                            torch.float32, f"controller-{backend}", result_timeout=30.0,
                            monitor=url, heartbeat=0.2)
        steps = Steps(client, info, hf_routed_experts(path))
        steps.start()
        steps.more(2, "steps before the switch")
        driver = subprocess.Popen([*tool, "--to", "tp", "--parts", "2"], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = f"MoE layer {info.moe_layers[0]}: TP"
        for line in driver.stdout:
            if line.startswith(first):
                driver.send_signal(signal.SIGKILL)
                break
        driver.wait(30)
        assert driver.returncode == -signal.SIGKILL, "the switch ended before it was killed"
        mixed = layouts(current_snapshot(url, TOKEN).holdings(), info)
        assert mixed[info.moe_layers[0]] == 2 and mixed[info.moe_layers[-1]] == 1, mixed
        back = subprocess.run([*tool, "--to", "ep", "--wait", "30"], env=env, text=True,
                              capture_output=True, timeout=300)
        assert back.returncode == 0, back.stdout + back.stderr
        assert "was left unfinished: its driver's lease lapsed" in back.stdout, back.stdout
        killed, finished = _history(url)[-2:]
        assert killed.requester.startswith("tools.switch") and killed.target["to"] == "tp"
        assert killed.state == DONE and killed.result.startswith("finished: MoE layers")
        assert finished.state == DONE and finished.target["to"] == "ep"
        _check_serialised([killed, finished])
        assert layouts(current_snapshot(url, TOKEN).holdings(), info) == {
            layer: 1 for layer in info.moe_layers}
        steps.more(2, "steps after the switches")
        steps.finish()
    finally:
        if client is not None:
            client.close()
        for server in servers:
            server.stop()
        log.close()


def test_a_resize_cut_short_that_cannot_be_finished_is_rolled_back(top4, tcp_monitor):
    """A resize 2 -> 3 whose driver died after filling part of the standby server, which then
    died too: the next operation cannot finish it (no standby server, no launcher), so it
    places the tier back over the two servers active before, and says so."""
    path, info = top4
    url = tcp_monitor.address
    log = open_log("controller-rollback")
    a, b = start_local_servers(path, [list(range(8)), list(range(8, 16))], "float32",
                               max_clients=2, extra_args=("--monitor", url), stdout=log)
    (spare,) = start_local_servers(path, [{}], "float32", max_clients=2,
                                   extra_args=("--standby", "--monitor", url), stdout=log)
    try:
        wait_until(lambda: {a.address, b.address, spare.address} <= {
            m.id for m in current_snapshot(url, TOKEN).servers()}, 30, "registration")
        layer = info.moe_layers[0]
        dead = _controller(url, "resizer").acquire("resize", {
            "servers": 3, "fingerprint": info.fingerprint(), "num_experts": info.num_experts})
        dead.note(_before=[a.address, b.address])
        call(spare.address, AddExperts(layer, [0, 8], epoch=dead.fence.epoch), TOKEN, 30)
        dead.keeper.stop()  # the driver dies
        dead.backend.close()
        spare.stop()  # and so does the server it was filling
        wait_until(lambda: spare.address not in {
            m.id for m in current_snapshot(url, TOKEN).servers()}, 30, "the spare's loss")
        nxt = _controller(url, "next").run("rebalance", {}, lambda h: Ended("mine"))
        assert nxt.state == DONE
        (record,) = [r for r in _history(url) if r.id == dead.id]
        assert record.state == "rolled_back" and record.result.startswith("rolled back: ")
        assert record.end["active"] == sorted([a.address, b.address]), record.end
        held = current_snapshot(url, TOKEN).holdings(info.fingerprint())
        assert sorted(held.holders(layer)) == list(range(16))  # every expert still held
    finally:
        for server in (a, b, spare):
            server.stop()
        log.close()


# -- bounds and bad inputs ----------------------------------------------------------------------
def _snapshot(holdings: dict, standby: int = 0, experts: int = 24) -> Snapshot:
    members = [Member(SERVER, s, "h", 1, num_experts=experts, fingerprint="f",
                      holdings=Holdings({s: held})[s]) for s, held in holdings.items()]
    members += [Member(SERVER, f"standby-{i}", "h", 1, num_experts=experts, fingerprint="f")
                for i in range(standby)]
    return Snapshot(1, tuple(members))


def test_resize_bounds_are_refused_before_anything_starts():
    tier = {"a": {0: range(12), 1: range(12)}, "b": {0: range(12, 24), 1: range(12, 24)}}
    snapshot = _snapshot(tier, standby=1)
    assert placement_limit(snapshot.holdings(), 24) == 24
    for servers, launcher, why in [
            (30, True, "24 expert replicas, so 6 servers would hold nothing"),
            (1000, True, "976 servers would hold nothing"),
            (4, False, "need 1 more than the tier has (active 2, standby 1)"),
            (0, True, "at least one active expert server")]:
        with pytest.raises(Refusal, match=re.escape(why)):
            check_resize(servers, snapshot, "f", 24, None, launcher)
    with pytest.raises(Refusal, match="more than --eaas-max-servers 2"):
        check_resize(3, snapshot, "f", 24, 2, True)
    with pytest.raises(Refusal, match=r"\['c:1'\] do not serve in the tier"):
        check_resize(1, snapshot, "f", 24, None, True, ["c:1"])
    with pytest.raises(Refusal, match="leave no expert held"):
        check_resize(1, snapshot, "f", 24, None, True, ["a", "b"])
    check_resize(3, snapshot, "f", 24, None, False)  # the standby one
    parts = Holdings({"a": {}, "b": {}}).with_server("a", Holdings({"a": {}})["a"].with_parts(
        0, 2, [e * 2 for e in range(24)])).with_server("b", Holdings({"b": {}})["b"].with_parts(
            0, 2, [e * 2 + 1 for e in range(24)]))
    tp = Snapshot(1, tuple(Member(SERVER, s, "h", 1, num_experts=24, fingerprint="f",
                                  holdings=parts[s]) for s in parts))
    with pytest.raises(Refusal, match=r"MoE layers \[0\] are in TP"):
        check_resize(3, tp, "f", 24, None, True)


@pytest.mark.parametrize("url", ["not-a-url", "http://127.0.0.1:abc", "http://[::1", "",
                                 "ftp://127.0.0.1:30000", "http://127.0.0.1"])
def test_the_scale_tool_refuses_a_bad_url_in_one_sentence(url, capsys):
    with pytest.raises(SystemExit) as exited:
        scale.main([url, "to", "3", "--token", "t"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and "is not http://HOST:PORT" in err[-1], err
    assert "Traceback" not in "\n".join(err)


class _Http(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wrong_ports_fail_within_seconds(tcp_monitor, top4, capsys):
    path, _ = top4
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Http)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        began = time.monotonic()  # an HTTP server given as the monitor
        assert switch.main(["--monitor", f"127.0.0.1:{web.server_address[1]}", "--model-path",
                            str(path), "--to", "tp", "--token", TOKEN]) == 1
        err = capsys.readouterr().err
        assert time.monotonic() - began < 8 and err.count("\n") == 1, err
        assert any(why in err for why in ("not an sglang-eaas monitor", "is it an sglang-eaas "
                                          "monitor?", "did not answer within 5s")), err
        began = time.monotonic()  # the monitor given as SGLang's HTTP address
        assert scale.main([f"http://{tcp_monitor.address}", "to", "2", "--token", TOKEN]) == 1
        err = capsys.readouterr().err
        assert time.monotonic() - began < 8 and err.count("\n") == 1, err
        assert "SGLang's HTTP port" in err, err
        assert scale.main([f"http://127.0.0.1:{free_port()}", "show", "--token", TOKEN]) == 1
        assert "cannot reach" in capsys.readouterr().err
    finally:
        web.shutdown()


def test_a_switch_naming_a_model_no_server_serves_or_too_many_parts_is_refused(
        top4, tiny_qwen3, tcp_monitor, capsys):
    path, _ = top4
    log = open_log("controller-refusals")
    servers = start_local_servers(path, [list(range(16))] * 2, "float32", max_clients=2,
                                  extra_args=("--monitor", tcp_monitor.address), stdout=log)
    try:
        wait_until(lambda: {s.address for s in servers} <= {
            m.id for m in tcp_monitor.registry.snapshot().servers()}, 30, "registration")
        base = ["--monitor", tcp_monitor.address, "--token", TOKEN, "--to", "tp"]
        before = len(_history(tcp_monitor.address))
        assert switch.main(base + ["--model-path", str(tiny_qwen3)]) == 1
        assert "no expert server of the tier serves this model" in capsys.readouterr().err
        group = ",".join(s.address for s in servers)
        assert switch.main(base + ["--model-path", str(path), "--group", group,
                                   "--parts", "3"]) == 1
        assert "TP cuts each expert into 2 to 2 parts" in capsys.readouterr().err
        assert len(_history(tcp_monitor.address)) == before  # refused before it started
    finally:
        for server in servers:
            server.stop()
        log.close()
