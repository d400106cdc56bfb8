"""The client's device path (client/device_step.py): header kernels against the host's struct
code, device routing against the host's, and whole exchanges with real expert servers that must
equal the host path bit for bit and read nothing back.

Without a GPU the kernels run under the Triton interpreter on /dev/shm regions (the CPU twin);
with one (scripts/gpu_check.sh) natively, the servers' slots in GPU memory over CUDA IPC and the
device path's inputs on the GPU, while the host path, the reference, keeps its CPU tensors."""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import pytest
import torch
from conftest import open_log
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client import graph_check
from sglang_eaas.client.device_step import DeviceChannel, DeviceFailure
from sglang_eaas.client.client import EaasClient
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.routing_table import DeviceRoutingTable, RoutingTable
from sglang_eaas.protocol.header import (
    DType, RejectReason, RequestHeader, ResultHeader, ResultStatus,
)

from ibgda import TransportError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLACEMENT = [[0, 1, 2, 3], [4, 5, 6, 7, 0]]  # expert 0 has a replica
MAX_TOKENS = 16  # per request, so a batch of 40 tokens is split in three


def _interpreted_without_a_gpu(mp: pytest.MonkeyPatch) -> None:
    if DEVICE == "cpu":
        mp.setenv("TRITON_INTERPRET", "1")


def _dev(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The device path's inputs: on the GPU where there is one."""
    return tuple(t.to(DEVICE) for t in tensors)


@pytest.fixture(scope="module")
def kernels():
    """``protocol.device_header``, imported with the interpreter on where there is no GPU (Triton
    decides at import)."""
    with pytest.MonkeyPatch.context() as mp:
        _interpreted_without_a_gpu(mp)
        from sglang_eaas.protocol import device_header

        yield device_header


@pytest.fixture(scope="module")
def servers(tiny_qwen3, kernels):
    """Two device-transport servers with room for three clients."""
    log = open_log("device-step-servers")
    with pytest.MonkeyPatch.context() as mp:
        _interpreted_without_a_gpu(mp)
        local = start_local_servers(tiny_qwen3, PLACEMENT, "float32", max_clients=3,
                                    extra_args=("--transport", "device", "--max-tokens",
                                                str(MAX_TOKENS)), stdout=log)
        yield local
    for s in local:
        s.stop()
    log.close()


@pytest.fixture()
def client_of(servers, tiny_qwen3):
    """``client_of(name)``: an EaasClient over the device transport, closed after the test."""
    info, made = MoeModelInfo.from_model_path(tiny_qwen3), []
    identity = ModelIdentity.of(tiny_qwen3, info)

    def make(name: str, timeout: float = 60.0) -> EaasClient:
        made.append(EaasClient([s.address for s in servers], info, identity, torch.float32, name,
                               result_timeout=timeout, transport="device"))
        return made[-1]

    with pytest.MonkeyPatch.context() as mp:
        _interpreted_without_a_gpu(mp)
        yield make
    for client in made:
        client.close()


def _batch(info: MoeModelInfo, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, info.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(info.num_experts, generator=g)[:info.top_k]
                       for _ in range(tokens)])
    return x, ids, torch.rand(tokens, info.top_k, generator=g)


def _tensor(packed: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(DEVICE)


@pytest.mark.parametrize("layer, tokens, dtype", [(0, 1, DType.FLOAT32), (61, 512, DType.BFLOAT16)])
def test_stamped_request_header_is_the_host_header(kernels, layer, tokens, dtype):
    template = _tensor(RequestHeader(layer, tokens, 8, 7168, dtype, 0, 12345).pack())
    seq = torch.tensor([2**40 + 6], dtype=torch.int64, device=DEVICE)
    table = kernels.crc32_table(DEVICE)
    for expected in (2**40 + 7, 2**40 + 8):
        kernels.stamp_request(template, seq, table)
        assert seq.item() == expected
        assert bytes(template.cpu().numpy()) == RequestHeader(layer, tokens, 8, 7168, dtype,
                                                        expected, 12345).pack()


def test_result_check_agrees_with_the_host_and_keeps_the_first_failure(kernels):
    seq = torch.tensor([42], dtype=torch.int64, device=DEVICE)
    table = kernels.crc32_table(DEVICE)
    ok = ResultHeader(ResultStatus.OK, 42, 5).pack()
    corrupt = bytearray(ok)
    corrupt[10] ^= 1
    check = kernels.DeviceCheck
    rejected = ResultHeader(ResultStatus.REJECTED, 42, 0, RejectReason.FOREIGN_EXPERT).pack()
    cases = [  # (answer header, reached, tokens expected) -> DeviceCheck, reason
        ((ok, 1, 5), (check.OK, 0)),
        ((ResultHeader(ResultStatus.OK, 41, 5).pack(), 1, 5), (check.WRONG_ANSWER, 0)),
        ((ok, 1, 4), (check.WRONG_ANSWER, 0)),
        ((rejected, 1, 5), (check.REJECTED, RejectReason.FOREIGN_EXPERT)),
        ((bytes(corrupt), 1, 5), (check.BAD_HEADER, 0)),
        ((ok, 0, 5), (check.NO_ANSWER, 0)),
    ]
    for (header, reached, tokens), (code, reason) in cases:
        status = torch.tensor([reached, 2, 0, 0], dtype=torch.int32, device=DEVICE)
        kernels.check_result(_tensor(header), seq, tokens, table, status)
        assert status[2:].tolist() == [code, reason], (header, reached, tokens)
    # Sticky: a later good answer does not hide an earlier failure from the host.
    status = torch.tensor([1, 2, 0, 0], dtype=torch.int32, device=DEVICE)
    kernels.check_result(_tensor(rejected), seq, 5, table, status)
    kernels.check_result(_tensor(ok), seq, 5, table, status)
    assert status[2:].tolist() == [check.REJECTED, RejectReason.FOREIGN_EXPERT]


def _table(addresses: list[str], placement: list[list[int]], epoch: int = 0) -> RoutingTable:
    """The same experts in both MoE layers of the tiny model."""
    return RoutingTable.uniform(epoch, dict(zip(addresses, placement)), [0, 1], 8)


def _routing(servers, placement: list[list[int]]) -> DeviceRoutingTable:
    """Device routing by ``placement`` over the fixture's servers (to plant a wrong one)."""
    return DeviceRoutingTable(_table([s.address for s in servers], placement), DEVICE)


@pytest.mark.parametrize("placement", [[[0, 1, 2, 3], [4, 5, 6, 7]], PLACEMENT,
                                       [[0, 1, 2, 3, 4], [3, 4, 5, 6, 7], [0, 7, 2]]])
def test_device_routing_is_the_host_routing(placement, monkeypatch):
    """Replicated experts' entries are dealt by load (``dealing``) the same way on the device
    (torch ops and the Triton kernel) as on the host (the C++ op)."""
    _interpreted_without_a_gpu(monkeypatch)
    names = [f"s{i}:1" for i in range(len(placement))]
    table, rng = _table(names, placement), np.random.default_rng(len(placement[0]))
    device = DeviceRoutingTable(table, DEVICE)
    for _ in range(30):
        ids = rng.integers(-1, 8, size=(int(rng.integers(1, 40)), 2))
        assert np.array_equal(device.assign(1, torch.from_numpy(ids).to(DEVICE)).cpu().numpy(),
                              table.assign(1, ids))
    # A new table is loaded in place: the same tensors (a captured graph keeps pointing at
    # them) now route by it.
    moved = _table(names, placement[1:] + placement[:1], epoch=1)  # experts change servers
    pointers = (device.holders.data_ptr(), device.replicas.data_ptr())
    device.load(moved)
    assert (device.holders.data_ptr(), device.replicas.data_ptr()) == pointers
    ids = rng.integers(-1, 8, size=(33, 2))
    assert np.array_equal(device.assign(0, torch.from_numpy(ids).to(DEVICE)).cpu().numpy(),
                          moved.assign(0, ids))
    with pytest.raises(ValueError, match="keeps its servers"):
        device.load(_table(names[:1], [list(range(8))], epoch=2))


def test_device_exchange_equals_the_host_exchange(client_of, tiny_qwen3):
    """Dense device dispatch (every token to every server) and the host path's sparse one give
    the same bits, over replicas and a batch split in three requests."""
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    device, host = client_of("device-path"), client_of("host-path")
    assert device.device_step is not None
    host.device_step = None  # the host path over the same backend (its own slots and seqs)
    for layer, tokens in [(0, 1), (1, 40)]:
        x, ids, weights = _batch(info, tokens, seed=tokens)
        got = device.forward(layer, *_dev(x, ids, weights))
        assert torch.equal(got.cpu(), host.forward(layer, x, ids, weights))
        assert got.abs().sum() > 0


def test_replicas_are_split_per_request_as_on_the_host_path(client_of, tiny_qwen3, monkeypatch):
    """A batch longer than one request is sent in several; within each, the entries of a
    replicated expert are dealt by load within the request, as the host path deals them. (Split
    over the whole batch instead, a row's three or more partial sums would add in another
    order: other bits, with top-4.)"""
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    client = client_of("requests")
    sent = []
    dispatch = DeviceChannel.dispatch

    def recorded(channel, layer_id, hidden, expert_ids, router_weights):
        sent.append((channel.address, expert_ids.cpu()))
        dispatch(channel, layer_id, hidden, expert_ids, router_weights)

    monkeypatch.setattr(DeviceChannel, "dispatch", recorded)
    # expert 0, on both servers, once in each of the two requests
    ids = torch.tensor([[0, 1]] + [[2, 3]] * 15 + [[0, 4]] + [[5, 6]] * 3)
    x, _, weights = _batch(info, len(ids), seed=20)
    client.forward(0, *_dev(x, ids, weights))
    table = client.view.table
    expected = []
    for start in range(0, len(ids), MAX_TOKENS):
        request = ids[start : start + MAX_TOKENS].numpy()
        server = table.assign(0, request)
        expected += [(address, np.where(server == i, request, -1))
                     for i, address in enumerate(table.servers)]
    assert [a for a, _ in sent] == [a for a, _ in expected]
    for (_, got), (address, want) in zip(sent, expected):
        assert np.array_equal(got.numpy(), want), address


def test_a_client_the_monitor_lost_drives_its_new_connections(servers, tiny_qwen3):
    """The monitor lost this client (a stall, say): it registers again and joins the same
    servers afresh (new connections, same server ids), adopts them at a step boundary, and the
    tier closes the old ones. The device step must then drive the new connections, not keep
    the old ones' channels, whose regions are unmapped by then."""
    from tier_steps import wait_until

    from sglang_eaas.monitor.server import MonitorConfig, MonitorServer

    info = MoeModelInfo.from_model_path(tiny_qwen3)
    monitor = MonitorServer(MonitorConfig(token=os.environ["SGLANG_EAAS_TOKEN"],
                                          loss_timeout=30.0)).start()
    with pytest.MonkeyPatch.context() as mp:
        _interpreted_without_a_gpu(mp)
        client = EaasClient([s.address for s in servers], info,
                            ModelIdentity.of(tiny_qwen3, info), torch.float32, "rejoined",
                            result_timeout=60.0, transport="device", monitor=monitor.address)
    try:
        x, ids, weights = _dev(*_batch(info, 5, seed=5))
        before = client.forward(0, x, ids, weights)
        old = dict(client.view.connections)
        client.tier.presence.register_again()  # as after a loss: a new incarnation

        def step():
            assert torch.equal(client.forward(0, x, ids, weights), before)

        wait_until(lambda: all(c.region is None for c in old.values()), 30,
                   "the old connections closed once the new ones are used", step=step)
        assert client.tier.stats["recoveries"] == 1
        assert not set(client.view.connections.values()) & set(old.values())
        step()  # over the new connections' channels
    finally:
        client.close()
        monitor.close()


def test_the_device_exchange_reads_nothing_back(client_of, tiny_qwen3):
    """No call in the step's own code reads a tensor back to the host (what would break CUDA
    graph capture); the host check afterwards does, and is seen doing it."""
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    step = client_of("capture-like").device_step
    x, ids, weights = _dev(*_batch(info, 3, seed=3))
    step.forward(0, x, ids, weights)  # first use: header templates and buffers are made
    ours = {os.path.realpath(m.__file__) for m in (
        sys.modules["sglang_eaas.client.device_step"], sys.modules["sglang_eaas.placement"],
        sys.modules["sglang_eaas.protocol.device_header"], sys.modules["ibgda.backends.device"],
        sys.modules["ibgda.backends.device_cuda"])}
    host_reads = {"item", "tolist", "numpy", "cpu", "synchronize"}
    seen: list[str] = []

    def watch(frame, event, arg):
        if (event == "c_call" and getattr(arg, "__name__", "") in host_reads
                and os.path.realpath(frame.f_code.co_filename) in ours):
            seen.append(f"{arg.__name__} in {frame.f_code.co_name}")

    sys.setprofile(watch)
    try:
        out = step.run(0, x, ids, weights)
        assert not seen, seen
        step.check()
    finally:
        sys.setprofile(None)
    assert seen == ["tolist in check"]  # one read for every channel; the watcher does see it
    assert out.abs().sum() > 0


def test_device_path_failures_reach_the_host(client_of, servers, tiny_qwen3):
    """A rejected request and a server that does not answer are raised by the host check."""
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    x, ids, weights = _dev(*_batch(info, 2, seed=2))
    wrong = client_of("wrong-routing")
    # A client that believes server 0 holds every expert sends it experts it does not hold.
    wrong.device_step.routing = _routing(servers, [list(range(8)), [0]])
    with pytest.raises(TransportError, match="rejected a request: FOREIGN_EXPERT"):
        wrong.forward(0, x, torch.tensor([[5, 6], [7, 4]], device=DEVICE), weights)  # raised
    patient = client_of("patient", timeout=0.5)
    os.kill(servers[1].process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(DeviceFailure,
                           match=f"{servers[1].address} did not answer within 0.5s") as raised:
            patient.device_step.forward(0, x, ids, weights)
        assert raised.value.unanswered == {servers[1].address}
    finally:
        os.kill(servers[1].process.pid, signal.SIGCONT)


def test_the_device_path_fails_over_to_the_other_holders(client_of, servers, tiny_qwen3):
    """A server that does not answer is dropped and the layer is run again without it: the
    entries of the replicated expert 0 all go to server 0, the sums are the host path's, and
    rows that need experts only the dropped server holds are recorded as failed."""
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    patient, host = client_of("device-failover", timeout=0.5), client_of("failover-reference")
    host.device_step = None
    x, _, weights = _batch(info, 4, seed=9)
    held_by_0 = torch.tensor([[0, 1], [2, 0], [3, 0], [0, 1]])  # expert 0: both hold it
    expected = host.forward(0, x, held_by_0, weights)
    assert patient.device_step is not None
    os.kill(servers[1].process.pid, signal.SIGSTOP)
    try:
        patient.begin_step()
        out = patient.forward(0, *_dev(x, held_by_0, weights))
        orphaned = patient.forward(1, *_dev(x, torch.tensor([[0, 4], [1, 2], [6, 7], [3, 0]]),
                                            weights))
        failed = patient.end_step()
        left = patient.table.servers  # (a resumed server given at launch is joined again)
        assert patient.device_step is not None and patient.device_step.servers == left
    finally:
        os.kill(servers[1].process.pid, signal.SIGCONT)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-6, atol=1e-6)
    assert left == (servers[0].address,)
    assert failed == {0: "experts [4] of MoE layer 1 have no live expert server",
                      2: "experts [6, 7] of MoE layer 1 have no live expert server"}
    assert orphaned.shape == x.shape


# A client that believes server 0 holds expert 5: whatever it sends there with a 5 is rejected.
WRONG_PLACEMENT = [[0, 1, 2, 3, 5], [4, 6, 7, 0]]
SERVER_1_EXPERTS = [4, 6, 7]  # under both routings (expert 0, replicated, is left out)


def _only(ids: torch.Tensor, experts: list[int]) -> torch.Tensor:
    return torch.where(torch.isin(ids, torch.tensor(experts)), ids, -1)


def test_a_failed_exchange_adds_no_rows_until_the_host_has_checked(client_of, servers,
                                                                   tiny_qwen3):
    """Deferred checks, as in a replayed graph: a rejected request adds none of its server's
    rows, nor does a later good answer from it while the failure is sticky; the host check names
    the server, and afterwards its rows count again. Expectations come from the host path."""
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    step, host = client_of("deferred").device_step, client_of("deferred-reference")
    host.device_step = None
    x, _, weights = _batch(info, 3, seed=7)
    good_ids = torch.tensor([[1, 6], [4, 2], [3, 7]])  # both servers answer
    step.run(0, *_dev(x, good_ids, weights))  # leaves nonzero rows in server 0's result section
    step.check()
    healthy_part = host.forward(0, x, _only(good_ids, SERVER_1_EXPERTS), weights)
    whole = host.forward(0, x, good_ids, weights)
    assert healthy_part.abs().sum() > 0 and not torch.equal(healthy_part, whole)

    step.routing = _routing(servers, WRONG_PLACEMENT)
    bad_ids = torch.tensor([[5, 6], [4, 5], [5, 7]])  # 5 goes to server 0, which rejects it
    failed = step.run(0, *_dev(x, bad_ids, weights)).cpu()
    assert torch.equal(failed, host.forward(0, x, _only(bad_ids, SERVER_1_EXPERTS), weights))
    step.routing = _routing(servers, PLACEMENT)
    still_failed = step.run(0, *_dev(x, good_ids, weights)).cpu()  # a good answer, but sticky
    assert torch.equal(still_failed, healthy_part)
    with pytest.raises(TransportError) as raised:
        step.check()
    assert f"expert server {servers[0].address} rejected a request: FOREIGN_EXPERT" in str(
        raised.value)
    assert servers[1].address not in str(raised.value)

    assert torch.equal(step.run(0, *_dev(x, good_ids, weights)).cpu(), whole)
    step.check()  # cleared: nothing left to raise


class _Batch:
    """What the graph check reads of SGLang's ForwardBatch, carrying one MoE layer's input."""

    def __init__(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        self.hidden, self.ids, self.weights = hidden, ids, weights

    def needs_forward_metadata_init(self) -> bool:
        return True  # a plain decode batch: its eager run plans its own attention metadata


class _ModelRunner:
    """SGLang's ModelRunner as the graph check uses it; its eager path is the hooked MoE layer
    (``EaasClient.forward``, which checks at once)."""

    def __init__(self, client: EaasClient):
        self.client, self.eager_runner, self.eager_runs, self.prepared = client, self, 0, 0

    def _prepare_eager_forward_batch(self, batch: _Batch) -> None:
        self.prepared += 1

    def execute(self, batch: _Batch, pp_proxy_tensors=None) -> torch.Tensor:
        self.eager_runs += 1
        return self.client.forward(0, batch.hidden, batch.ids, batch.weights)


class _GraphRunner:
    """A decode graph runner whose replay is the captured exchange: ``DeviceStep.run`` with no
    host check, with the routing the graph is replayed under (a wrong one makes it fail)."""

    def __init__(self, model_runner: _ModelRunner, replay_routing: DeviceRoutingTable):
        self.model_runner, self.replay_routing = model_runner, replay_routing
        self.replays: list[torch.Tensor] = []  # what each replay left in the graph's output

    @staticmethod
    def execute(runner: _GraphRunner, batch: _Batch, pp_proxy_tensors=None) -> torch.Tensor:
        step = runner.model_runner.client.device_step
        routing, step.routing = step.routing, runner.replay_routing
        try:
            runner.replays.append(step.run(0, batch.hidden, batch.ids, batch.weights))
        finally:
            step.routing = routing
        return runner.replays[-1]


def test_the_graph_check_redoes_a_failed_replay_once_eagerly(client_of, servers, tiny_qwen3,
                                                            monkeypatch):
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    client, host = client_of("graph-like"), client_of("graph-reference")
    host.device_step = None
    x, _, weights = _batch(info, 3, seed=11)
    ids = torch.tensor([[5, 1], [6, 2], [3, 7]])
    batch = _Batch(*_dev(x, ids, weights))
    expected = host.forward(0, x, ids, weights)
    right = client.device_step.routing

    def replay(replay_routing: DeviceRoutingTable):
        runner = _GraphRunner(_ModelRunner(client), replay_routing)
        return runner, graph_check.check_after_replay(_GraphRunner.execute, runner, batch)

    runner, out = replay(right)  # a good replay is kept
    assert (len(runner.replays), runner.model_runner.eager_runs) == (1, 0)
    assert out is runner.replays[0] and torch.equal(out.cpu(), expected)

    wrong_routing = _routing(servers, WRONG_PLACEMENT)
    runner, out = replay(wrong_routing)  # failed replay, good eager run: redone
    assert (len(runner.replays), runner.model_runner.eager_runs, runner.model_runner.prepared) == (
        1, 1, 1)
    assert not torch.equal(runner.replays[0].cpu(), expected)  # server 0's rows are missing
    assert torch.equal(out.cpu(), expected)

    client.device_step.routing = wrong_routing  # the eager run fails too: the request fails
    try:
        runner = _GraphRunner(_ModelRunner(client), wrong_routing)
        with pytest.raises(TransportError,
                           match=f"{servers[0].address} rejected a request: FOREIGN_EXPERT"):
            graph_check.check_after_replay(_GraphRunner.execute, runner, batch)
        assert runner.model_runner.eager_runs == 1
    finally:
        client.device_step.routing = right

    # Another rank shares the forward: it would not join a re-run, so nothing is redone.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    runner = _GraphRunner(_ModelRunner(client), wrong_routing)
    with pytest.raises(TransportError, match="not redone: 2 ranks share this forward"):
        graph_check.check_after_replay(_GraphRunner.execute, runner, batch)
    assert runner.model_runner.eager_runs == 0


def test_a_staged_table_reaches_the_device_tensors_in_place(client_of, servers, tiny_qwen3):
    """The device path reads the client's table too: adopted at a step's first MoE layer, it is
    copied into the same device tensors (a captured graph would keep pointing at them)."""
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    client, host = client_of("staged"), client_of("staged-reference")
    host.device_step = None
    routing = client.device_step.routing
    pointers = (routing.holders.data_ptr(), routing.replicas.data_ptr())
    x, _, weights = _batch(info, 4, seed=3)
    ids = torch.tensor([[0, 5], [0, 1], [6, 0], [0, 2]])
    client.stage(_table([s.address for s in servers], [[0, 1, 2, 3], [4, 5, 6, 7]], epoch=1))
    out = client.forward(0, *_dev(x, ids, weights))
    assert client.table.epoch == routing.epoch == 1
    assert (routing.holders.data_ptr(), routing.replicas.data_ptr()) == pointers
    host.stage(_table([s.address for s in servers], [[0, 1, 2, 3], [4, 5, 6, 7]], epoch=1))
    assert torch.equal(out.cpu(), host.forward(0, x, ids, weights))  # same table, same bits
