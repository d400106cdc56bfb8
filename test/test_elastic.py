"""Resizing the expert tier while it serves (docs/elastic.md): the resize placement, then real
expert-server processes, a monitor and a client stepping through layers while the tier goes
2 -> 4 -> 2 servers and while servers are killed mid-fill; every sum is checked against
transformers' experts, and no row may fail."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from conftest import open_log
from hf_reference import assert_matches_hf
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.elastic.plan import PlanError, moved, resize_holdings
from sglang_eaas.elastic.resize import Resizer, ResizeError
from sglang_eaas.holdings import AdapterExpert, Holdings, ServerHoldings
from sglang_eaas.launcher.local_servers import LocalLauncher, start_local_servers
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import probe
from tier_steps import one_step, routed_batch, wait_until

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
HEARTBEAT, LOSS = 0.1, 2.0


def _replicas(target: Holdings, layer: int) -> dict[int, int]:
    count: dict[int, int] = {}
    for held in target.values():
        for e in held.get(layer, ()):
            count[e] = count.get(e, 0) + 1
    return count


def _striped(servers: int, replicas: int, experts: int = 32, layers=(0, 1)) -> Holdings:
    return Holdings({f"s{i}": {layer: [e for e in range(experts)
                                       if any((e + j) % servers == i for j in range(replicas))]
                               for layer in layers} for i in range(servers)})


@pytest.mark.parametrize("servers", [["s0", "s1", "s2", "s3", "n0", "n1"], ["s0", "s1", "s2"],
                                     ["s0", "s1"], ["s3", "s0", "s2", "s1"]])
def test_a_resize_placement_keeps_replicas_evens_counts_and_moves_least(servers):
    current = _striped(4, 3)
    target = resize_holdings(current, servers, 32)
    assert list(target) == servers
    for layer in (0, 1):
        assert _replicas(target, layer) == {e: min(3, len(servers)) for e in range(32)}
        sizes = [len(target[s][layer]) for s in servers]
        assert max(sizes) - min(sizes) <= 1, sizes
    staying = [s for s in servers if s in current]
    # the fewest adds: only the share of the new servers, or what the leaving ones held
    # beyond the replicas dropped with them
    needed = sum(len(target[s][layer]) for s in servers if s not in current for layer in (0, 1))
    if len(servers) >= 4:
        assert moved(current, target) == needed
    else:
        leaving = [s for s in current if s not in servers]
        lost = sum(len(current[s][layer]) for s in leaving for layer in (0, 1))
        dropped = sum(3 - min(3, len(servers)) for _ in range(32) for _ in (0, 1))
        assert moved(current, target) == lost - dropped
    assert all(set(target[s][0]) <= set(current[s][0]) or s not in staying or
               len(servers) < 4 for s in staying)


def test_a_resize_placement_after_a_loss_makes_the_lost_replicas_again():
    before = _striped(4, 3)
    after_loss = before.only(["s0", "s1", "s3"])  # s2 lost mid-resize
    servers = ["s0", "s1", "s3", "n0"]
    assert _replicas(resize_holdings(after_loss, servers, 32), 0) != {e: 3 for e in range(32)}
    target = resize_holdings(after_loss, servers, 32, replicas_of=before)
    for layer in (0, 1):
        assert _replicas(target, layer) == {e: 3 for e in range(32)}
        for s in ("s0", "s1", "s3"):  # the survivors keep what they hold, up to their share
            assert len(set(target[s][layer]) & set(after_loss[s][layer])) >= 24 - 1


def test_a_resize_placement_keeps_adapters_and_refuses_bad_sets():
    adapter = ServerHoldings({0: [0, 1, 40], 1: [0]}, {0: {40: AdapterExpert("a", 3, "d")}})
    current = Holdings({"s0": adapter, "s1": {0: [2, 3], 1: [1, 2, 3]}})
    target = resize_holdings(current, ["s0", "s1", "s2"], 4)
    assert 40 in target["s0"][0] and target["s0"].adapters == adapter.adapters
    assert all(e < 4 for s in ("s1", "s2") for e in target[s][0])
    with pytest.raises(PlanError):
        resize_holdings(current, [], 4)
    with pytest.raises(PlanError):
        resize_holdings(current, ["s0", "s0"], 4)


# -- live ---------------------------------------------------------------------------------------
REPLICATED = [[0, 1, 2, 3, 4, 5], [0, 1, 4, 5, 6, 7], [2, 3, 6, 7]]  # each expert on two


@pytest.fixture()
def tier(tiny_qwen3, info, request):
    """A monitor, the active servers (by default experts 0-3 on one, 4-7 on the other, every
    layer; the test's parameter otherwise), a launcher of standby servers and a client."""
    placement = getattr(request, "param", [[0, 1, 2, 3], [4, 5, 6, 7]])
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=LOSS)).start()
    log = open_log(f"elastic-{request.node.name}")
    extra = ("--monitor", monitor.address, "--heartbeat", str(HEARTBEAT))
    servers = start_local_servers(tiny_qwen3, placement, "float32",
                                  max_clients=4, extra_args=extra, stdout=log)
    launcher = LocalLauncher(tiny_qwen3, monitor.address, "float32", 4,
                             ("--heartbeat", str(HEARTBEAT)), stdout=log)
    wait_until(lambda: len(monitor.registry.snapshot().servers()) == len(placement), 20,
               "registration")
    client = EaasClient([s.address for s in servers], info, ModelIdentity.of(tiny_qwen3),
                        torch.float32, "elastic", monitor=monitor.address, heartbeat=HEARTBEAT)
    yield monitor, servers, launcher, client
    client.close()
    launcher.close()
    for server in servers:
        server.stop()
    monitor.close()
    log.close()


class Stepping:
    """A thread stepping the client through every MoE layer, each sum checked."""

    def __init__(self, client, info, hf_experts):
        self.client, self.info, self.hf = client, info, hf_experts
        self.steps, self.errors = 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self):
        seed = 0
        while not self.stop.is_set():
            seed += 1
            for layer in self.info.moe_layers:
                x, ids, w = routed_batch(self.info, 16, seed=seed)
                try:
                    out, failed = one_step(self.client, layer, x, ids, w)
                    assert not failed, f"rows failed: {failed}"
                    assert_matches_hf(out, self.hf, layer, x, ids, w)
                except AssertionError as exc:
                    self.errors.append(exc)
            self.steps += 1

    def __enter__(self):
        self.thread.start()
        return self

    def wait(self, more: int):
        at = self.steps
        wait_until(lambda: self.steps >= at + more or self.errors, 60, f"{more} more steps")

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(60)
        assert not self.errors, self.errors[0]


class _FailingFirst:
    """A launcher whose first start fails as a server that exits before it answers does (a
    bad flag), then starts servers as ``launcher`` does; it records each start's count."""

    def __init__(self, launcher: LocalLauncher):
        self.launcher, self.counts = launcher, []

    def start(self, count: int) -> list[str]:
        self.counts.append(count)
        if len(self.counts) == 1:
            broken = LocalLauncher(self.launcher.model_path, self.launcher.monitor, "float32",
                                   4, ("--no-such-flag",), stdout=self.launcher.stdout)
            return broken.start(count)
        return self.launcher.start(count)

    def stop(self, address: str) -> None:
        self.launcher.stop(address)

    def exited(self, addresses: list[str]) -> bool:
        return self.launcher.exited(addresses)


def test_scale_out_then_in_while_serving(tier, info, hf_experts, monkeypatch):
    """2 -> 4 -> 2 under a client checking every sum; the scale-out starts its servers one
    batch at a time (batches of 1 here), and its first start fails (a server that exits before
    it answers): that batch is started again."""
    from sglang_eaas.elastic import resize

    monkeypatch.setattr(resize, "LAUNCH_BATCH", 1)
    monitor, servers, launcher, client = tier
    flaky, said = _FailingFirst(launcher), []
    resizer = Resizer(monitor.address, TOKEN, info.num_experts, flaky, grace=0.3,
                      say=said.append)
    with Stepping(client, info, hf_experts) as stepping:
        stepping.wait(2)
        out = resizer.resize(4)
        assert out.before == 2 and out.after == 4 and len(out.started) == 2 and not out.lost
        assert flaky.counts == [1, 1, 1], flaky.counts
        assert any("starting 1 expert servers failed" in line and "trying again" in line
                   for line in said), said
        assert out.moved > 0 and out.from_peer == out.moved and out.from_disk == 0
        active, standby = monitor.registry.snapshot().active_and_standby()
        assert sorted(active) == sorted([s.address for s in servers] + out.started)
        for address in out.started:  # filled over the fabric: mapped, or read one-sidedly
            counters = probe(address, TOKEN).counters
            assert counters.get("replicas_mapped", 0) + counters.get("replicas_read", 0) > 0
        wait_until(lambda: len(client.table.holdings) == 4, 10, "the client's table of 4",
                   step=lambda: stepping.wait(1))
        stepping.wait(2)
        processes = {s.address: s.process for s in servers}
        processes.update({a: s.process for a, s in launcher.started.items()})
        back = resizer.resize(2)
        assert back.after == 2 and len(back.retired) == 2 and not back.lost
        wait_until(lambda: len(monitor.registry.snapshot().servers()) == 2, 20,
                   "the retired servers leaving")
        for address in back.retired:  # drained, then exited by themselves
            wait_until(lambda: processes[address].poll() is not None, 30, f"{address} exits")
        stepping.wait(2)
    assert client.tier.stats["failovers"] == 0
    assert resizer.resize(2).moved == 0  # already there: nothing to do


def test_a_server_killed_mid_fill_is_replaced_then_without_spare_rolled_back(
        tier, info, hf_experts):
    """A standby server killed after its first layer is filled: the resize takes another
    standby and completes; then, with no spare left, a kill makes it roll back. No row fails
    (adds come before drops), though requests sent to the killed server may fail over."""
    monitor, servers, launcher, client = tier
    spares = launcher.start(2)
    wait_until(lambda: len(monitor.registry.snapshot().active_and_standby()[1]) == 2, 30,
               "two standby servers")
    killed: list[str] = []

    def kill_first_receiver(line: str):  # after a server's first add of the fill
        receiver = line.partition(": MoE layer")[0] if "+[" in line else ""
        if receiver in spares and not killed:
            killed.append(receiver)
            launcher.started[receiver].process.kill()

    resizer = Resizer(monitor.address, TOKEN, info.num_experts, None, grace=0.3,
                      say=kill_first_receiver)
    with Stepping(client, info, hf_experts) as stepping:
        stepping.wait(1)
        out = resizer.resize(3)
        assert killed and out.lost == killed and out.after == 3 and not out.rolled_back
        assert len(out.taken) == 2  # the killed one, then the other spare
        stepping.wait(2)
        killed.clear()
        spares[:] = [s for s in launcher.start(1)]
        wait_until(lambda: len(monitor.registry.snapshot().active_and_standby()[1]) == 1, 30,
                   "a standby server")
        out = resizer.resize(4)
        assert killed and out.lost == killed and out.rolled_back and out.after == 3
        stepping.wait(2)
    active, _ = monitor.registry.snapshot().active_and_standby()
    assert len(active) == 3
    with pytest.raises(ResizeError, match="no standby server and no launcher"):
        resizer.resize(4)


@pytest.mark.parametrize("tier", [REPLICATED], indirect=True)
def test_a_source_killed_mid_fill_is_read_around_and_replaced(tier, info, hf_experts):
    """Scale-out 3 -> 4 over a tier holding each expert twice; the server the new one reads
    from is killed (kill -9) after its first layer is read: the rest of the fill reads around
    it (the checkpoint), the resize leaves it out and starts another server in its place, and
    no row fails (its experts have another holder)."""
    monitor, servers, launcher, client = tier
    processes = {s.address: s.process for s in servers}
    killed: list[str] = []

    def kill_first_source(line: str):  # after the first add read from an active server
        source = line.rpartition("(from ")[2].rstrip(")")
        if source in processes and not killed:
            killed.append(source)
            processes[source].kill()

    resizer = Resizer(monitor.address, TOKEN, info.num_experts, launcher, grace=0.3,
                      say=kill_first_source)
    with Stepping(client, info, hf_experts) as stepping:
        stepping.wait(1)
        out = resizer.resize(4)
        assert killed and out.lost == killed and out.after == 4 and not out.rolled_back
        assert len(out.started) == 2 and out.from_disk > 0  # read around the dead source
        first = probe(out.started[0], TOKEN).counters  # its next read from it: fabric, then
        assert first["fabric_fallbacks"] >= 1 and first["replica_fetch_fallbacks"] >= 1
        stepping.wait(2)
    active, _ = monitor.registry.snapshot().active_and_standby()
    assert sorted(active) == sorted([a for a in processes if a not in killed] + out.started)
    held = monitor.registry.snapshot().holdings()
    for layer in info.moe_layers:  # every expert still on two live servers
        assert _replicas(held.only(active), layer) == {e: 2 for e in range(info.num_experts)}
