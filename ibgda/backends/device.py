"""``device``: the client's one-sided ops are kernels (``ibgda.kernels``), not host code.

A dispatch is one ``put_signal`` launch (payload sections, then the flag, release), a wait is one
``wait_flag`` launch (acquire-poll), a read one ``read`` launch: nothing on the host between
them, so a decode step built from them can be captured in a CUDA graph.

Where the memory lives:
  * GPU nodes (``ibgda.backends.device_cuda``, never run: no GPU here): device memory shared
    over CUDA IPC, accessed by the native kernels of ``ibgda/csrc/device``; in a process that
    belongs to an NVSHMEM job (``ibgda.backends.device_nvshmem``, never run), a range of the
    job's symmetric slab that every member reaches, across nodes too.
  * CPU (the twin every test drives): ``TRITON_INTERPRET=1`` runs the Triton kernels of
    ``ibgda.kernels`` (the same algorithm) on ``/dev/shm`` tensors shared across processes.

The owner of a region cannot be woken by a kernel's store, so it polls (like ``mooncake``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Sequence

import torch

from ibgda.backends import device_cuda, device_nvshmem
from ibgda.backends.shm import ShmTransport, map_shm
from ibgda.host_memory import HostMemory
from ibgda.region import (
    LocalRegion, RegionHandle, RemoteRegion, TransportError, Write, as_bytes, check_bounds,
)

WAIT_SPINS = 64  # polls per wait launch; the host relaunches until its timeout
# A lower bound of one interpreted poll: the interpreter has no clock, so a wait launched for
# ``timeout`` seconds polls ``timeout / POLL_SECONDS`` times (it lasts at least ``timeout``).
POLL_SECONDS = 10e-6


def _kernels():
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise TransportError(
            "without a GPU the device transport runs its kernels under the Triton interpreter: "
            "set TRITON_INTERPRET=1 before starting the process")
    try:
        from ibgda import kernels
    except ImportError as exc:
        raise TransportError(f"the device transport needs triton: {exc}") from exc
    _one_interpreted_launch_at_a_time()
    return kernels


_INTERPRETER = threading.RLock()


def _one_interpreted_launch_at_a_time() -> None:
    """The Triton interpreter keeps a launch's state in module globals, so two threads
    interpreting kernels at once break each other ("Did you forget to add @triton.jit?": seen
    when a client's closing thread stored a slot's flag while its stepping thread dispatched).
    Every interpreted launch in this process takes one lock; on a GPU launches from several
    threads are fine and this is never installed."""
    from triton.runtime import interpreter

    cls = interpreter.InterpretedFunction
    if getattr(cls.run, "one_at_a_time", False):
        return
    run = cls.run

    def serial(self, *args, **kwargs):
        with _INTERPRETER:
            return run(self, *args, **kwargs)

    serial.one_at_a_time = True
    cls.run = serial


class DeviceRemoteRegion(RemoteRegion):
    """A peer's region whose every access is a kernel launch."""

    def __init__(self, memory: HostMemory):
        self.kernels = _kernels()
        self.memory, self.handle = memory, memory.handle
        self.bytes = memory.bytes
        self.words = memory.bytes[: memory.handle.size // 4 * 4].view(torch.int32)
        self.arrivals = torch.zeros(1, dtype=torch.int32)  # last-program-arrives counter
        self.status = torch.zeros(2, dtype=torch.int32)  # [reached, last value seen]

    def _flag_word(self, offset: int) -> int:
        check_bounds(self.handle, offset, 4)
        if offset % 4:
            raise ValueError(f"device flags are u32 words: offset {offset} is not 4-aligned")
        return offset // 4

    def put_signal(self, writes: Sequence[Write], flag_offset: int | None, value: int) -> None:
        """One launch: every section, then (unless ``flag_offset`` is None) the flag."""
        k = self.kernels
        if len(writes) > k.MAX_SECTIONS:
            raise ValueError(f"at most {k.MAX_SECTIONS} sections per put_signal")
        sections = []
        for offset, data in writes:
            src = as_bytes(data)
            check_bounds(self.handle, offset, src.numel())
            sections += [src, offset, src.numel()]
        sections += [self.arrivals, 0, 0] * (k.MAX_SECTIONS - len(writes))
        flag_word = 0 if flag_offset is None else self._flag_word(flag_offset)
        longest = max((n for n in sections[2::3]), default=0)
        k.put_signal_kernel[k.grid_for(longest)](
            self.bytes, self.words, self.arrivals, *sections, flag_word, value,
            HAS_FLAG=flag_offset is not None, BLOCK=k.BLOCK)

    def write(self, offset: int, data: torch.Tensor) -> None:
        self.put_signal([(offset, data)], None, 0)

    def store_flag(self, offset: int, value: int) -> None:
        self.put_signal([], offset, value)

    def load_flag(self, offset: int) -> int:
        self.kernels.wait_flag_kernel[(1,)](self.words, self._flag_word(offset), -1,
                                            self.status, 0)
        return int(self.status[1].item())

    def wait_flag(self, offset: int, value: int, timeout: float, bell: int | None = None,
                  spin: float = 0.0) -> bool:
        """The kernel itself spins (``WAIT_SPINS`` polls per launch); ``bell`` and ``spin`` have
        no use here."""
        k, word = self.kernels, self._flag_word(offset)
        deadline = time.monotonic() + timeout
        while True:
            k.wait_flag_kernel[(1,)](self.words, word, value, self.status, WAIT_SPINS)
            if self.status[0].item() or time.monotonic() >= deadline:
                return bool(self.status[0].item())

    def launch_wait_flag(self, offset: int, value: int, status: torch.Tensor,
                         timeout: float) -> None:
        """One wait launch that polls until the flag equals ``value`` or ``timeout`` passed and
        writes ``status`` (int32 ``[reached, last byte seen]``); nothing is read back, so it can
        sit in a captured graph."""
        self.kernels.wait_flag_kernel[(1,)](self.words, self._flag_word(offset), value, status,
                                            max(1, int(timeout / POLL_SECONDS)))

    def read(self, offset: int, out: torch.Tensor) -> None:
        if not out.is_contiguous():
            raise ValueError("read() needs a contiguous output tensor")
        dst = as_bytes(out)
        check_bounds(self.handle, offset, dst.numel())
        k = self.kernels
        k.read_kernel[k.grid_for(dst.numel())](dst, self.bytes, offset, dst.numel(),
                                              BLOCK=k.BLOCK)

    def close(self) -> None:
        del self.bytes, self.words
        self.memory.release()


class DeviceTransport(ShmTransport):
    """Regions live in device memory on GPU nodes, in ``/dev/shm`` (the CPU twin) elsewhere;
    clients use kernels either way."""

    name = "device"
    owner_sleeps_on_futex = False  # a kernel's store cannot wake a futex: the owner polls

    def create_region(self, size: int) -> LocalRegion:
        if torch.cuda.is_available():
            member = device_nvshmem.job()  # in an NVSHMEM job: reachable across nodes
            if member is not None:
                return device_nvshmem.NvshmemLocalRegion(member, size)
            return device_cuda.CudaLocalRegion(size)
        return super().create_region(size)

    def connect(self, handle: RegionHandle) -> RemoteRegion:
        self._check_backend(handle)
        if device_nvshmem.is_nvshmem_handle(handle):
            return device_nvshmem.NvshmemRemoteRegion(handle, device_nvshmem.job())
        if device_cuda.is_cuda_handle(handle):
            return device_cuda.CudaRemoteRegion(handle)
        return DeviceRemoteRegion(map_shm(handle, create=False))
