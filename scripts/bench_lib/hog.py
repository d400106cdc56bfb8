"""``Hog``: a neighbour's job on the same cores (busy processes, by default twice the cores) and,
optionally, memory pressure (one process holding and touching that many GB) and a disk writer
(one process writing and fsyncing a file, as a neighbour's checkpoint or log does), for as long
as a ``with`` block lasts. Used by ``bench_faults.py --hog`` and the tests that must pass on a
busy host (test_suspicion.py, test_deploy.py)."""

from __future__ import annotations

import multiprocessing
import os
import tempfile

WRITE_BLOCK = 1 << 20  # bytes written between two fsyncs
WRITE_SPAN = 256 << 20  # the file is rewritten from its start after this many bytes


def _spin() -> None:
    while True:
        pass


def _hold(gigabytes: float) -> None:
    block = bytearray(int(gigabytes * 2**30))
    while True:  # touch every page, again and again: resident, and competing for memory
        for i in range(0, len(block), 4096):
            block[i] = (block[i] + 1) % 256


def _write(directory: str) -> None:
    block = os.urandom(WRITE_BLOCK)
    with tempfile.TemporaryFile(dir=directory) as f:
        while True:  # 1 MB, fsync, again: the page cache and the disk always busy
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
            if f.tell() >= WRITE_SPAN:
                f.seek(0)


class Hog:
    def __init__(self, busy: int | None = None, gigabytes: float = 0.0,
                 write_to: str | None = None):
        """``busy`` spinning processes (None: twice the cores); with ``gigabytes`` one more
        holding that much memory; with ``write_to`` (a directory on the disk under test) one
        more writing and fsyncing a file there."""
        context = multiprocessing.get_context("spawn")
        busy = 2 * (os.cpu_count() or 1) if busy is None else busy
        self.processes = [context.Process(target=_spin, daemon=True) for _ in range(busy)]
        if gigabytes:
            self.processes.append(context.Process(target=_hold, args=(gigabytes,), daemon=True))
        if write_to:
            self.processes.append(context.Process(target=_write, args=(write_to,), daemon=True))

    def __enter__(self) -> "Hog":
        for p in self.processes:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self.processes:
            p.kill()
            p.join(10)
