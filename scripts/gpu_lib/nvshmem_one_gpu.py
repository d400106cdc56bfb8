"""GPU check: the device backend's NVSHMEM path on one GPU, a job of one PE.

    python -m gpu_lib.nvshmem_one_gpu [--slab-mb N]

The process joins an NVSHMEM job of one member (``IBGDA_NVSHMEM_JOB=0/1@FILE``: the unique-id
bootstrap, the symmetric slab), creates a region in its slab (``nvshmem:<job>:0:<offset>``),
connects to it as a peer (PE 0 is itself) and runs the NVSHMEM kernels: one ``put_signal`` of two
sections and a flag, ``wait_flag`` until the flag, ``read`` of both sections, the owner's view of
the same bytes, and a wait for a value never stored that gives up after its timeout. What one PE
cannot show: a put to another GPU or node (NVSHMEM runs one PE per GPU; this machine has one).

Prints ``RESULT: name=value`` lines; exit 0 when every check held, 1 when one failed, 2 without a
GPU. NVSHMEM aborts the whole process on some failures, so gpu_check.sh runs it alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch


def result(name: str, value) -> None:
    print(f"RESULT: {name}={value}", flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def round_trip() -> None:
    import ibgda
    from ibgda.backends import device_nvshmem

    transport = ibgda.create_transport("device")
    started = time.perf_counter()
    region = transport.create_region(1 << 20)  # joins the job: unique id, init, the slab
    result("joined", f"PE {device_nvshmem.job().pe} of job {device_nvshmem.job().id} in "
                     f"{time.perf_counter() - started:.2f}s; region {region.handle.name}")
    check(region.handle.name.startswith("nvshmem:"), f"not an NVSHMEM region: {region.handle}")
    peer = transport.connect(region.handle)
    check(type(peer).__name__ == "NvshmemRemoteRegion", f"connected with {type(peer).__name__}")
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randint(-2**31, 2**31 - 1, (1 << 16,), dtype=torch.int32, device="cuda",
                          generator=g)
        b = torch.randint(0, 255, (1000,), dtype=torch.uint8, device="cuda", generator=g)
        flag, at_a, at_b = 64, 4096, 4096 + a.numel() * 4
        peer.put_signal([(at_a, a), (at_b, b)], flag, 3)
        check(peer.wait_flag(flag, 3, timeout=10.0), "the flag never reached 3")
        out_a, out_b = torch.empty_like(a), torch.empty_like(b)
        peer.read(at_a, out_a)
        peer.read(at_b, out_b)
        torch.cuda.synchronize()
        check(torch.equal(out_a, a) and torch.equal(out_b, b), "read back other bytes")
        check(torch.equal(region.view(at_a, a.numel() * 4).view(torch.int32), a),
              "the owner's view differs from what was put")
        check(region.load_flag(flag) == 3, "the owner does not see the flag")
        result("put_wait_read", "two sections and the flag, read back equal, seen by the owner")
        started = time.perf_counter()
        reached = peer.wait_flag(flag, 4, timeout=0.2)
        waited = time.perf_counter() - started
        check(not reached and 0.15 < waited < 5, f"a wait for 4 returned {reached} after "
                                                  f"{waited:.2f}s")
        result("wait_times_out", f"after {waited:.2f}s (asked 0.2s)")
        times = []
        for _ in range(50):
            started = time.perf_counter()
            peer.put_signal([(at_b, b)], flag, 5)
            peer.wait_flag(flag, 5, timeout=10.0)
            times.append(time.perf_counter() - started)
            peer.store_flag(flag, 0)
        times.sort()
        result("put_wait_us", f"{times[len(times) // 2] * 1e6:.1f} (median of 50, 1000 bytes "
                              "+ flag to itself, host-timed)")
    finally:
        peer.close()
        region.close()
    from ibgda.backends.device_cuda import native

    native().nvshmem_leave()
    result("left", "nvshmem_finalize returned")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_lib.nvshmem_one_gpu",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--slab-mb", type=int, default=64,
                        help="the job's symmetric slab in MiB (IBGDA_NVSHMEM_SLAB_MB; default "
                             "%(default)s)")
    args = parser.parse_args(argv)
    if args.slab_mb < 1:
        parser.error("--slab-mb must be >= 1")
    if not torch.cuda.is_available():
        print("nvshmem_one_gpu: torch sees no CUDA device, so NVSHMEM cannot start here.")
        return 2
    with tempfile.TemporaryDirectory(prefix="gpu-check-nvshmem-") as tmp:
        os.environ["IBGDA_NVSHMEM_JOB"] = f"0/1@{Path(tmp) / 'job.uid'}"
        os.environ["IBGDA_NVSHMEM_SLAB_MB"] = str(args.slab_mb)
        # One GPU, no network: no remote transport to look for.
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", f"{args.slab_mb + 256}M")
        try:
            round_trip()
        except Exception as exc:  # noqa: BLE001 - a check script: the traceback is the finding
            traceback.print_exc()
            result("failed", f"{type(exc).__name__}: {exc}")
            return 1
    result("passed", "every check held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
