"""Benchmark: round-trip latency of the slot protocol over every ibgda backend against memcpy,
ZMQ and gloo.

The paper's section 5.5 on this machine: a client sends a (bs, 7168) bfloat16 tensor to a server
that returns it at once, and times the round trip; the median per batch size is reported.
"shm" is the project's real slot protocol over the shm transport, waiting as the product does by
default: the client publishes a request (ClientSlot.send) and waits for its result (wait: busy-
polls, yielding the core between polls, for POLL_SPIN_US, then sleeps on the result doorbell);
the server process, waiting the same way on its region doorbell, copies the request's hidden
states into the slot's result buffer and publishes; the client checks the result header (result).
Every client and every server is its own process. Variants: "shm-sleep" (both ends sleep on the
futex doorbell at once: --poll-spin-us 0 / --eaas-poll-spin-us 0), "mooncake" (Mooncake Transfer
Engine over TCP on 127.0.0.1), "device" (the device kernels under the Triton CPU interpreter:
bs 1-8 only, a tenth of the iterations).

Baselines, same run, same sizes, 1 client x 1 server: "memcpy", two copy_ of the payload between
preallocated tensors in one process (what a round trip must at least copy); "zmq-ipc" and
"zmq-tcp", a pyzmq REQ/REP echo over ipc:// and tcp://127.0.0.1 with zero-copy sends; "gloo",
a torch.distributed send/recv echo between two processes on 127.0.0.1. Layouts CxS (every slot
backend but device): C concurrent clients, each sending to all S servers, then waiting for all.

Goal (paper): at bs=128, shm within 2x of memcpy and at least 5x faster than ZMQ and gloo.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import queue
import re
import signal
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier, Event
from typing import Any, Callable

import torch
import torch.distributed as dist
import zmq
from sglang_eaas.client.local_servers import die_with_parent
from sglang_eaas.protocol.flags import SlotState
from sglang_eaas.protocol.header import DType
from sglang_eaas.protocol.layout import RegionLayout, SlotLayout
from sglang_eaas.protocol.slot import POLL_SPIN_US, ClientSlot, ServerSlot
from sglang_eaas.tools.server_process import free_port

from ibgda import LocalRegion, RegionHandle, RemoteRegion, create_transport

HIDDEN = 7168
DTYPE = torch.bfloat16
SLOT = SlotLayout(max_tokens=512, hidden_size=HIDDEN, top_k=1, dtype=DType.BFLOAT16)
TIMEOUT = 60.0  # seconds: any single wait longer than this is a hang
GOAL_BS = 128
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


@dataclass(frozen=True)
class Link:
    """A worker's line to the parent: report values, print progress, see the stop request."""

    name: str
    results: Any  # multiprocessing Queue of (name, kind, value)
    stop: Event

    def report(self, value: Any) -> None:
        self.results.put((self.name, "value", value))

    def say(self, message: str) -> None:
        # One write per line, so that concurrent workers' lines do not interleave.
        sys.stdout.write(f"bench_p2p: [{self.name}] {message}\n")
        sys.stdout.flush()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(0)  # unwinds through the finally blocks: workers stopped, shm regions closed


def _worker(link: Link, threads: int, target: Callable[..., Any], args: tuple) -> None:
    """Process entry point: run ``target(link, *args)`` and report its result or traceback."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    die_with_parent()  # even if the parent is SIGKILLed, no server outlives it
    torch.set_num_threads(threads)
    try:
        value = target(link, *args)
        if value is not None:
            link.report(value)
    except Exception:
        link.results.put((link.name, "error", traceback.format_exc()))


class Processes:
    """Spawned workers reporting on one queue; leaving the block stops, then kills them all."""

    def __init__(self, threads: int):
        self.ctx = mp.get_context("spawn")
        self.threads = threads
        self.results = self.ctx.Queue()
        self.stop = self.ctx.Event()
        self.procs: dict[str, BaseProcess] = {}
        self.pending: dict[str, list[Any]] = {}

    def __enter__(self) -> "Processes":
        return self

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> None:
        link = Link(name, self.results, self.stop)
        proc = self.ctx.Process(target=_worker, args=(link, self.threads, target, args),
                                name=name, daemon=True)
        proc.start()
        self.procs[name], self.pending[name] = proc, []

    def get(self, name: str) -> Any:
        """The next value ``name`` reports; raises as soon as any worker fails or crashes."""
        while not self.pending[name]:
            try:
                sender, kind, value = self.results.get(timeout=1.0)
            except queue.Empty:
                self._check_exits(name)
                continue
            if kind == "error":
                raise RuntimeError(f"{sender} failed:\n{value}")
            self.pending[sender].append(value)
        return self.pending[name].pop(0)

    def _check_exits(self, name: str) -> None:
        """Raise if a worker crashed, or ``name`` exited without a report left in the queue."""
        for other, proc in self.procs.items():
            if proc.exitcode not in (None, 0):
                raise RuntimeError(f"{other} died with exit code {proc.exitcode}")
        if self.procs[name].exitcode == 0 and self.results.empty():
            raise RuntimeError(f"{name} exited without reporting")

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        deadline = time.monotonic() + 3.0
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.results.close()


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


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def main_table(plan: Plan, r: dict[str, dict[int, float]]) -> str:
    """Medians (us) of every method, 1x1, with the ratios the goal is stated in."""
    lines = ["| bs | payload KiB | memcpy us | shm us | zmq-ipc us | zmq-tcp us | gloo us "
             "| shm/memcpy | zmq-ipc/shm | zmq-tcp/shm | gloo/shm |",
             "|---:" * 11 + "|"]
    for bs in plan.batch_sizes:
        shm = r["shm"][bs]
        cells = [str(bs), str(bs * HIDDEN * 2 // 1024)]
        cells += [f"{r[m][bs]:.1f}" for m in ("memcpy", "shm", "zmq-ipc", "zmq-tcp", "gloo")]
        cells += [ratio(shm, r["memcpy"][bs])]
        cells += [ratio(r[m][bs], shm) for m in ("zmq-ipc", "zmq-tcp", "gloo")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def backend_table(r: dict[str, dict[int, float]], variants: list[str]) -> str:
    """Medians (us) of every backend, 1x1, with their ratios to memcpy and from zmq-tcp."""
    header = ["bs", "memcpy us"] + [f"{v} us" for v in variants]
    header += [f"{v}/memcpy" for v in variants] + [f"zmq-tcp/{v}" for v in variants]
    lines = ["| " + " | ".join(header) + " |", "|---:" * len(header) + "|"]
    for bs in r["memcpy"]:
        got = [r[v].get(bs) for v in variants]
        cells = [str(bs), f"{r['memcpy'][bs]:.1f}"]
        cells += ["-" if g is None else f"{g:.1f}" for g in got]
        cells += ["-" if g is None else ratio(g, r["memcpy"][bs]) for g in got]
        cells += ["-" if g is None else ratio(r["zmq-tcp"][bs], g) for g in got]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def layout_table(plan: Plan, layouts: dict[str, dict[int, float]]) -> str:
    """Medians (us) per layout, each with its ratio to 1x1."""
    names = list(layouts)
    header = ["bs", "1x1 us"] + [c for n in names[1:] for c in (f"{n} us", f"{n}/1x1")]
    lines = ["| " + " | ".join(header) + " |", "|---:" * len(header) + "|"]
    for bs in plan.batch_sizes:
        base = layouts["1x1"][bs]
        cells = [str(bs), f"{base:.1f}"]
        cells += [c for n in names[1:] for c in (f"{layouts[n][bs]:.1f}",
                                                 ratio(layouts[n][bs], base))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_verdict(r: dict[str, dict[int, float]], variant: str = "shm") -> str:
    """Whether ``variant`` (an shm one) at bs=128 is within 2x of memcpy and >= 5x faster than
    zmq and gloo."""
    shm = r[variant][GOAL_BS]
    misses = []
    if shm / r["memcpy"][GOAL_BS] > 2:
        misses.append(f"{variant}/memcpy {shm / r['memcpy'][GOAL_BS]:.2f}x > 2x")
    misses += [f"{m}/{variant} {r[m][GOAL_BS] / shm:.2f}x < 5x"
               for m in ("zmq-ipc", "zmq-tcp", "gloo") if r[m][GOAL_BS] / shm < 5]
    verdict = "met" if not misses else "NOT met (" + "; ".join(misses) + ")"
    return (f"Goal at bs={GOAL_BS} ({variant} within 2x of memcpy, >= 5x faster than zmq and "
            f"gloo): {verdict}")


def batch_sizes_arg(text: str) -> tuple[int, ...]:
    """``--batch-sizes``: comma-separated integers between 1 and the slot's max_tokens."""
    sizes = tuple(int(b) for b in text.split(",") if b.strip().isdigit())
    if len(sizes) != len(text.split(",")) or not 1 <= min(sizes) <= max(sizes) <= SLOT.max_tokens:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated integers from 1 to {SLOT.max_tokens}")
    return sizes


def layouts_arg(text: str) -> list[tuple[int, int]]:
    """``--layouts``: comma-separated CLIENTSxSERVERS, 1x1 dropped (it is always measured)."""
    layouts = []
    for item in filter(None, text.split(",")):
        match = re.fullmatch(r"([1-9]\d*)x([1-9]\d*)", item.strip())
        if not match:
            raise argparse.ArgumentTypeError(f"layout {item!r} is not CLIENTSxSERVERS, e.g. 2x2")
        layouts.append((int(match[1]), int(match[2])))
    return [layout for layout in dict.fromkeys(layouts) if layout != (1, 1)]


def variants_arg(text: str) -> list[str]:
    """``--backends``: comma-separated names out of VARIANTS; shm is always measured."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown}; choose from "
                                         f"{', '.join(VARIANTS)}")
    return list(dict.fromkeys(["shm", *names]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The default run takes about 1.5 minutes on 2 CPU cores, process starts "
        "included. Run it on an otherwise idle machine: other load skews every number.",
    )
    parser.add_argument("--batch-sizes", type=batch_sizes_arg,
                        default=",".join(str(1 << i) for i in range(10)),
                        help="comma-separated tokens per message (rows of the 7168-wide bf16 "
                        "tensor), at most 512 (the slot size); default 1,2,4,...,512")
    parser.add_argument("--iterations", type=int, default=200,
                        help="timed round trips per point (the median is reported); default 200")
    parser.add_argument("--warmup", type=int, default=10,
                        help="untimed round trips before each point (the first round trip also "
                        "checks the echo); default 10")
    parser.add_argument("--layouts", type=layouts_arg, default="2x2,1x3",
                        help="comma-separated CLIENTSxSERVERS shm layouts for the layout table, "
                        "besides 1x1 (always measured); each client sends to all its servers, "
                        "then waits for all; clients run concurrently; '' for none; "
                        "default 2x2,1x3")
    parser.add_argument("--backends", type=variants_arg, default="shm,shm-sleep,mooncake,device",
                        help="slot-protocol variants to measure: 'shm' (the default wait: "
                        "busy-poll, yielding, then sleep), 'shm-sleep' (sleep on the futex "
                        "doorbells at once), "
                        "'mooncake' (Transfer Engine, loopback TCP), 'device' (Triton kernels "
                        "under the CPU interpreter: batch sizes 1-8 and a tenth of the "
                        "iterations only); default %(default)s")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads in every process; default 1")
    args = parser.parse_args()
    if args.iterations < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--iterations and --threads must be >= 1, --warmup >= 0")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    plan = Plan(args.batch_sizes, args.iterations, args.warmup, args.threads)
    began = time.monotonic()
    results: dict[str, dict[int, float]] = {}
    runs: dict[str, Callable[[], dict[int, float]]] = {
        "memcpy": functools.partial(run_memcpy, plan),
        "zmq-ipc": functools.partial(run_zmq, plan, "ipc"),
        "zmq-tcp": functools.partial(run_zmq, plan, "tcp"),
        "gloo": functools.partial(run_gloo, plan),
    }
    runs["shm"] = functools.partial(run_slots, plan, "shm", 1, 1)
    device_plan = Plan(tuple(b for b in plan.batch_sizes if b in DEVICE_BATCH_SIZES),
                       max(1, plan.iterations // 10), min(plan.warmup, 2), plan.threads)
    for variant in args.backends:
        for c, s in [(1, 1)] + ([] if variant == "device" else args.layouts):
            runs[variant if (c, s) == (1, 1) else f"{variant}-{c}x{s}"] = functools.partial(
                run_slots, device_plan if variant == "device" else plan, variant, c, s)
    for name, run in runs.items():
        print(f"bench_p2p: measuring {name}", flush=True)
        results[name] = run()
    print(f"\n1 client x 1 server (shm: slot protocol, shm backend), medians in microseconds "
          f"({time.monotonic() - began:.0f} s in all):\n")
    print(main_table(plan, results))
    if GOAL_BS in plan.batch_sizes:
        for variant in ("shm", "shm-sleep"):
            if variant in results:
                print(f"\n{goal_verdict(results, variant)}")
    print("\nEvery backend, 1 client x 1 server, medians in microseconds:\n")
    print(backend_table(results, args.backends))
    for variant in args.backends:
        if variant == "device" or not args.layouts:
            continue
        layouts = {"1x1": results[variant]}
        layouts.update((f"{c}x{s}", results[f"{variant}-{c}x{s}"]) for c, s in args.layouts)
        print(f"\n{variant} layouts (clients x servers), slowest client's median in "
              "microseconds:\n")
        print(layout_table(plan, layouts))


if __name__ == "__main__":
    main()
