"""GPU check: timings on one GPU, small sizes (well under a minute).

    python -m gpu_lib.timings [--only gemm|deal|p2p] [--iterations N]

* ``p2p``: the slot protocol's round trip between two processes (scripts/bench_p2p.py's harness,
  ``bench_lib.p2p_peers.run_slots``): a client process sends a ``(bs, 7168)`` bfloat16 tensor
  from host memory, the server process echoes it, over ``device`` (the server's slots in GPU
  memory, reached over CUDA IPC by the native kernels) and over ``shm`` on the same machine, with
  the memcpy floor; medians in microseconds. The first round trip of each size checks the echo.
* ``gemm``: the grouped expert GEMM (``sgl_kernel_ext.grouped_expert_triton``, bfloat16, float32
  accumulation) against torch on the same GPU: the float32 reference the tests use
  (``grouped_expert_reference``) and the same loop in bfloat16 (``F.linear`` per active expert),
  at Qwen3-30B-A3B's expert shape (H 2048, I 768, 128 experts, top-8); medians of
  ``triton.testing.do_bench``. The Triton result must match the reference within the tests'
  bfloat16 tolerance first.
* ``deal``: the device path's routing (``routing_table.DeviceRoutingTable.assign``: torch ops
  and the Triton dealing kernel, docs/balancing.md "Dealing replicated experts") of one MoE
  layer at DeepSeek-V3's size (256 experts, top-8) over 16 servers with 64 experts replicated,
  at batch 1-64: its servers must equal the host path's (the C++ op) first, then medians of
  ``triton.testing.do_bench`` in microseconds, the host path's beside them (timed on the CPU).

Prints ``RESULT: name=value`` lines; exit 0 when every correctness check held, 1 otherwise, 2
without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import torch

P2P_BATCH_SIZES = (1, 8, 64, 512)  # 512 rows: the slot's capacity (7 MiB)
GEMM_CASES = {"decode 64 tokens": 64, "prefill 512 tokens": 512}  # tokens, top-8 of 128
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8


def result(name: str, value) -> None:
    print(f"RESULT: {name}={value}", flush=True)


def p2p(iterations: int) -> None:
    from bench_lib.p2p_peers import Plan, run_memcpy, run_slots

    plan = Plan(P2P_BATCH_SIZES, iterations, warmup=10, threads=1)
    medians = {"memcpy": run_memcpy(plan)}
    for variant in ("device", "shm"):
        medians[variant] = run_slots(plan, variant, 1, 1)
    for bs in plan.batch_sizes:
        result(f"p2p_bs{bs}_us", " ".join(f"{name} {m[bs]:.1f}" for name, m in medians.items())
               + f" (medians of {iterations})")


def _torch_loop(x, w13, w2, spans: list[tuple[int, int, int]]) -> torch.Tensor:
    """The reference's loop in the weights' dtype: gate/up, SiLU * up, down per active expert."""
    out, inter = torch.zeros_like(x), w2.shape[2]
    for e, start, n in spans:
        gate_up = torch.nn.functional.linear(x[start:start + n], w13[e])
        h = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out[start:start + n] = torch.nn.functional.linear(h, w2[e])
    return out


def gemm() -> None:
    from triton.testing import do_bench

    from sgl_kernel_ext.group_shrink import group_shrink_triton
    from sgl_kernel_ext.grouped_gemm import grouped_expert_reference, grouped_expert_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g)
           / HIDDEN ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g)
          / INTER ** 0.5).to(torch.bfloat16)
    for name, tokens in GEMM_CASES.items():
        ids = torch.randint(0, EXPERTS, (tokens * TOP_K,), device="cuda", generator=g)
        counts = torch.bincount(ids, minlength=EXPERTS)
        x = torch.randn(tokens * TOP_K, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        groups = group_shrink_triton(counts)
        spans = [(int(e), int(o), int(n)) for e, o, n in zip(
            groups.expert.tolist(), groups.offset.tolist(), groups.count.tolist())][:groups.active]
        want = grouped_expert_reference(x, w13, w2, groups).float()
        got = grouped_expert_triton(x, w13, w2, groups).float()
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)  # test_kernel_ext's
        relative = ((got - want).norm() / want.norm()).item()
        ms = {"triton": do_bench(lambda: grouped_expert_triton(x, w13, w2, groups),
                                 return_mode="median"),
              "torch bf16 loop": do_bench(lambda: _torch_loop(x, w13, w2, spans),
                                          return_mode="median"),
              "torch f32 reference": do_bench(lambda: grouped_expert_reference(x, w13, w2,
                                                                               groups),
                                              return_mode="median")}
        flops = 6 * tokens * TOP_K * HIDDEN * INTER
        key = name.split()[1]
        result(f"gemm_{key}_tokens", f"{tokens} tokens x top-{TOP_K} over {groups.active} active "
                                     f"experts; rel. error vs float32 reference {relative:.2e}")
        result(f"gemm_{key}_ms", " ".join(f"{n} {t:.3f}" for n, t in ms.items())
               + f"; triton {flops / ms['triton'] / 1e9:.1f} TFLOP/s, "
               f"{ms['torch bf16 loop'] / ms['triton']:.2f}x the bf16 loop")


def deal() -> None:
    import time

    import numpy as np
    from triton.testing import do_bench

    from sglang_eaas.routing_table import DeviceRoutingTable, RoutingTable

    experts, servers, top_k = 256, 16, 8
    rng = np.random.default_rng(0)
    held = {f"s{s}:1": list(range(s * 16, s * 16 + 16)) for s in range(servers)}
    for e in range(64):  # the hottest 64 of a Zipf load replicated once, on another server
        held[f"s{(e // 16 + 1 + e % 3) % servers}:1"].append(e)
    table = RoutingTable.uniform(0, held, [0], experts)
    device = DeviceRoutingTable(table, "cuda")
    popularity = 1 / np.arange(1, experts + 1)
    for batch in (1, 8, 64):
        ids = np.stack([rng.choice(experts, top_k, replace=False,
                                   p=popularity / popularity.sum()) for _ in range(batch)])
        on_gpu = torch.from_numpy(ids).cuda()
        got = device.assign(0, on_gpu).cpu().numpy()
        if not np.array_equal(got, table.assign(0, ids)):
            raise AssertionError(f"batch {batch}: the device path dealt other servers than the "
                                 "host path")
        gpu_us = do_bench(lambda: device.assign(0, on_gpu), return_mode="median") * 1e3
        began = time.perf_counter()
        for _ in range(1000):
            table.assign(0, ids)
        host_us = (time.perf_counter() - began) * 1e3
        result(f"deal_bs{batch}_us", f"device {gpu_us:.1f} host {host_us:.1f} "
                                     f"({batch * top_k} entries, equal servers)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_lib.timings",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["gemm", "deal", "p2p"], default=None,
                        help="run one of the timings (default: all)")
    parser.add_argument("--iterations", type=int, default=50,
                        help="timed round trips per batch size in p2p (default %(default)s)")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error("--iterations must be >= 1")
    if not torch.cuda.is_available():
        print("timings: torch sees no CUDA device, so there is nothing to time here.")
        return 2
    failed = False
    # gemm first: a p2p round trip that hangs (up to bench_p2p's 60 s timeout) comes last
    for name, run in (("gemm", gemm), ("deal", deal), ("p2p", lambda: p2p(args.iterations))):
        if args.only in (None, name):
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - the other timing still runs
                traceback.print_exc()
                result(f"{name}_failed", f"{type(exc).__name__}: {exc}")
                failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
