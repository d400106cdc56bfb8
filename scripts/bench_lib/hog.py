"""``Hog``: a neighbour's job on the same cores (busy processes, by default twice the cores) and,
optionally, memory pressure (one process holding and touching that many GB), for as long as a
``with`` block lasts. Used by ``bench_faults.py --hog`` and the tests that must pass on a busy
host (test_suspicion.py, test_deploy.py)."""

from __future__ import annotations

import multiprocessing
import os


def _spin() -> None:
    while True:
        pass


def _hold(gigabytes: float) -> None:
    block = bytearray(int(gigabytes * 2**30))
    while True:  # touch every page, again and again: resident, and competing for memory
        for i in range(0, len(block), 4096):
            block[i] = (block[i] + 1) % 256


class Hog:
    def __init__(self, busy: int | None = None, gigabytes: float = 0.0):
        """``busy`` spinning processes (None: twice the cores), and with ``gigabytes`` one more
        holding that much memory."""
        context = multiprocessing.get_context("spawn")
        busy = 2 * (os.cpu_count() or 1) if busy is None else busy
        self.processes = [context.Process(target=_spin, daemon=True) for _ in range(busy)]
        if gigabytes:
            self.processes.append(context.Process(target=_hold, args=(gigabytes,), daemon=True))

    def __enter__(self) -> "Hog":
        for p in self.processes:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for p in self.processes:
            p.kill()
            p.join(10)
