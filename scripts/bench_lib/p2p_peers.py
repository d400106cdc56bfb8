"""bench_p2p's measuring peers: the memcpy floor, the slot protocol over an ibgda backend, ZMQ
and gloo echoes; each ``run_*`` starts its peers' processes and returns the medians."""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.synchronize import Barrier, Event
from typing import Callable

import torch
import torch.distributed as dist
from sglang_eaas.protocol.flags import SlotState
from sglang_eaas.protocol.header import DType
from sglang_eaas.protocol.layout import RegionLayout, SlotLayout
from sglang_eaas.protocol.slot import POLL_SPIN_US, ClientSlot, ServerSlot
from sglang_eaas.addresses import free_port

from bench_lib.p2p_processes import Link, Processes
from ibgda import LocalRegion, RegionHandle, RemoteRegion, create_transport

HIDDEN = 7168
DTYPE = torch.bfloat16
SLOT = SlotLayout(max_tokens=512, hidden_size=HIDDEN, top_k=1, dtype=DType.BFLOAT16)
TIMEOUT = 60.0  # seconds: any single wait longer than this is a hang
RoundTrip = Callable[[torch.Tensor], list[torch.Tensor]]


@dataclass(frozen=True)
class Plan:
    """What every measuring process runs: for each batch size, warm-ups then timed round trips."""

    batch_sizes: tuple[int, ...]
    iterations: int
    warmup: int
    threads: int

    @property
    def round_trips(self) -> int:
        return self.warmup + self.iterations


def measure(link: Link, plan: Plan, round_trip: RoundTrip,
            barrier: Barrier | None = None) -> dict[int, float]:
    """Median round trip in microseconds per batch size; the first round trip checks the echo."""
    medians = {}
    for bs in plan.batch_sizes:
        x = torch.randn(bs, HIDDEN, dtype=DTYPE)
        if barrier is not None:
            barrier.wait(TIMEOUT)
        times = []
        for i in range(plan.round_trips):
            start = time.perf_counter()
            outs = round_trip(x)
            elapsed = time.perf_counter() - start
            if i == 0 and not all(torch.equal(out, x) for out in outs):
                raise RuntimeError(f"bs={bs}: the echo differs from what was sent")
            if i >= plan.warmup:
                times.append(elapsed)
        medians[bs] = statistics.median(times) * 1e6
        link.say(f"bs={bs}: {medians[bs]:.1f} us (median of {len(times)})")
    return medians


def memcpy_floor(link: Link, plan: Plan) -> dict[int, float]:
    """What any round trip must at least do: copy the payload there and back."""

    @functools.cache
    def buffers(bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(bs, HIDDEN, dtype=DTYPE), torch.empty(bs, HIDDEN, dtype=DTYPE)

    def round_trip(x: torch.Tensor) -> list[torch.Tensor]:
        there, back = buffers(x.shape[0])
        there.copy_(x)
        back.copy_(there)
        return [back]

    return measure(link, plan, round_trip)


# name -> (ibgda backend, seconds both ends busy-poll before sleeping)
DEFAULT_SPIN = POLL_SPIN_US * 1e-6
VARIANTS = {"shm": ("shm", DEFAULT_SPIN), "shm-sleep": ("shm", 0.0),
            "mooncake": ("mooncake", DEFAULT_SPIN), "device": ("device", DEFAULT_SPIN)}
DEVICE_BATCH_SIZES = (1, 2, 4, 8)  # the device kernels run interpreted here: ms per launch


def serve_echo(region: LocalRegion, bell: int, slots: list[ServerSlot], stop: Event,
               spin: float) -> None:
    """Answer every ready request with its own hidden states; when idle, busy-poll (yielding)
    for ``spin`` seconds, then sleep on the doorbell (as ExpertServer.serve_forever does)."""
    busy_until = 0.0
    while True:
        seen = region.load_word(bell)
        served = 0
        for slot in slots:
            if slot.ready():
                header, hidden, _, _ = slot.request()
                slot.result_buffer(header.num_tokens).copy_(hidden)
                slot.publish(header.seq, header.num_tokens)
                served += 1
        if served:
            busy_until = time.perf_counter() + spin
        elif stop.is_set():
            return
        else:
            region.idle(bell, seen, busy_until, 0.01)


def slot_server(link: Link, num_clients: int, variant: str) -> None:
    """Create a region with one slot per client, report its handle, echo until stopped."""
    backend, spin = VARIANTS[variant]
    layout = RegionLayout(num_clients, SLOT.size)
    region = create_transport(backend).create_region(layout.size)
    try:
        slots = [ServerSlot(region, layout.base(i), SLOT) for i in range(num_clients)]
        for slot in slots:
            region.store_flag(slot.base + SLOT.flag, SlotState.OFFLINE)  # as a new server does
            slot.open()  # the client "joined": OFFLINE -> EMPTY
        link.report(region.handle)
        serve_echo(region, layout.bell, slots, link.stop, spin)
    finally:
        region.close()  # the creator unlinks the region from /dev/shm


def slot_client(link: Link, handles: list[RegionHandle], index: int, num_clients: int,
                plan: Plan, barrier: Barrier, variant: str) -> dict[int, float]:
    """Slot ``index`` on every server: send to all of them, then wait for all of them."""
    backend, spin = VARIANTS[variant]
    if backend == "device":
        os.environ["TRITON_INTERPRET"] = "1"  # the CPU twin of the device kernels
    layout = RegionLayout(num_clients, SLOT.size)
    transport = create_transport(backend)
    regions: list[RemoteRegion] = []
    slots: list[ClientSlot] = []

    @functools.cache
    def routing(bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(bs, 1, dtype=torch.int32), torch.zeros(bs, 1, dtype=torch.float32)

    def round_trip(x: torch.Tensor) -> list[torch.Tensor]:
        expert_ids, router_weights = routing(x.shape[0])
        for slot in slots:
            slot.send(0, x, expert_ids, router_weights)
        for slot in slots:
            if not slot.wait(TIMEOUT, spin):
                raise TimeoutError(f"no answer within {TIMEOUT} s")
        return [slot.result() for slot in slots]

    try:
        for handle in handles:
            regions.append(transport.connect(handle))
            slots.append(ClientSlot(regions[-1], layout.base(index), SLOT, layout.bell))
        return measure(link, plan, round_trip, barrier)
    finally:
        for slot in slots:
            slot.leave()
        for region in regions:
            region.close()


def zmq_server(link: Link, kind: str) -> None:
    """REP socket on ``kind`` (ipc or tcp): send every message back; an empty one ends it."""
    import zmq  # here, not at the top: the slot variants run where pyzmq is missing (a lent GPU)

    context = zmq.Context()
    sock = context.socket(zmq.REP)
    ipc_path = os.path.join(tempfile.gettempdir(), f"bench-p2p-{os.getpid()}.sock")
    try:
        if kind == "ipc":
            address = f"ipc://{ipc_path}"
            sock.bind(address)
        else:
            address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        link.report(address)
        while True:
            frame = sock.recv(copy=False)
            sock.send(frame, copy=False)
            if not len(frame):
                return
    finally:
        sock.close(linger=0)
        context.term()
        if os.path.exists(ipc_path):
            os.unlink(ipc_path)


def zmq_client(link: Link, address: str, plan: Plan) -> dict[int, float]:
    """REQ socket: zero-copy send of the tensor's bytes, zero-copy view of the reply."""
    import zmq

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT * 1000))

    def round_trip(x: torch.Tensor) -> list[torch.Tensor]:
        sock.send(x.view(torch.uint8).numpy(), copy=False)
        frame = sock.recv(copy=False)
        return [torch.frombuffer(frame.buffer, dtype=DTYPE).view(x.shape)]

    try:
        sock.connect(address)
        medians = measure(link, plan, round_trip)
        sock.send(b"")
        sock.recv()
        return medians
    finally:
        sock.close(linger=0)
        context.term()


def gloo_peer(link: Link, rank: int, port: int, plan: Plan) -> dict[int, float] | None:
    """Rank 0 sends and times, rank 1 receives and sends back, over gloo on 127.0.0.1."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=TIMEOUT))
    try:
        if rank == 1:
            gloo_echo(plan)
            return None

        @functools.cache
        def buffer(bs: int) -> torch.Tensor:
            return torch.empty(bs, HIDDEN, dtype=DTYPE)

        def round_trip(x: torch.Tensor) -> list[torch.Tensor]:
            back = buffer(x.shape[0])
            dist.send(x, 1)
            dist.recv(back, 1)
            return [back]

        return measure(link, plan, round_trip)
    finally:
        dist.destroy_process_group()


def gloo_echo(plan: Plan) -> None:
    """Rank 1: receive and send back exactly as many tensors as rank 0 sends."""
    for bs in plan.batch_sizes:
        buffer = torch.empty(bs, HIDDEN, dtype=DTYPE)
        for _ in range(plan.round_trips):
            dist.recv(buffer, 0)
            dist.send(buffer, 0)


def run_memcpy(plan: Plan) -> dict[int, float]:
    with Processes(plan.threads) as procs:
        procs.start("memcpy", memcpy_floor, plan)
        return procs.get("memcpy")


def run_slots(plan: Plan, variant: str, clients: int, servers: int) -> dict[int, float]:
    """Medians of a clients x servers layout, per batch size the slowest client's."""
    with Processes(plan.threads) as procs:
        tag = f"{variant}-{clients}x{servers}"
        for s in range(servers):
            procs.start(f"{tag}-server{s}", slot_server, clients, variant)
        handles = [procs.get(f"{tag}-server{s}") for s in range(servers)]
        barrier = procs.ctx.Barrier(clients)
        for c in range(clients):
            procs.start(f"{tag}-client{c}", slot_client, handles, c, clients, plan, barrier,
                        variant)
        per_client = [procs.get(f"{tag}-client{c}") for c in range(clients)]
    return {bs: max(medians[bs] for medians in per_client) for bs in plan.batch_sizes}


def run_zmq(plan: Plan, kind: str) -> dict[int, float]:
    with Processes(plan.threads) as procs:
        procs.start(f"zmq-{kind}-server", zmq_server, kind)
        address = procs.get(f"zmq-{kind}-server")
        procs.start(f"zmq-{kind}-client", zmq_client, address, plan)
        return procs.get(f"zmq-{kind}-client")


def run_gloo(plan: Plan) -> dict[int, float]:
    with Processes(plan.threads) as procs:
        port = free_port()
        procs.start("gloo-echo", gloo_peer, 1, port, plan)
        procs.start("gloo-client", gloo_peer, 0, port, plan)
        return procs.get("gloo-client")
