"""The ``device`` backend across nodes: NVSHMEM (IBGDA when NVSHMEM's transport is ibgda).

NEVER RUN: this project has no GPU. The kernels and bindings it calls compile in CI; the parts
here that need no GPU (the job spec, the slab allocator, handles and refusals) are tested.

NVSHMEM's symmetric heap belongs to a *job* whose members are all known when it starts, which is
what the paper holds against NVSHMEM. This module keeps that constraint to the start of the job
and out of every connection:

* A process opts in with ``IBGDA_NVSHMEM_JOB=RANK/NRANKS@UID_FILE``. When it creates its first
  device region it joins the job (rank 0 writes NVSHMEM's unique id to ``UID_FILE``, on storage
  every member sees; the others wait for the file, so each job needs a fresh path) and makes
  the job's only collective allocation: a symmetric slab of ``IBGDA_NVSHMEM_SLAB_MB`` MiB, the
  same on every member.
* After that nothing is collective. A member carves its regions out of its own slab
  (``SlabAllocator``) and names one ``nvshmem:<job>:<pe>:<offset>``; any member of the job
  reaches it one-sidedly at (its own slab base + offset, pe), since symmetric addresses agree.
  Clients still join servers on demand through the control endpoint; only who *can* be reached
  is fixed per job. A region is reachable by every PE of the job, on this node or another.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from ibgda.backends.device_cuda import (
    DeviceMemoryRegion, DeviceRemoteRegionBase, native, stream_handle,
)
from ibgda.region import RegionHandle, TransportError

JOB_ENV = "IBGDA_NVSHMEM_JOB"
SLAB_ENV = "IBGDA_NVSHMEM_SLAB_MB"
DEFAULT_SLAB_MB = 1024
PREFIX = "nvshmem:"
ALIGN = 256  # bytes: region starts, so every section and flag word stays aligned
UID_WAIT = 120.0  # seconds a member waits for rank 0's unique id file


@dataclass(frozen=True)
class JobSpec:
    """``RANK/NRANKS@UID_FILE``: this process's PE, the job's size, where the unique id goes."""

    rank: int
    nranks: int
    uid_file: Path

    @classmethod
    def parse(cls, text: str) -> "JobSpec":
        ranks, sep, path = text.partition("@")
        rank, slash, nranks = ranks.partition("/")
        if not (sep and slash and path and rank.isdigit() and nranks.isdigit()
                and int(rank) < int(nranks)):
            raise TransportError(f"{JOB_ENV}={text!r} is not RANK/NRANKS@UID_FILE with "
                                 "0 <= RANK < NRANKS (e.g. 0/4@/shared/job1.uid)")
        return cls(int(rank), int(nranks), Path(path))

    @classmethod
    def from_env(cls) -> "JobSpec | None":
        text = os.environ.get(JOB_ENV, "")
        return cls.parse(text) if text else None


def slab_bytes() -> int:
    text = os.environ.get(SLAB_ENV, str(DEFAULT_SLAB_MB))
    if not text.isdigit() or int(text) == 0:
        raise TransportError(f"{SLAB_ENV}={text!r} is not a whole number of MiB >= 1")
    return int(text) << 20


class SlabAllocator:
    """First-fit allocation of ``ALIGN``-aligned ranges in a slab of ``size`` bytes."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted, coalesced
        self._used: dict[int, int] = {}

    def allocate(self, nbytes: int) -> int:
        need = -(-max(nbytes, 1) // ALIGN) * ALIGN
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                self._free[i : i + 1] = [(offset + need, length - need)] if length > need else []
                self._used[offset] = need
                return offset
        raise TransportError(f"the NVSHMEM slab has no {need} free bytes left (of "
                             f"{self.size}); raise {SLAB_ENV} on every member of the job")

    def free(self, offset: int) -> None:
        length = self._used.pop(offset)
        ranges = sorted([*self._free, (offset, length)])
        self._free = []
        for start, size in ranges:
            if self._free and self._free[-1][0] + self._free[-1][1] == start:
                self._free[-1] = (self._free[-1][0], self._free[-1][1] + size)
            else:
                self._free.append((start, size))


class NvshmemJob:
    """This process's membership: its PE, the slab's base address and allocator."""

    def __init__(self, spec: JobSpec):
        lib = native()
        if not getattr(lib, "HAS_NVSHMEM", False):
            raise TransportError(f"{JOB_ENV} is set but ibgda's CUDA module was built without "
                                 "NVSHMEM: rebuild with 'python -m ibgda.build_native "
                                 "--nvshmem on'")
        uid = _exchange_unique_id(spec, lib)
        self.id = hashlib.sha256(uid).hexdigest()[:16]
        self.pe = spec.rank
        lib.nvshmem_join(spec.rank, spec.nranks, uid)
        size = slab_bytes()
        self.base = lib.nvshmem_alloc_region(size)  # the one collective allocation
        self.slab = SlabAllocator(size)


def _exchange_unique_id(spec: JobSpec, lib) -> bytes:
    """Rank 0 writes the unique id (atomically, by rename); the others wait for it."""
    if spec.rank == 0:
        temporary = spec.uid_file.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(lib.nvshmem_unique_id())
        temporary.replace(spec.uid_file)
    deadline = time.monotonic() + UID_WAIT
    while not spec.uid_file.exists():
        if time.monotonic() > deadline:
            raise TransportError(f"no NVSHMEM unique id at {spec.uid_file} after {UID_WAIT:.0f}s:"
                                 " is rank 0 of the job up, and the path shared?")
        time.sleep(0.1)
    return spec.uid_file.read_bytes()


@cache
def job() -> NvshmemJob | None:
    """The job this process belongs to (joined on first use), or None without ``JOB_ENV``."""
    spec = JobSpec.from_env()
    return None if spec is None else NvshmemJob(spec)


def is_nvshmem_handle(handle: RegionHandle) -> bool:
    return handle.name.startswith(PREFIX)


def parse_handle(handle: RegionHandle) -> tuple[str, int, int]:
    """``nvshmem:<job>:<pe>:<offset>`` -> (job, pe, offset)."""
    parts = handle.name.removeprefix(PREFIX).split(":")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise TransportError(f"malformed NVSHMEM region name {handle.name!r}")
    return parts[0], int(parts[1]), int(parts[2])


class NvshmemLocalRegion(DeviceMemoryRegion):
    """A range of this member's slab; every PE of the job can reach it."""

    def __init__(self, member: NvshmemJob, size: int):
        self._job, self._offset = member, member.slab.allocate(size)
        name = f"{PREFIX}{member.id}:{member.pe}:{self._offset}"
        super().__init__(member.base + self._offset, RegionHandle("device", name, size))

    def close(self) -> None:
        if self.address:
            torch.cuda.current_stream().synchronize()
            del self.bytes
            self._job.slab.free(self._offset)
            self.address = 0


class NvshmemRemoteRegion(DeviceRemoteRegionBase):
    """A region of another member of this process's job, reached with NVSHMEM kernels."""

    def __init__(self, handle: RegionHandle, member: NvshmemJob | None):
        job_id, pe, offset = parse_handle(handle)
        if member is None or member.id != job_id:
            here = "no NVSHMEM job" if member is None else f"job {member.id}"
            raise TransportError(f"region {handle.name} belongs to NVSHMEM job {job_id}, and "
                                 f"this process is in {here}: start both ends with the same "
                                 f"{JOB_ENV} unique id file")
        if offset + handle.size > member.slab.size:
            raise TransportError(f"region {handle.name} ends past this member's slab: every "
                                 f"member of a job needs the same {SLAB_ENV}")
        self._native, self.pe = native(), pe
        super().__init__(handle, member.base + offset)  # symmetric: the same offset everywhere

    def _launch_put(self, sections, flag_offset, value):
        self._native.nvshmem_put_signal(self.address, self.handle.size, sections, flag_offset,
                                        value, self.pe, stream_handle())

    def _launch_wait(self, offset, value, timeout_ns, status):
        self._native.nvshmem_wait_flag(self.address, self.handle.size, offset, value,
                                       timeout_ns, status, self.pe, stream_handle())

    def _launch_read(self, offset, out, nbytes):
        self._native.nvshmem_read(self.address, self.handle.size, offset, out, nbytes, self.pe,
                                  stream_handle())

    def close(self) -> None:
        self.address = 0  # the slab stays: it is the job's
