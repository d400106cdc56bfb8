"""The deployment's child processes: each in a process group of its own, with a log file, stopped
by SIGTERM to its group and SIGKILL after a grace period, until none of its processes is left.
The ``/dev/shm`` files its processes had in use are noted while they run (``note_shm``), for the
deployment to remove once they have ended (``shm.remove_left``).

Its own group keeps a terminal's Ctrl-C (sent to the foreground group) away from the children,
so the deployment stops them in its order; Linux also sends each one SIGTERM if the deployment
dies without stopping them (``die_with_parent``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from sglang_eaas import shm_files as shm
from sglang_eaas.shm_files import alive
from sglang_eaas.launcher.local_servers import die_with_parent


@dataclass
class Child:
    """One part of the deployment: a command, where it listens, its log."""

    name: str  # monitor, expert-server-0, prefill-0, router...
    command: list[str]
    address: str  # what the table shows: HOST:PORT or a URL
    log_path: Path
    process: subprocess.Popen | None = None
    # every process of its tree seen so far (pid, create time): checked gone at stop
    seen: set[tuple[int, float]] = field(default_factory=set)
    # the /dev/shm files its processes had mapped or open when looked at: name -> inode
    shm_files: dict[str, int] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was not started"
        return self.process.pid

    def start(self, env: dict[str, str], again: bool = False) -> None:
        """Start its command; ``again``: a restart, its log appended to."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a" if again else "w") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True, preexec_fn=die_with_parent)
        self.note_tree()

    def exit_code(self) -> int | None:
        """None while its main process runs."""
        return None if self.process is None else self.process.poll()

    def note_tree(self) -> None:
        """Remember every process of its tree now (checked gone at stop)."""
        if self.process is not None:
            shm.note_tree(self.process.pid, self.seen)

    def note_shm(self) -> None:
        """Remember the ``/dev/shm`` files its processes have mapped or open now (SGLang's load
        snapshots and semaphores: names no pid or port gives; ``shm``), and the processes."""
        if self.process is not None:
            shm.note_tree(self.process.pid, self.seen, self.shm_files)

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- stopping ---------------------------------------------------------------------------
    def terminate(self) -> None:
        """SIGTERM to its process group (where the children of its main process are too)."""
        if self.process is not None:
            self.note_shm()  # the tree too
            _signal_group(self.process.pid, signal.SIGTERM)

    def left(self) -> list[int]:
        """Pids of its processes still alive (main process reaped on the way)."""
        if self.process is None:
            return []
        self.process.poll()
        left = {pid for pid, created in self.seen if alive(pid, created)}
        if _group_alive(self.process.pid):  # members it never saw, zombies left out
            left |= {p.pid for p in psutil.process_iter(["status"])
                     if p.info["status"] != psutil.STATUS_ZOMBIE
                     and _pgid(p.pid) == self.process.pid}
        return sorted(left)

    def kill(self) -> None:
        """SIGKILL to its group and to every process of its tree still there."""
        if self.process is None:
            return
        _signal_group(self.process.pid, signal.SIGKILL)
        for pid, created in self.seen:
            if alive(pid, created):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10  # SIGKILL is delivered, not done, when sent
        while self.left() and time.monotonic() < deadline:
            time.sleep(0.05)


def stop_together(children: list[Child], grace: float, hurry=lambda: False) -> list[str]:
    """SIGTERM to every child, wait until none of their processes is left; SIGKILL those still
    there after ``grace`` seconds (at once once ``hurry()``). Returns lines about what had to be
    killed."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurry():
        if not any(child.left() for child in children):
            return []
        time.sleep(0.2)
    notes = []
    for child in children:
        left = child.left()
        if left:
            notes.append(f"{child.name}: processes {left} still there after {grace:.0f}s; "
                         "killed")
            child.kill()
    return notes


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
