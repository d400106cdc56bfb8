"""The device backend's native side (ibgda/csrc/device): it compiles with nvcc, the kernels use
system-scope release/acquire, the module loads and refuses bad input on a host without a GPU,
and the transport refuses CUDA regions it cannot reach.

Nothing here runs a kernel: no GPU is available to this project (docs/ibgda.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ibgda import RegionHandle, TransportError, build_native, create_transport
from ibgda.backends import device_cuda, device_nvshmem


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The module built with the NVSHMEM kernels, for one architecture (compiling is slow)."""
    out = tmp_path_factory.mktemp("native")
    path = build_native.build(out, ["sm_90"], nvshmem="on")
    spec = importlib.util.spec_from_file_location(build_native.MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernels(ptx: str) -> dict[str, str]:
    """PTX body of every kernel, by the name it was declared with."""
    bodies = re.split(r"\.entry\s+", ptx)[1:]
    return {re.search(r"(put_signal|wait_flag|read)_kernel", body[:300]).group(1): body
            for body in bodies}


@pytest.mark.parametrize("source", ["peer_kernels.cu", "nvshmem_kernels.cu"])
def test_every_kernel_compiles(source, tmp_path):
    ptx = build_native.emit_ptx(source, "sm_90", tmp_path / "out.ptx",
                                build_native.find_nvshmem()).read_text()
    assert set(_kernels(ptx)) == {"put_signal", "wait_flag", "read"}


def test_peer_kernels_publish_with_release_and_poll_with_acquire(tmp_path):
    kernels = _kernels(build_native.emit_ptx("peer_kernels.cu", "sm_90",
                                             tmp_path / "peer.ptx").read_text())
    put = kernels["put_signal"]
    # The last block fences every block's copies, then release-stores the flag.
    assert put.index("membar.sys") < put.index("st.release.sys.global.u32")
    assert "ld.acquire.sys.global.u32" in kernels["wait_flag"]
    assert "globaltimer" in kernels["wait_flag"]  # it gives up after its timeout
    assert ".release" not in kernels["read"]


def test_module_loads_without_a_gpu(native):
    assert native.HAS_NVSHMEM and native.MAX_SECTIONS == 4 and native.IPC_HANDLE_BYTES == 64
    assert len(native.nvshmem_unique_id()) > 0  # host-side bootstrap needs no GPU


def test_accesses_outside_the_region_are_refused_before_any_launch(native):
    region, size, stream = 0x1000, 256, 0
    with pytest.raises(ValueError, match=r"access \[250, 258\) is outside the 256-byte region"):
        native.put_signal(region, size, [(0x2000, 250, 8)], -1, 1, 0, stream)
    with pytest.raises(ValueError, match="outside"):
        native.read(region, size, 0, 0x2000, 257, stream)
    with pytest.raises(ValueError, match="not 4-aligned"):
        native.wait_flag(region, size, 3, 1, 10, 0x3000, stream)
    with pytest.raises(ValueError, match="outside"):
        native.nvshmem_put_signal(region, size, [], 256, 1, 1, stream)
    with pytest.raises(ValueError, match="at most 4 sections"):
        native.put_signal(region, size, [(0x2000, 0, 1)] * 5, -1, 1, 0, stream)
    with pytest.raises(ValueError, match="IPC handle has 64 bytes, not 3"):
        native.open_region(b"abc")


def test_cuda_calls_report_the_cuda_error(native):
    with pytest.raises(RuntimeError, match=r"cudaMalloc of a region failed: .*\(cudaError"):
        native.alloc_region(4096)
    with pytest.raises(RuntimeError, match=r"cudaIpcOpenMemHandle failed"):
        native.open_region(bytes(64))


def test_build_refuses_what_it_cannot_do(monkeypatch):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "ibgda.build_native", *args],
                              capture_output=True, text=True, timeout=60)

    result = run("--arch", "hopper")
    assert result.returncode == 1 and "'hopper' is not of the form sm_NN" in result.stderr
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    result = run()
    assert result.returncode == 1 and "nvcc not found" in result.stderr


def test_a_cuda_region_of_another_node_is_refused():
    handle = RegionHandle("device", f"cuda-ipc:elsewhere/1234:{'00' * 64}", 4096)
    with pytest.raises(TransportError, match="CUDA IPC only reaches GPUs of one node"):
        create_transport("device").connect(handle)


def test_a_cuda_region_of_this_node_needs_the_module_then_a_gpu(native, monkeypatch):
    handle = RegionHandle("device", f"cuda-ipc:{device_cuda.node_id()}:{'00' * 64}", 4096)
    monkeypatch.setitem(sys.modules, "ibgda._device_cuda", None)  # as if never built
    with pytest.raises(TransportError, match="run 'python -m ibgda.build_native'"):
        create_transport("device").connect(handle)
    monkeypatch.setattr(device_cuda, "native", lambda: native)
    with pytest.raises(RuntimeError, match="cudaIpcOpenMemHandle failed"):
        create_transport("device").connect(handle)


# The NVSHMEM job mode (ibgda/backends/device_nvshmem.py): what runs without a GPU. Joining a
# job does not: NVSHMEM aborts the process when it finds no GPU, so no test joins one.


def test_an_nvshmem_job_spec_is_checked():
    spec = device_nvshmem.JobSpec.parse("2/4@/shared/job.uid")
    assert (spec.rank, spec.nranks, str(spec.uid_file)) == (2, 4, "/shared/job.uid")
    for bad in ("4/4@/x", "1/4", "a/4@/x", "1-4@/x", "1/4@"):
        with pytest.raises(TransportError, match="is not RANK/NRANKS@UID_FILE"):
            device_nvshmem.JobSpec.parse(bad)


def test_regions_are_carved_from_the_slab_without_any_collective():
    slab = device_nvshmem.SlabAllocator(4096)
    a, b, c = slab.allocate(1), slab.allocate(300), slab.allocate(256)
    assert (a, b, c) == (0, 256, 768)  # aligned starts, first fit
    with pytest.raises(TransportError, match="no 3328 free bytes left .*IBGDA_NVSHMEM_SLAB_MB"):
        slab.allocate(3073)  # 3072 are left, after c
    slab.free(a)
    slab.free(b)  # coalesces with a's range: 768 contiguous bytes at 0
    assert slab.allocate(700) == 0
    assert slab.allocate(3072) == 1024  # the tail, up to the end


class _FakeNvshmem:
    HAS_NVSHMEM = True

    def nvshmem_unique_id(self) -> bytes:
        return b"\x07" * 128


def test_rank_zero_publishes_the_unique_id_and_the_others_wait_for_it(tmp_path, monkeypatch):
    uid_file = tmp_path / "job.uid"
    member = device_nvshmem.JobSpec(1, 2, uid_file)
    monkeypatch.setattr(device_nvshmem, "UID_WAIT", 0.3)
    with pytest.raises(TransportError, match="no NVSHMEM unique id at .*is rank 0 of the job up"):
        device_nvshmem._exchange_unique_id(member, _FakeNvshmem())
    root = device_nvshmem.JobSpec(0, 2, uid_file)
    assert device_nvshmem._exchange_unique_id(root, _FakeNvshmem()) == b"\x07" * 128
    assert device_nvshmem._exchange_unique_id(member, _FakeNvshmem()) == b"\x07" * 128


def test_nvshmem_regions_are_refused_outside_their_job(monkeypatch):
    monkeypatch.delenv(device_nvshmem.JOB_ENV, raising=False)
    handle = RegionHandle("device", "nvshmem:0123456789abcdef:3:4096", 8192)
    with pytest.raises(TransportError, match="belongs to NVSHMEM job 0123456789abcdef, and this "
                                             "process is in no NVSHMEM job"):
        create_transport("device").connect(handle)
    with pytest.raises(TransportError, match="malformed NVSHMEM region name"):
        create_transport("device").connect(RegionHandle("device", "nvshmem:x:y", 8))
    without = type("Module", (), {"HAS_NVSHMEM": False})()
    monkeypatch.setattr(device_nvshmem, "native", lambda: without)
    with pytest.raises(TransportError, match="built without NVSHMEM"):
        device_nvshmem.NvshmemJob(device_nvshmem.JobSpec(0, 2, Path(__file__)))
