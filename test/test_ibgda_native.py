"""The device backend's native side (ibgda/csrc/device): it compiles with nvcc, the kernels use
system-scope release/acquire, the module loads and refuses bad input, and the transport refuses
CUDA regions it cannot reach.

Without nvcc the tests that compile are skipped. On a host without a GPU (this project's) no
kernel runs and every CUDA call must fail (`cpu_only`); on a GPU host the `gpu` tests allocate
device memory and run a put_signal / wait_flag / read round trip instead (never run here)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ibgda import RegionHandle, TransportError, build_native, create_transport
from ibgda.backends import device_cuda, device_nvshmem


def _nvcc_or_skip() -> None:
    """Skip the calling test (with the build's own sentence) where no nvcc can be found."""
    try:
        build_native.find_nvcc()
    except build_native.BuildError as exc:
        pytest.skip(str(exc))


def _this_gpu_or_hopper() -> str:
    """The architecture of this host's GPU, so the gpu tests can launch; sm_90 without one."""
    if not torch.cuda.is_available():
        return "sm_90"
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The module built with the NVSHMEM kernels, for one architecture (compiling is slow)."""
    _nvcc_or_skip()
    out = tmp_path_factory.mktemp("native")
    path = build_native.build(out, [_this_gpu_or_hopper()], nvshmem="on")
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
    _nvcc_or_skip()
    ptx = build_native.emit_ptx(source, "sm_90", tmp_path / "out.ptx",
                                build_native.find_nvshmem()).read_text()
    assert set(_kernels(ptx)) == {"put_signal", "wait_flag", "read"}


def test_peer_kernels_publish_with_release_and_poll_with_acquire(tmp_path):
    _nvcc_or_skip()
    kernels = _kernels(build_native.emit_ptx("peer_kernels.cu", "sm_90",
                                             tmp_path / "peer.ptx").read_text())
    put = kernels["put_signal"]
    # The last block fences every block's copies, then release-stores the flag.
    assert put.index("membar.sys") < put.index("st.release.sys.global.u32")
    assert "ld.acquire.sys.global.u32" in kernels["wait_flag"]
    assert "globaltimer" in kernels["wait_flag"]  # it gives up after its timeout
    assert ".release" not in kernels["read"]


def test_module_loads_with_or_without_a_gpu(native):
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


@pytest.mark.cpu_only
def test_cuda_calls_report_the_cuda_error(native):
    with pytest.raises(RuntimeError, match=r"cudaMalloc of a region failed: .*\(cudaError"):
        native.alloc_region(4096)
    with pytest.raises(RuntimeError, match=r"cudaIpcOpenMemHandle failed"):
        native.open_region(bytes(64))


@pytest.mark.gpu
def test_a_region_is_zeroed_device_memory_with_an_ipc_handle(native):
    size = 1 << 16
    region = native.alloc_region(size)
    try:
        assert region != 0
        assert len(native.export_region(region)) == native.IPC_HANDLE_BYTES
        out = torch.ones(size, dtype=torch.uint8, device="cuda")
        native.read(region, size, 0, out.data_ptr(), size, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert not out.any()
    finally:
        native.free_region(region)


@pytest.mark.gpu
def test_put_signal_then_wait_and_read_on_device_memory(native):
    """One launch writes two sections and the flag; the wait sees the flag and the read the
    sections; a wait for a value never stored gives up after its timeout."""
    size, flag, stream = 1 << 20, 64, torch.cuda.current_stream().cuda_stream
    region = native.alloc_region(size)
    try:
        a = torch.arange(1 << 16, dtype=torch.int32, device="cuda")
        b = torch.full((1000,), 7, dtype=torch.uint8, device="cuda")
        arrivals = torch.zeros(1, dtype=torch.int32, device="cuda")
        status = torch.zeros(2, dtype=torch.int32, device="cuda")
        native.put_signal(region, size, [(a.data_ptr(), 4096, a.numel() * 4),
                                         (b.data_ptr(), 4096 + a.numel() * 4, b.numel())],
                          flag, 3, arrivals.data_ptr(), stream)
        native.wait_flag(region, size, flag, 3, 10**9, status.data_ptr(), stream)
        out_a, out_b = torch.empty_like(a), torch.empty_like(b)
        native.read(region, size, 4096, out_a.data_ptr(), a.numel() * 4, stream)
        native.read(region, size, 4096 + a.numel() * 4, out_b.data_ptr(), b.numel(), stream)
        torch.cuda.synchronize()
        assert status.tolist() == [1, 3]
        assert torch.equal(out_a, a) and torch.equal(out_b, b)
        assert arrivals.item() == 0  # reset by the last block, for the next launch
        native.wait_flag(region, size, flag, 4, 10**6, status.data_ptr(), stream)
        torch.cuda.synchronize()
        assert status.tolist() == [0, 3]
    finally:
        native.free_region(region)


def test_build_refuses_what_it_cannot_do(monkeypatch, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "ibgda.build_native", *args],
                              capture_output=True, text=True, timeout=60)

    # A stand-in nvcc that never compiles: the architecture is refused before any nvcc step,
    # so this part runs on hosts without the CUDA toolkit too.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    result = run("--arch", "hopper")
    assert result.returncode == 1 and "'hopper' is not of the form sm_NN" in result.stderr
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")
    result = run()
    assert result.returncode == 1 and "nvcc not found" in result.stderr


def test_a_cuda_region_of_another_node_is_refused():
    handle = RegionHandle("device", f"cuda-ipc:elsewhere/1234:{'00' * 64}", 4096)
    with pytest.raises(TransportError, match="CUDA IPC only reaches GPUs of one node"):
        create_transport("device").connect(handle)


def _this_node_handle() -> RegionHandle:
    return RegionHandle("device", f"cuda-ipc:{device_cuda.node_id()}:{'00' * 64}", 4096)


def test_a_cuda_region_of_this_node_needs_the_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "ibgda._device_cuda", None)  # as if never built
    with pytest.raises(TransportError, match="run 'python -m ibgda.build_native'"):
        create_transport("device").connect(_this_node_handle())


@pytest.mark.cpu_only
def test_a_cuda_region_of_this_node_needs_a_gpu(native, monkeypatch):
    handle = _this_node_handle()
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
