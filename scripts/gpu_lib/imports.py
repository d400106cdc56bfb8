"""The modules a GPU run of scripts/gpu_check.sh imports, imported here one after the other: the
no-GPU mode's proof that each piece loads with only what the lent GPU machine has (the start-up
hook in ``absent/`` hides the rest, SGLang first).

    python -m gpu_lib.imports [MODULE ...]   # MODULE...: more to check (GPU_CHECK_EXTRA_IMPORTS)

Prints ``ok NAME`` or ``FAILED NAME: error`` per module; exit 1 if any failed.
"""

from __future__ import annotations

import importlib
import sys

MODULES = (
    # the device backend and its native build
    "ibgda", "ibgda._host_atomics", "ibgda.build_native", "ibgda.backends.device",
    "ibgda.backends.device_cuda", "ibgda.backends.device_nvshmem", "ibgda.kernels",
    # the expert server's kernels (Triton and the CPU build)
    "sgl_kernel_ext.cpu_ops", "sgl_kernel_ext.group_shrink", "sgl_kernel_ext.group_shrink_kernel",
    "sgl_kernel_ext.static_grid", "sgl_kernel_ext.static_grid_kernels",
    "sgl_kernel_ext.grouped_gemm", "sgl_kernel_ext.grouped_gemm_kernels",
    "sgl_kernel_ext.esft_reroute", "sgl_kernel_ext.esft_reroute_kernel",
    # the client's device step, the expert servers it talks to, the tiny test model
    "sglang_eaas.client.client", "sglang_eaas.client.device_step", "sglang_eaas.client.graph_check",
    "sglang_eaas.protocol.device_header", "sglang_eaas.routing_table",
    "sglang_eaas.launcher.local_servers", "sglang_eaas.expert_server.server",
    "sglang_eaas.checkpoint", "sglang_eaas.model_info", "sglang_eaas.tools.make_tiny_model",
    "sglang_eaas.cpu_runtime",
    # the check's own scripts, and the benchmark harness the p2p timing uses
    "gpu_lib.graph_step", "gpu_lib.nvshmem_one_gpu", "gpu_lib.timings", "gpu_lib.selection",
    "bench_lib.p2p_peers",
)


def hidden() -> tuple[str, ...]:
    """The packages ``absent/sitecustomize.py`` hid in this process."""
    return getattr(sys.modules.get("sitecustomize"), "HIDDEN", ())


def main(extra: list[str]) -> int:
    failed = 0
    for name in (*MODULES, *extra):
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - each failure is reported, then the next
            failed += 1
            why = f"{type(exc).__name__}: {exc}"
            missing = getattr(exc, "name", None) or ""
            if missing.partition(".")[0] in hidden():
                why += f" ({missing.partition('.')[0]} is hidden: the lent GPU machine has none)"
            print(f"FAILED {name}: {why}", flush=True)
        else:
            print(f"ok {name}", flush=True)
    total = len(MODULES) + len(extra)
    print(f"imports: {total - failed} of {total} modules import" + (
        f", {failed} do not" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
