"""Load recording: a client's tokens per (MoE layer, expert) in windows of steps (recorder,
sinks, the monitor's heartbeat), the expert servers' per-expert tokens and compute time, and
SGLang with --eaas-load-dump and /metrics end to end."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
import requests
import torch
from conftest import open_log, start_server
from sglang_eaas.balance.load import LoadWindow, latest_windows, read_dump, total
from sglang_eaas.client import load_recorder
from sglang_eaas.client.load_recorder import LoadRecorder
from sglang_eaas.client.load_sinks import DumpFile, Publisher, rank_path
from sglang_eaas.expert_server.compute import weighted_expert_sum
from sglang_eaas.expert_server.experts import LayerExperts
from sglang_eaas.membership import connect
from sglang_eaas.monitor.server import MonitorConfig, MonitorServer
from sglang_eaas.protocol.control import probe
from sglang_eaas.protocol.lines import MAX_LINE
from sglang_eaas.protocol.monitor import CLIENT, Member

TOKEN = os.environ["SGLANG_EAAS_TOKEN"]
LAYERS, EXPERTS, TOP_K = (1, 3, 5), 16, 4


def _ids(tokens: int, seed: int, experts: int = EXPERTS) -> np.ndarray:
    """``[T, K]`` int32 ids, some -1 (no expert)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, experts, (tokens, TOP_K)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.2] = -1
    return ids


def _counted(batches: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """An independent count: ``[L, E]`` from a Counter over every id >= 0."""
    counter = collections.Counter((layer, int(e)) for layer, ids in batches
                                  for e in ids.ravel() if 0 <= e < EXPERTS)
    return np.array([[counter[(layer, e)] for e in range(EXPERTS)] for layer in LAYERS])


def test_counts_equal_an_independent_count():
    recorder = LoadRecorder("c", LAYERS, EXPERTS, window_steps=2)
    batches = [(layer, _ids(37, seed=10 * step + layer)) for step in range(2) for layer in LAYERS]
    for i, (layer, ids) in enumerate(batches):
        recorder.count(layer, ids)
        if i % len(LAYERS) == len(LAYERS) - 1:
            recorder.end_step()
    window = recorder.last
    assert window is not None and window.layers == list(LAYERS)
    assert np.array_equal(window.array(), _counted(batches))
    assert window.array().sum() > 0


def test_windows_close_every_n_steps():
    got: list[LoadWindow] = []
    recorder = LoadRecorder("c", LAYERS, EXPERTS, window_steps=3, sinks=[got.append])
    for step in range(7):
        recorder.begin_step()
        recorder.count(LAYERS[0], np.full((step + 1, TOP_K), 2, dtype=np.int64))
        closed = recorder.end_step()
        assert (closed is not None) == (step in (2, 5))
    assert [(w.first_step, w.steps) for w in got] == [(0, 3), (3, 3)]
    assert [int(w.array()[0, 2]) for w in got] == [(1 + 2 + 3) * TOP_K, (4 + 5 + 6) * TOP_K]
    assert recorder.close_window().first_step == 6 and recorder.close_window() is None
    assert [(w.first_step, w.steps) for w in got] == [(0, 3), (3, 3), (6, 1)]
    assert all(w.start <= w.end for w in got) and got[0].end <= got[1].start
    assert recorder.message() == got[-1].to_message()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_device_path_counts_equal_host_path(dtype):
    """Tensors (CPU tensors standing in for the device) counted on the tensors' device, read
    once per window; ids >= E count nowhere on either path."""
    host = LoadRecorder("h", LAYERS, EXPERTS, window_steps=4)
    device = LoadRecorder("d", LAYERS, EXPERTS, window_steps=4)
    batches = []
    for step in range(4):
        for layer in LAYERS:
            ids = _ids(5 + 9 * step, seed=step * 7 + layer)
            ids[0, 0] = EXPERTS  # no such expert
            batches.append((layer, ids))
            host.count(layer, ids)
            device.count(layer, torch.from_numpy(ids).to(dtype))
        host.end_step(), device.end_step()
    assert np.array_equal(host.last.array(), device.last.array())
    assert np.array_equal(host.last.array(), _counted(batches))
    device.count(LAYERS[0], torch.tensor([[1, 1]]))
    device.end_step()
    assert device.close_window().array()[0, 1] == 2  # the device counts were zeroed


def test_dump_round_trips_through_read_dump(tmp_path):
    path = rank_path(tmp_path / "load.jsonl", 1, 2)
    assert path.name == "load.rank1.jsonl" and rank_path("x/l.jsonl", 0, 1).name == "l.jsonl"
    publisher = Publisher([DumpFile(path)])
    recorder = LoadRecorder("c", LAYERS, EXPERTS, window_steps=2, sinks=[publisher])
    for step in range(6):
        recorder.count(LAYERS[step % 3], _ids(11, seed=step))
        recorder.end_step()
    assert publisher.flush()
    publisher.close()
    windows = list(read_dump(path))
    assert [w.first_step for w in windows] == [0, 2, 4]
    assert windows[-1] == recorder.last
    assert np.array_equal(total(windows), _counted(
        [(LAYERS[s % 3], _ids(11, seed=s)) for s in range(6)]))


def test_a_failing_dump_warns_once_and_stops(tmp_path, caplog):
    path = tmp_path / "gone" / "load.jsonl"
    dump = DumpFile(path)
    window = LoadWindow.of("c", 0, 1, 0.0, 1.0, LAYERS, np.ones((3, EXPERTS)))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            dump(window)  # the folder does not exist: an OSError each time, caught
    assert dump.failed and len([r for r in caplog.records if "no more" in r.message]) == 1
    path.parent.mkdir()
    dump(window)
    assert not path.exists()  # it stopped for good


def test_a_sink_that_raises_does_not_stop_the_others(caplog):
    got = []

    def broken(window):
        raise RuntimeError("a bug")

    publisher = Publisher([broken, got.append])
    recorder = LoadRecorder("c", LAYERS, EXPERTS, window_steps=1, sinks=[publisher])
    with caplog.at_level(logging.ERROR):
        for _ in range(3):
            recorder.end_step()
        assert publisher.flush()
    publisher.close()
    assert len(got) == 3 and publisher.sinks == [got.append]


def test_heartbeat_carries_the_last_window_within_a_limit(monkeypatch):
    recorder = LoadRecorder("c", LAYERS, EXPERTS, window_steps=1)
    assert recorder.message() == {}
    recorder.count(LAYERS[1], _ids(8, seed=3))
    window = recorder.end_step()
    assert LoadWindow.from_message(recorder.message()) == window
    monkeypatch.setattr(load_recorder, "HEARTBEAT_LIMIT", 100)
    recorder.end_step()
    assert recorder.message() == {}  # over the limit: none rather than a broken monitor


def test_a_deepseek_sized_window_fits_the_monitor_and_a_crowd_does_not_break_it():
    """58 layers x 256 experts: one client's window goes through a heartbeat and comes back
    in a watch; with so many clients that a snapshot would pass MAX_LINE, the watch answers
    without the clients' loads instead of breaking every watcher."""
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=30.0)).start()
    backend, sessions = connect(monitor.address, TOKEN), []
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 100_000, (58, 256))  # 5 digits each: larger than most windows
    window = LoadWindow.of("big", 0, 16, 1.0, 2.0, range(3, 61), counts)
    size = len(json.dumps(window.to_message()))
    assert size <= load_recorder.HEARTBEAT_LIMIT
    try:
        def client(name: str):
            session = backend.session()
            sessions.append(session)
            session.register(Member(CLIENT, name, "h", 1), 0.3)
            session.heartbeat(window.to_message())

        client("c0")
        assert latest_windows(backend.watch(-1, 0.0).clients()) == {"c0": window}
        for i in range(1, MAX_LINE // size + 2):
            client(f"c{i}")
        snapshot = backend.watch(-1, 0.0)
        assert len(snapshot.clients()) > MAX_LINE // size
        assert latest_windows(snapshot.clients()) == {}
        assert backend.stats().counters["client_loads_omitted"] >= 1
    finally:
        for session in sessions:
            session.close()
        backend.close()
        monitor.close()


# -- the expert servers' per-expert time --------------------------------------------------------
def _layer(experts: int, hidden: int = 64, inter: int = 32) -> LayerExperts:
    g = torch.Generator().manual_seed(0)
    return LayerExperts(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1,
                        torch.randn(experts, hidden, inter, generator=g) * 0.1,
                        torch.arange(experts))


@pytest.mark.parametrize("kernel, shrink", [("fast", True), ("fast", False),
                                            ("reference", True)])
def test_kernels_time_exactly_the_experts_with_entries(kernel, shrink):
    layer, tokens = _layer(8), 12
    g = torch.Generator().manual_seed(1)
    local = torch.randint(0, 5, (tokens * 2,), generator=g)  # experts 5-7 get none
    local[::3] = -1
    x, w = torch.randn(tokens, 64, generator=g), torch.rand(tokens, 2, generator=g)
    load = torch.full((2, 8), 7, dtype=torch.int64)  # added to, not overwritten
    timed = weighted_expert_sum(layer, x, local, w, kernel=kernel, shrink=shrink,
                                expert_load=load)
    assert torch.equal(timed, weighted_expert_sum(layer, x, local, w, kernel=kernel,
                                                  shrink=shrink))
    entries = torch.bincount(local[local >= 0], minlength=8)
    assert torch.equal(load[0], entries + 7)
    assert ((load[1] > 7) == (entries > 0)).all() and (load[1][entries == 0] == 7).all(), load


def test_server_load_survives_a_layer_changing_its_experts():
    """Counts are kept by global expert id across the layer's experts being swapped (a
    replica added): the old rows' counts are folded in, nothing counted twice."""
    from sglang_eaas.expert_server.expert_load import ExpertLoad

    load = ExpertLoad([0, 1], 8)
    first = LayerExperts(torch.zeros(2, 4, 4), torch.zeros(2, 4, 2),
                         torch.tensor([-1, -1, -1, 1, -1, 0, -1, -1]))  # rows: experts 5, 3
    load.of(0, first).add_(torch.tensor([[3, 4], [30, 40]]))
    assert load.of(0, first) is load.of(0, first)
    second = LayerExperts(torch.zeros(3, 4, 4), torch.zeros(3, 4, 2),
                          torch.tensor([2, -1, -1, 1, -1, 0, -1, -1]))  # + expert 0
    load.of(0, second).add_(torch.tensor([[1, 1, 1], [10, 10, 10]]))
    assert load.per_expert() == {0: {0: (1, 10), 3: (5, 50), 5: (4, 40)}}
    assert load.summary() == {"0": [10, 100, 3, 50]}


REPLICATED = [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7], [0, 1, 6, 7]]  # each expert on two


def test_clients_and_servers_count_the_same_and_a_failover_counts_once(tiny_qwen3):
    """Three real expert servers, every expert on two. The client's window equals a count of
    the ids, and the servers' per-expert tokens add up to it (each entry went to one holder),
    with time > 0 exactly where tokens are. Then a server dies with a layer's entries in its
    slot: they are sent again to the other holders, and counted once by the client. The
    monitor's snapshot carries the client's last window."""
    from sglang_eaas.checkpoint import ModelIdentity
    from sglang_eaas.client.client import EaasClient
    from sglang_eaas.launcher.local_servers import start_local_servers
    from sglang_eaas.model_info import MoeModelInfo

    info = MoeModelInfo.from_model_path(tiny_qwen3)
    monitor = MonitorServer(MonitorConfig(token=TOKEN, loss_timeout=2.0)).start()
    log = open_log("load-recording-failover")
    servers = start_local_servers(tiny_qwen3, REPLICATED, "float32", max_clients=4,
                                  extra_args=("--monitor", monitor.address, "--heartbeat",
                                              "0.1"), stdout=log)
    client = None
    try:
        client = EaasClient([s.address for s in servers], info, ModelIdentity.of(tiny_qwen3),
                            torch.float32, "load-client", result_timeout=30.0,
                            monitor=monitor.address, heartbeat=0.1, load_window=2)
        layer = info.moe_layers[0]
        g = torch.Generator().manual_seed(5)

        def step(tokens: int):
            x = torch.randn(tokens, info.hidden_size, generator=g)
            ids = torch.stack([torch.randperm(info.num_experts, generator=g)[:info.top_k]
                               for _ in range(tokens)])
            ids[0, 0] = -1
            client.begin_step()
            client.forward(layer, x, ids, torch.rand(tokens, info.top_k, generator=g))
            assert not client.end_step()
            return collections.Counter(ids[ids >= 0].tolist())

        expected = step(20) + step(7)
        window = client.load.last
        assert window.first_step == 0 and window.steps == 2
        row = window.layers.index(layer)
        assert window.array()[row].tolist() == [expected[e] for e in range(info.num_experts)]
        assert window.array().sum() == sum(expected.values())  # other layers: nothing
        served = collections.Counter()
        for server in servers:
            load = probe(server.address, TOKEN).expert_load
            for expert, (tokens, ns) in load.get(layer, {}).items():
                assert tokens > 0 and ns > 0, (server.address, expert, tokens, ns)
                served[expert] += tokens
            assert set(load) <= {layer}
        assert served == expected

        deadline = time.monotonic() + 10
        while latest_windows(connect(monitor.address, TOKEN).watch(-1, 0.0).clients()).get(
                client.tier.client_id) != window:
            assert time.monotonic() < deadline, "the monitor never got the client's window"
            time.sleep(0.1)

        victim = servers[1]
        os.kill(victim.process.pid, signal.SIGSTOP)  # the next layer's entries wait there
        threading.Timer(0.3, os.kill, (victim.process.pid, signal.SIGKILL)).start()
        again = step(16) + step(9)
        assert victim.address not in client.view.connections
        assert client.tier.stats["failovers"] == 1  # seen mid-layer: its entries went again
        window = client.load.last
        assert window.first_step == 2
        assert window.array()[row].tolist() == [again[e] for e in range(info.num_experts)]
    finally:
        if client is not None:
            client.close()
        for server in servers:
            server.stop()
        monitor.close()
        log.close()


# -- SGLang end to end --------------------------------------------------------------------------
METRIC = re.compile(r'^sglang_eaas_expert_tokens_total\{([^}]*)\} ([0-9.e+]+)$', re.M)


def _labels(text: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', text))


def _dump_total(path) -> np.ndarray | None:
    windows = list(read_dump(path)) if path.exists() else []
    return total(windows) if windows else None


def _settled(path, quiet: float = 1.5, timeout: float = 60.0) -> np.ndarray:
    """The dump's total once nothing was added for ``quiet`` seconds."""
    deadline, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < deadline:
        now = _dump_total(path)
        if last is None or now is None or not np.array_equal(now, last):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return last
        time.sleep(0.2)
    raise AssertionError(f"{path} kept changing for {timeout}s")


@pytest.mark.slow
@pytest.mark.cpu_only
def test_sglang_records_load_to_metrics_dump_and_servers(tiny_qwen3, tmp_path):
    """SGLang --eaas --enable-metrics --eaas-load-dump: after a few requests the dump's tokens
    per MoE layer are (tokens through the model) x top_k, /metrics has the same per (layer,
    expert), the expert servers served exactly those, with time > 0 exactly where tokens
    went, and the monitor has the rank's last window."""
    from sglang_eaas.model_info import MoeModelInfo
    from sglang_eaas.addresses import free_port

    info = MoeModelInfo.from_model_path(tiny_qwen3)
    dump = tmp_path / "load.jsonl"
    monitor = f"127.0.0.1:{free_port()}"
    server = start_server(tiny_qwen3, "--eaas", "--eaas-expert-servers", "local:2",
                          "--eaas-monitor", f"embedded:{monitor}", "--enable-metrics",
                          "--eaas-load-dump", str(dump), "--eaas-load-window", "1",
                          name="eaas-load-recording")
    try:
        deadline = time.monotonic() + 120
        while "fired up and ready" not in server.log_path.read_text():
            assert time.monotonic() < deadline, "SGLang never said it was ready"
            time.sleep(0.5)
        before = _settled(dump)  # SGLang's warm-up and health checks
        processed = 0
        for prompt, new in (("Load is counted per expert", 6), ("def f(x):", 9),
                            ("The quick brown fox jumps over", 4)):
            meta = server.generate(prompt, new)["meta_info"]
            processed += (meta["prompt_tokens"] - meta.get("cached_tokens", 0)
                          + meta["completion_tokens"] - 1)
        after = _settled(dump)
        added = after - before
        assert added.sum(axis=1).tolist() == [processed * info.top_k] * len(info.moe_layers)

        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
        exported = np.zeros_like(after)
        for labels, value in METRIC.findall(metrics):
            found = _labels(labels)
            assert found["rank"] == "0"
            exported[info.moe_layers.index(int(found["layer"])), int(found["expert"])] = float(
                value)
        assert np.array_equal(exported, after)
        assert re.search(r'^sglang_eaas_expert_load_imbalance\{[^}]*layer="%d"[^}]*\} '
                         r'([1-9][0-9.e+]*)$' % info.moe_layers[0], metrics, re.M)

        snapshot = connect(monitor, TOKEN).watch(-1, 0.0)
        (window,) = latest_windows(snapshot.clients()).values()
        assert window.layers == list(info.moe_layers) and window.steps == 1
        served = np.zeros_like(after)
        for member in snapshot.servers():
            assert member.load["expert_load"]  # the heartbeat's per-layer summary
            for layer, experts in probe(member.id, TOKEN).expert_load.items():
                for expert, (tokens, ns) in experts.items():
                    assert tokens > 0 and ns > 0, (member.id, layer, expert, tokens, ns)
                    served[info.moe_layers.index(layer), expert] += tokens
        assert np.array_equal(served, after)  # no replicas: each entry went to one server
    finally:
        server.stop()
