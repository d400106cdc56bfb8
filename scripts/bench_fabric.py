"""Benchmark: filling an expert server with one server's worth of experts from a peer, over the
weight fabric, against this machine's copy bandwidth (docs/elastic.md, "Weight fabric").

On the bench checkpoint (bfloat16), a holder server has every expert of every MoE layer; a
fresh receiver server, holding none, is filled with the experts one server of a 4-server,
3-replica placement holds (``--share`` of them, every MoE layer) by ``add_experts`` from the
holder, one call per layer, as the balancer and a resize do. The time is the callers', from the
first call to the last reply: the lease, the digest checks, the region of the layer's next
version, the one-sided read and the swap. Fill methods, each into its own fresh receiver:

* ``fabric copy`` (``--weight-fabric copy``): the rows read one-sidedly from the holder's
  ``shm`` region into the receiver's own, a standby server's regions reserved (pre-faulted)
  for its share at its start (``--spare-experts`` = the share), the copy split over
  ``--fill-threads`` threads;
* ``fabric copy, fresh memory``: the same into regions made at the fill (``--spare-experts 0``):
  every page faulted in by the copy;
* ``fabric map`` (``--weight-fabric map``, the default): the holder's layer mapped in place;
* ``control`` (``--weight-fabric off``): chunks of base64 in JSON lines over the control
  channel, the path before the fabric;
* ``disk``: read from the checkpoint's safetensors files (page cache warm).

Baselines, same run, same bytes: glibc ``memcpy`` between two preallocated buffers (warm pages;
on 1 thread and split over this machine's cores, up to 8): the machine's copy bandwidth is the
faster; torch's ``copy_`` (slower: it does not stream large copies); ``memcpy`` from peer
``shm`` regions newly mapped into this process, one per layer, into a faulted-in region (the
page-table faults on the source side that any one-sided read on one host pays: the bound of a
copying fill); ``memcpy`` into a new region (every destination page faulted in by the copy).
Servers run in this process (their control endpoints on threads), with ``--threads`` torch
threads. A fill is charged its *first touch* too: one byte of every page of every row it made
usable, read after the fill (a mapped layer copies nothing, but its page faults fall on the first
batch that reads it). Goal (issue 21): a fill, first touch included, at >= 50% of the machine's
copy bandwidth.

    python scripts/bench_fabric.py [--share 24] [--repeat 3]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.report import ROOT, Report, default_out, say, spread  # noqa: E402

import ibgda  # noqa: E402
from sglang_eaas import envs  # noqa: E402
from sglang_eaas.expert_server.fabric import split_memcpy  # noqa: E402
from sglang_eaas.expert_server.server import (  # noqa: E402
    ExpertServer, ExpertServerConfig, fill_threads,
)
from sglang_eaas.model_info import MoeModelInfo  # noqa: E402
from sglang_eaas.protocol.control import AddExperts  # noqa: E402
from sglang_eaas.protocol.lines import Channel  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402

# method -> (--weight-fabric, pre-faulted regions reserved for the share)
METHODS = {"fabric copy": ("copy", True), "fabric copy, fresh memory": ("copy", False),
           "fabric map": ("map", True), "control": ("off", False), "disk": ("copy", True)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=int, default=24,
                   help="experts per MoE layer filled (one server's worth of 32 with 4 servers "
                   "and 3 replicas); default %(default)s")
    p.add_argument("--repeat", type=int, default=3,
                   help="fills per method (the median is reported); default %(default)s")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the servers (an expert server's --threads); default "
                   "%(default)s")
    p.add_argument("--fill-threads", type=int, default=0,
                   help="the receiver's --fill-threads (0: its default, this machine's cores "
                   "up to 8); default %(default)s")
    p.add_argument("--out", type=Path, default=default_out("fabric"),
                   help="markdown report; default %(default)s")
    args = p.parse_args()
    if args.share < 1 or args.repeat < 1 or args.threads < 1 or args.fill_threads < 0:
        p.error("--share, --repeat and --threads must be >= 1, --fill-threads >= 0")
    return args


def memcpy(dst: torch.Tensor, src: torch.Tensor, pool: ThreadPoolExecutor | None,
           threads: int = 1) -> None:
    """glibc ``memcpy`` of ``src`` into ``dst`` (uint8, same size), split over ``threads`` of
    the pool's threads (None: this thread); ctypes lets the GIL go during each call."""
    nbytes, to, at = src.numel(), dst.data_ptr(), src.data_ptr()
    if pool is None:
        ctypes.memmove(to, at, nbytes)
    else:
        split_memcpy(to, at, nbytes, pool, threads)  # as a fill copies


def memcpy_seconds(nbytes: int, threads: int, repeat: int) -> float:
    """Warm pages on both sides."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    times = []
    for _ in range(repeat + 1):
        began = time.perf_counter()
        memcpy(dst, src, pool, threads)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def torch_copy_seconds(nbytes: int, threads: int, repeat: int) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeat + 1):
        began = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - began)
    torch.set_num_threads(1)
    return statistics.median(times[1:])


def fresh_source_seconds(nbytes: int, threads: int, repeat: int, layers: int) -> float:
    """``memcpy`` into a faulted-in region from peer regions newly mapped into this process
    (one per layer, as a fill maps each holder layer's region): the page-table faults on the
    source side are what any one-sided read on one host pays, the bound of a copying fill."""
    transport = ibgda.create_transport("shm")
    holders = [transport.create_region(nbytes // layers) for _ in range(layers)]
    for region in holders:
        region.view(0, nbytes // layers).fill_(1)
    mine = transport.create_region(nbytes // layers)  # a reserved region: faulted in
    dst = mine.view(0, nbytes // layers)
    dst.fill_(0)
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    times = []
    for _ in range(repeat):
        took = 0.0
        for region in holders:
            began = time.perf_counter()
            peer = transport.connect(region.handle)
            memcpy(dst, peer.mapped(0, nbytes // layers), pool, threads)
            took += time.perf_counter() - began
            peer.close()
        times.append(took)
    for region in [*holders, mine]:
        region.close()
    return statistics.median(times)


def new_region_seconds(nbytes: int, threads: int, repeat: int) -> float:
    """``memcpy`` into a region made for it: every destination page faulted in by the copy."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    transport, times = ibgda.create_transport("shm"), []
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    for _ in range(repeat):
        began = time.perf_counter()
        region = transport.create_region(nbytes)
        memcpy(region.view(0, nbytes), src, pool, threads)
        times.append(time.perf_counter() - began)
        region.close()
    return statistics.median(times)


PAGE = 4096


def first_touch_seconds(layers: dict) -> float:
    """Seconds to read one byte of every page of every row the receiver now uses: what its
    first batch pays on top of the fill (page faults of a mapped layer, or of a copy's
    destination that the copy did not fault in), counted against the fill that caused it."""
    began, total = time.perf_counter(), 0
    for experts in layers.values():
        rows = experts.local_index[experts.local_index >= 0].tolist()
        for weights in (experts.w13, experts.w2):
            for row in rows:
                total += int(weights[row].reshape(-1).view(torch.uint8)[::PAGE].sum())
    return time.perf_counter() - began


def fill_seconds(model: Path, info: MoeModelInfo, holder: ExpertServer, method: str,
                 share: list[int], args: argparse.Namespace,
                 token: str) -> tuple[float, float, int]:
    """One fill into a fresh standby receiver: seconds, then seconds of its first touch, and
    the bytes it then holds."""
    mode, reserved = METHODS[method]
    receiver = ExpertServer(ExpertServerConfig(
        str(model), (), token=token, layer_experts={layer: () for layer in info.moe_layers},
        weight_fabric=mode, threads=args.threads, fill_threads=args.fill_threads,
        spare_experts=len(share) if reserved else 0))
    receiver.start()
    channel = Channel(receiver.address, token, 600)
    try:
        source = "" if method == "disk" else holder.address
        began = time.perf_counter()
        for layer in info.moe_layers:
            reply = channel.call(AddExperts(layer, share, source))
            if reply.from_peer != (share if source else []):
                raise RuntimeError(f"{method}: layer {layer} came from {reply}")
        took = time.perf_counter() - began
        return took, first_touch_seconds(receiver.held.layers), receiver.held.weight_bytes()
    finally:
        channel.close()
        receiver.close()


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    model = cached_model(ROOT / ".cache" / "models", PRESETS["bench"], log=lambda m: say("  " + m))
    info = MoeModelInfo.from_model_path(model)
    if args.share > info.num_experts:
        print(f"bench: error: --share {args.share} is more than the model's "
              f"{info.num_experts} experts", file=sys.stderr)
        return 2
    token = envs.TOKEN.get() or os.urandom(16).hex()
    share = list(range(0, info.num_experts))[: args.share]
    say(f"holder: every expert of {len(info.moe_layers)} MoE layers of {model.name}")
    holder = ExpertServer(ExpertServerConfig(str(model), tuple(range(info.num_experts)),
                                             token=token, threads=args.threads))
    holder.start()
    try:
        results: dict[str, float] = {}  # seconds, a fill's first touch included
        fills: dict[str, list[tuple[float, float]]] = {}  # (fill, first touch) per repeat
        nbytes = 0
        for method in METHODS:
            fills[method] = []
            for i in range(args.repeat):
                took, touch, nbytes = fill_seconds(model, info, holder, method, share, args,
                                                   token)
                fills[method].append((took, touch))
                say(f"  {method} fill {i + 1}/{args.repeat}: {took:.3f} s, first touch "
                    f"{touch:.3f} s ({nbytes / 2**20:.0f} MiB)")
            results[method] = statistics.median(a + b for a, b in fills[method])
    finally:
        holder.close()
    say("baselines")
    threads = max(1, min(os.cpu_count() or 1, 8))
    results["memcpy, 1 thread"] = memcpy_seconds(nbytes, 1, args.repeat)
    results[f"memcpy, {threads} threads"] = memcpy_seconds(nbytes, threads, args.repeat)
    results[f"torch copy_, {threads} threads"] = torch_copy_seconds(nbytes, threads, args.repeat)
    results[f"memcpy from newly mapped peer regions, {threads} threads"] = fresh_source_seconds(
        nbytes, threads, args.repeat, len(info.moe_layers))
    results[f"memcpy into a new region, {threads} threads"] = new_region_seconds(
        nbytes, threads, args.repeat)
    best = min(results["memcpy, 1 thread"], results[f"memcpy, {threads} threads"])
    bound = results[f"memcpy from newly mapped peer regions, {threads} threads"]

    receiver_threads = fill_threads(ExpertServerConfig("", (), fill_threads=args.fill_threads))
    report.add(
        f"Setup: bench checkpoint `{model.name}` ({info.dtype}, {len(info.moe_layers)} MoE "
        f"layers, {info.num_experts} experts, hidden {info.hidden_size}, expert intermediate "
        f"{info.moe_intermediate_size}); one fill = {args.share} experts x "
        f"{len(info.moe_layers)} layers = {nbytes / 2**20:.0f} MiB, one add_experts per layer, "
        f"into a standby server; servers with --threads {args.threads}, the receiver with "
        f"--fill-threads {receiver_threads}; "
        f"median [min-max] of {args.repeat} fills per method. A fill's time includes its "
        f"first touch (one byte of every page of every row it made usable, read after it: the "
        f"page faults a mapped layer defers to the first batch), shown apart too.")

    rows = ["| method | fill s | first touch s | seconds, fill + first touch | GB/s | "
            "bandwidth vs memcpy |", "|---|---:|---:|---:|---:|---:|"]
    for method, seconds in results.items():
        parts = fills.get(method)
        each = (f"{spread([a for a, _ in parts], '.3f')} | "
                f"{spread([b for _, b in parts], '.3f')} | "
                f"{spread([a + b for a, b in parts], '.3f')}" if parts else f"| | {seconds:.3f}")
        rows.append(f"| {method} | {each} | {nbytes / seconds / 1e9:.2f} | "
                    f"{best / seconds:.2f}x |")
    report.add("\n".join(rows))
    mapped, copied = best / results["fabric map"], best / results["fabric copy"]
    report.add(
        f"Goal: a fill over the fabric, its first touch included, at >= 50% of this machine's "
        f"copy bandwidth (the faster "
        f"warm memcpy): the default fill, mapped (zero-copy, one host), at {mapped:.0%} -> "
        f"{'met' if mapped >= 0.5 else 'NOT met'}; a copying fill (another host's dtype, "
        f"--weight-fabric copy; Mooncake across hosts) at {copied:.0%} -> "
        f"{'met' if copied >= 0.5 else 'NOT met'}, against {best / bound:.0%} for memcpy alone "
        f"from newly mapped peer regions (its bound on this host) and "
        f"{best / results['fabric copy, fresh memory']:.0%} into fresh memory. The control "
        f"channel moves the same bytes "
        f"{results['control'] / results['fabric copy']:.0f}x slower than the fabric's copy.")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
