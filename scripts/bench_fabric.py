"""Benchmark: filling an expert server with one server's worth of experts from a peer, over the
weight fabric, against this machine's copy bandwidth (docs/elastic.md, "Weight fabric").

On the bench checkpoint (bfloat16), a holder server has every expert of every MoE layer; a
fresh receiver server, holding none, is filled with the experts one server of a 4-server,
3-replica placement holds (``--share`` of them, every MoE layer) by ``add_experts`` from the
holder, one call per layer, as the balancer and a resize do. The time is the callers', from the
first call to the last reply: the lease, the digest checks, the region of the layer's next
version, the one-sided read and the swap. Fill methods, each into its own fresh receiver:

* ``fabric copy`` (``--weight-fabric copy``): the rows read one-sidedly from the holder's
  ``shm`` region into the receiver's own;
* ``fabric map`` (``--weight-fabric map``, the default): the holder's layer mapped in place;
* ``control`` (``--weight-fabric off``): chunks of base64 in JSON lines over the control
  channel, the path before the fabric;
* ``disk``: read from the checkpoint's safetensors files (page cache warm).

Baselines, same run, same bytes: ``memcpy``, ``copy_`` between two preallocated tensors (warm
pages; at 1 and at 2 torch threads); ``memcpy into a new region``, a fresh ``shm`` region
created and filled by ``copy_`` (what any copy into new memory pays: its page faults).
Servers run in this process (their control endpoints on threads), with ``--threads`` torch
threads. Goal (issue 21): ``fabric copy`` at >= 50% of memcpy's bandwidth (the faster of the
two thread counts).

    python scripts/bench_fabric.py [--share 24] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.report import ROOT, Report, default_out, say  # noqa: E402

import ibgda  # noqa: E402
from sglang_eaas import envs  # noqa: E402
from sglang_eaas.expert_server.server import ExpertServer, ExpertServerConfig  # noqa: E402
from sglang_eaas.model_info import MoeModelInfo  # noqa: E402
from sglang_eaas.protocol.control import AddExperts, call  # noqa: E402
from sglang_eaas.tools.make_tiny_model import PRESETS, cached_model  # noqa: E402

METHODS = {"fabric copy": "copy", "fabric map": "map", "control": "off", "disk": "copy"}


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
    p.add_argument("--out", type=Path, default=default_out("fabric"),
                   help="markdown report; default %(default)s")
    args = p.parse_args()
    if args.share < 1 or args.repeat < 1 or args.threads < 1:
        p.error("--share, --repeat and --threads must be >= 1")
    return args


def memcpy_seconds(nbytes: int, threads: int, repeat: int) -> float:
    torch.set_num_threads(threads)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeat + 1):
        began = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])


def new_region_seconds(nbytes: int, repeat: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    transport, times = ibgda.create_transport("shm"), []
    for _ in range(repeat):
        began = time.perf_counter()
        region = transport.create_region(nbytes)
        region.view(0, nbytes).copy_(src)
        times.append(time.perf_counter() - began)
        region.close()
    return statistics.median(times)


def fill_seconds(model: Path, info: MoeModelInfo, holder: ExpertServer, method: str,
                 share: list[int], threads: int, token: str) -> tuple[float, int]:
    """One fill into a fresh receiver: seconds, and the bytes it then holds."""
    receiver = ExpertServer(ExpertServerConfig(
        str(model), (), token=token, layer_experts={layer: () for layer in info.moe_layers},
        weight_fabric=METHODS[method], threads=threads))
    receiver.start()
    try:
        source = "" if method == "disk" else holder.address
        began = time.perf_counter()
        for layer in info.moe_layers:
            reply = call(receiver.address, AddExperts(layer, share, source), token, 600)
            if reply.from_peer != (share if source else []):
                raise RuntimeError(f"{method}: layer {layer} came from {reply}")
        took = time.perf_counter() - began
        return took, receiver.held.weight_bytes()
    finally:
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
        results: dict[str, float] = {}
        nbytes = 0
        for method in METHODS:
            runs = []
            for i in range(args.repeat):
                took, nbytes = fill_seconds(model, info, holder, method, share, args.threads,
                                            token)
                runs.append(took)
                say(f"  {method} fill {i + 1}/{args.repeat}: {took:.3f} s "
                    f"({nbytes / 2**20:.0f} MiB)")
            results[method] = statistics.median(runs)
    finally:
        holder.close()
    say("baselines")
    results["memcpy, 1 thread"] = memcpy_seconds(nbytes, 1, args.repeat)
    results["memcpy, 2 threads"] = memcpy_seconds(nbytes, 2, args.repeat)
    results["memcpy into a new region"] = new_region_seconds(nbytes, args.repeat)
    best = min(results["memcpy, 1 thread"], results["memcpy, 2 threads"])

    report.add(
        f"Setup: bench checkpoint `{model.name}` ({info.dtype}, {len(info.moe_layers)} MoE "
        f"layers, {info.num_experts} experts, hidden {info.hidden_size}, expert intermediate "
        f"{info.moe_intermediate_size}); one fill = {args.share} experts x "
        f"{len(info.moe_layers)} layers = {nbytes / 2**20:.0f} MiB, one add_experts per layer; "
        f"servers with --threads {args.threads}; median of {args.repeat} fills per method.")
    rows = ["| method | seconds | GB/s | bandwidth vs memcpy |", "|---|---:|---:|---:|"]
    for method, seconds in results.items():
        rows.append(f"| {method} | {seconds:.3f} | {nbytes / seconds / 1e9:.2f} | "
                    f"{best / seconds:.2f}x |")
    report.add("\n".join(rows))
    ratio = best / results["fabric copy"]
    report.add(f"Goal: a fill over the fabric (copy) at >= 50% of memcpy's bandwidth: "
               f"{ratio:.0%} -> {'met' if ratio >= 0.5 else 'NOT met'}. The control channel "
               f"moves the same bytes {results['control'] / results['fabric copy']:.0f}x "
               f"slower than the fabric's copy; a mapped fill takes "
               f"{results['fabric map'] * 1e3:.0f} ms whatever its size (no bytes move).")
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
