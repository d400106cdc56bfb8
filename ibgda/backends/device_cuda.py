"""The ``device`` backend on a GPU node: regions are device memory shared over CUDA IPC, and the
client's one-sided ops are the native kernels of ``ibgda._device_cuda`` (``ibgda/csrc/device``,
built by ``python -m ibgda.build_native``).

NEVER RUN: this project has no GPU. The kernels and bindings compile in CI and the module is
loaded there; this file is only exercised up to the point where it needs a GPU (docs/ibgda.md).

A handle's name is ``cuda-ipc:<node>:<IPC handle, hex>``; CUDA IPC only reaches GPUs of the same
node, so a handle from another node is refused (across nodes use ``mooncake``).
"""

from __future__ import annotations

import abc
import socket
from functools import cache
from pathlib import Path
from typing import Sequence

import torch

from ibgda.region import (
    LocalRegion, RegionHandle, RemoteRegion, TransportError, Write, as_bytes, check_bounds,
)

PREFIX = "cuda-ipc:"
NO_FLAG = -1


@cache
def node_id() -> str:
    """This machine: its host name and boot id (two containers may share a host name)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def is_cuda_handle(handle: RegionHandle) -> bool:
    return handle.name.startswith(PREFIX)


def native():
    """``ibgda._device_cuda``, or a TransportError saying how to build it."""
    try:
        from ibgda import _device_cuda
    except ImportError as exc:
        raise TransportError(f"the device transport's CUDA side is not built ({exc}): run "
                             "'python -m ibgda.build_native'") from exc
    return _device_cuda


def stream_handle() -> int:
    """The current CUDA stream, as the native module takes it."""
    return torch.cuda.current_stream().cuda_stream


def _wrap(address: int, size: int) -> torch.Tensor:
    """A ``uint8 [size]`` CUDA tensor aliasing ``address`` (not owning it)."""

    class _Memory:
        __cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                    "data": (address, False), "version": 3}

    return torch.as_tensor(_Memory(), device="cuda")


class DeviceMemoryRegion(LocalRegion):
    """The owner's side of device memory at ``address``: peers write into it, the owner polls
    it (kernels cannot wake a host thread). Subclasses allocate, name and free it."""

    def __init__(self, address: int, handle: RegionHandle):
        self.address, self.handle = address, handle
        self.bytes = _wrap(address, handle.size)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        check_bounds(self.handle, offset, nbytes)
        return self.bytes[offset : offset + nbytes]

    def _word(self, offset: int) -> torch.Tensor:
        check_bounds(self.handle, offset, 4)
        return self.bytes[offset : offset + 4].view(torch.int32)

    def load_flag(self, offset: int) -> int:
        # A device-to-host copy: it waits for this stream's earlier kernels, then reads.
        return int(self.view(offset, 1).item())

    def store_flag(self, offset: int, value: int) -> None:
        self.view(offset, 1).fill_(value)  # ordered after this stream's result kernels

    def load_word(self, offset: int) -> int:
        return int(self._word(offset).item())

    def notify(self, offset: int) -> None:
        self._word(offset).add_(1)


class CudaLocalRegion(DeviceMemoryRegion):
    """``cudaMalloc``'d memory exported to peers of this node over CUDA IPC."""

    def __init__(self, size: int):
        self._native = native()
        address = self._native.alloc_region(size)
        ipc = self._native.export_region(address).hex()
        super().__init__(address, RegionHandle("device", f"{PREFIX}{node_id()}:{ipc}", size))

    def close(self) -> None:
        if self.address:
            torch.cuda.current_stream().synchronize()
            del self.bytes
            self._native.free_region(self.address)
            self.address = 0


class DeviceRemoteRegionBase(RemoteRegion):
    """A peer's device region reached by native kernels, one launch per access. Subclasses
    open it (``address``) and say how the three kernels reach it."""

    def __init__(self, handle: RegionHandle, address: int):
        self.handle, self.address = handle, address
        self.arrivals = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.status = torch.zeros(2, dtype=torch.int32, device="cuda")

    @abc.abstractmethod
    def _launch_put(self, sections: list[tuple[int, int, int]], flag_offset: int,
                    value: int) -> None: ...

    @abc.abstractmethod
    def _launch_wait(self, offset: int, value: int, timeout_ns: int, status: int) -> None: ...

    @abc.abstractmethod
    def _launch_read(self, offset: int, out: int, nbytes: int) -> None: ...

    def put_signal(self, writes: Sequence[Write], flag_offset: int | None, value: int) -> None:
        """One launch: every section, then (unless ``flag_offset`` is None) the flag."""
        sections, keep = [], []  # keep: no section's memory is reused before the launch
        for offset, data in writes:
            src = as_bytes(data).to("cuda")  # host data (a header) is copied on this stream
            check_bounds(self.handle, offset, src.numel())
            sections.append((src.data_ptr(), offset, src.numel()))
            keep.append(src)
        if flag_offset is not None:
            check_bounds(self.handle, flag_offset, 4)
        self._launch_put(sections, NO_FLAG if flag_offset is None else flag_offset, value)

    def write(self, offset: int, data: torch.Tensor) -> None:
        self.put_signal([(offset, data)], None, 0)

    def store_flag(self, offset: int, value: int) -> None:
        self.put_signal([], offset, value)

    def load_flag(self, offset: int) -> int:
        self._wait(offset, 0x100, 0)  # a byte never equals 0x100: one acquire-load
        return int(self.status[1].item())

    def _wait(self, offset: int, value: int, timeout: float) -> bool:
        self.launch_wait_flag(offset, value, self.status, timeout)
        return bool(self.status[0].item())  # synchronizes with the wait kernel

    def launch_wait_flag(self, offset: int, value: int, status: torch.Tensor,
                         timeout: float) -> None:
        """Enqueue one wait kernel (acquire-poll up to ``timeout``) that writes ``status``
        (device int32 ``[reached, last byte seen]``); nothing is read back to the host."""
        check_bounds(self.handle, offset, 4)
        self._launch_wait(offset, value, int(timeout * 1e9), status.data_ptr())

    def wait_flag(self, offset: int, value: int, timeout: float, bell: int | None = None,
                  spin: float = 0.0) -> bool:
        """The kernel spins until ``timeout``; ``bell`` and ``spin`` have no use here."""
        return self._wait(offset, value, timeout)

    def read(self, offset: int, out: torch.Tensor) -> None:
        if not out.is_contiguous():
            raise ValueError("read() needs a contiguous output tensor")
        dst = as_bytes(out) if out.is_cuda else torch.empty(out.numel() * out.element_size(),
                                                            dtype=torch.uint8, device="cuda")
        check_bounds(self.handle, offset, dst.numel())
        self._launch_read(offset, dst.data_ptr(), dst.numel())
        if not out.is_cuda:
            as_bytes(out).copy_(dst)


class CudaRemoteRegion(DeviceRemoteRegionBase):
    """A same-node peer's device region, mapped here over CUDA IPC."""

    def __init__(self, handle: RegionHandle):
        node, _, ipc = handle.name.removeprefix(PREFIX).rpartition(":")
        if node != node_id():
            raise TransportError(f"region {handle.name[:60]}... lives on node {node!r}, not "
                                 f"here ({node_id()!r}): CUDA IPC only reaches GPUs of one "
                                 "node; across nodes use --eaas-transport mooncake, or put "
                                 "both ends in one NVSHMEM job (IBGDA_NVSHMEM_JOB)")
        self._native = native()
        super().__init__(handle, self._native.open_region(bytes.fromhex(ipc)))

    def _launch_put(self, sections, flag_offset, value):
        self._native.put_signal(self.address, self.handle.size, sections, flag_offset, value,
                                self.arrivals.data_ptr(), stream_handle())

    def _launch_wait(self, offset, value, timeout_ns, status):
        self._native.wait_flag(self.address, self.handle.size, offset, value, timeout_ns,
                               status, stream_handle())

    def _launch_read(self, offset, out, nbytes):
        self._native.read(self.address, self.handle.size, offset, out, nbytes,
                          stream_handle())

    def close(self) -> None:
        if self.address:
            torch.cuda.current_stream().synchronize()
            self._native.close_region(self.address)
            self.address = 0
