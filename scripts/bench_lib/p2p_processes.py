"""bench_p2p's process harness: every client and server runs in its own spawned process and
reports its values (or its traceback) to the parent on one queue."""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from typing import Any, Callable

import torch
from sglang_eaas.launcher.local_servers import die_with_parent


@dataclass(frozen=True)
class Link:
    """A worker's line to the parent: report values, print progress, see the stop request."""

    name: str
    results: Any  # multiprocessing Queue of (name, kind, value)
    stop: Event

    def report(self, value: Any) -> None:
        self.results.put((self.name, "value", value))

    def say(self, message: str) -> None:
        # One write per line, so that concurrent workers' lines do not interleave.
        sys.stdout.write(f"bench_p2p: [{self.name}] {message}\n")
        sys.stdout.flush()


def exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(0)  # unwinds through the finally blocks: workers stopped, shm regions closed


def _worker(link: Link, threads: int, target: Callable[..., Any], args: tuple) -> None:
    """Process entry point: run ``target(link, *args)`` and report its result or traceback."""
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    die_with_parent()  # even if the parent is SIGKILLed, no server outlives it
    torch.set_num_threads(threads)
    try:
        value = target(link, *args)
        if value is not None:
            link.report(value)
    except Exception:
        link.results.put((link.name, "error", traceback.format_exc()))


class Processes:
    """Spawned workers reporting on one queue; leaving the block stops, then kills them all."""

    def __init__(self, threads: int):
        self.ctx = mp.get_context("spawn")
        self.threads = threads
        self.results = self.ctx.Queue()
        self.stop = self.ctx.Event()
        self.procs: dict[str, BaseProcess] = {}
        self.pending: dict[str, list[Any]] = {}

    def __enter__(self) -> "Processes":
        return self

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> None:
        link = Link(name, self.results, self.stop)
        proc = self.ctx.Process(target=_worker, args=(link, self.threads, target, args),
                                name=name, daemon=True)
        proc.start()
        self.procs[name], self.pending[name] = proc, []

    def get(self, name: str) -> Any:
        """The next value ``name`` reports; raises as soon as any worker fails or crashes."""
        while not self.pending[name]:
            try:
                sender, kind, value = self.results.get(timeout=1.0)
            except queue.Empty:
                self._check_exits(name)
                continue
            if kind == "error":
                raise RuntimeError(f"{sender} failed:\n{value}")
            self.pending[sender].append(value)
        return self.pending[name].pop(0)

    def _check_exits(self, name: str) -> None:
        """Raise if a worker crashed, or ``name`` exited without a report left in the queue."""
        for other, proc in self.procs.items():
            if proc.exitcode not in (None, 0):
                raise RuntimeError(f"{other} died with exit code {proc.exitcode}")
        if self.procs[name].exitcode == 0 and self.results.empty():
            raise RuntimeError(f"{name} exited without reporting")

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        deadline = time.monotonic() + 3.0
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.results.close()
