"""The shared-memory files a process tree (a deployment's part, a test's SGLang) leaves in
``/dev/shm``, found and removed once it has ended.

SGLang 0.5.23 leaves two kinds there when it is stopped, whatever the signal:

- ``sglang_loads_<name>_<hash>.shm``, its load snapshots (``managers/load_snapshot.py``):
  ``shm_path_for(PortArgs.instance_id)``, where ``instance_id`` is ``uuid4().hex[:12]`` drawn by
  each launch (``PortArgs.init_new``) and never logged. The scheduler writes it through an
  ``mmap`` kept open until it exits, the tokenizer manager reads it the same way; no code of
  SGLang unlinks it (only a CI-only sweep, ``utils/stale_shm_cleanup.py``, when
  ``SGLANG_IS_IN_CI`` is set);
- ``sem.mp-<8 random characters>``, the POSIX semaphores of Python's ``multiprocessing`` locks,
  events and queues made in a ``spawn`` context (``SemLock``): named by
  ``tempfile._RandomNameSequence``, mapped by every process using them, unlinked by their
  finalizer or by the ``multiprocessing`` resource tracker when the last process exits; SGLang
  ends its processes with SIGKILL (``kill_process_tree``), the tracker among them, so neither
  runs.

Neither name can be derived from a pid, a port or a log line. What names them is the processes
themselves: while alive, each has them mapped (``/proc/PID/maps``) or open (``/proc/PID/fd``).
``inodes_used_by`` reads that for the processes of a part while they run (once it serves, and
again just before it is stopped); ``remove_left`` removes, after every process of the
deployment has ended, those of them still there under the same name and inode, mapped or open
by no live process (tmpfs gives a new file the inode of a removed one, so the inode alone does
not tell files apart; with SGLang's random names, name and inode together do). Files whose
name carries their creator's pid (this project's ``ibgda-PID-...`` regions, SGLang's
``sgl_shm_KIND_PID_...`` and ``multi_tokenizer_args_PID``) are removed too when that pid was one
of the deployment's processes, none lives with it now and the file is not older than that
process. Nothing else in the folder is touched.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterable

import psutil

SHM_DIR = Path("/dev/shm")
PROC = Path("/proc")
# names carrying their creator's pid: ibgda regions, SGLang's make_shm_name, multi-tokenizer args
_PID_STAMPED = (re.compile(r"ibgda-(\d+)-"), re.compile(r"sgl_shm_.+_(\d+)_[0-9a-f]+$"),
                re.compile(r"multi_tokenizer_args_(\d+)$"))


def inodes_used_by(pid: int, shm_dir: Path = SHM_DIR) -> set[int]:
    """Inodes of the files in ``shm_dir`` that process ``pid`` has mapped or open now ({} if it
    is gone). By inode, not name: glibc's ``sem_open`` maps a temporary file, links it under
    the semaphore's name and unlinks the temporary one, so the mapping reads
    ``/dev/shm/sem.XXXXXX (deleted)`` while ``sem.mp-...`` is the same file."""
    used: set[int] = set()
    prefix = str(shm_dir).rstrip("/") + "/"
    try:
        with open(PROC / str(pid) / "maps", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(prefix):
                    used.add(int(fields[4]))
    except (OSError, ValueError):
        pass
    fds = PROC / str(pid) / "fd"
    try:
        entries = os.listdir(fds)
    except OSError:
        entries = []
    for fd in entries:
        try:
            if os.readlink(fds / fd).startswith(prefix):
                used.add(os.stat(fds / fd).st_ino)  # the open file, even if unlinked
        except OSError:
            continue
    return used


def names_of(inodes: set[int], shm_dir: Path = SHM_DIR) -> dict[str, int]:
    """The files directly in ``shm_dir`` that have one of ``inodes``: name -> inode."""
    if not inodes:
        return {}
    try:
        with os.scandir(shm_dir) as entries:
            return {e.name: e.inode() for e in entries if e.inode() in inodes
                    and e.is_file(follow_symlinks=False)}
    except OSError:
        return {}


def files_in_use(pid: int, shm_dir: Path = SHM_DIR) -> dict[str, int]:
    """The files in ``shm_dir`` that process ``pid`` has mapped or open now: name -> inode."""
    return names_of(inodes_used_by(pid, shm_dir), shm_dir)


def inodes_in_use(shm_dir: Path = SHM_DIR) -> set[int]:
    """Inodes of the files in ``shm_dir`` that any live process has mapped or open. A process
    whose ``/proc`` entries cannot be read (another user's) is not seen; it cannot open this
    user's 0600 files anyway, unless it is root."""
    used: set[int] = set()
    for entry in os.listdir(PROC):
        if entry.isdigit():
            used |= inodes_used_by(int(entry), shm_dir)
    return used


def note_tree(pid: int, seen: set[tuple[int, float]], files: dict[str, int] | None = None,
              shm_dir: Path = SHM_DIR) -> None:
    """Add process ``pid`` and its descendants now to ``seen`` ((pid, create time)); with
    ``files``, also the files in ``shm_dir`` they have mapped or open now (name -> inode): what
    ``remove_left`` takes once the tree has ended."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    inodes: set[int] = set()
    for p in tree:
        try:
            seen.add((p.pid, p.create_time()))
        except psutil.Error:
            continue
        if files is not None:
            inodes |= inodes_used_by(p.pid, shm_dir)
    if files is not None:
        files.update(names_of(inodes, shm_dir))


def alive(pid: int, created: float) -> bool:
    """Whether this very process (not a later one with its pid) is alive and not a zombie."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pid_stamp(name: str) -> int | None:
    """The creator's pid a file's name carries, if it is one of the pid-stamped kinds."""
    for pattern in _PID_STAMPED:
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    return None


def remove_left(files: dict[str, int], processes: Iterable[tuple[int, float]],
                shm_dir: Path = SHM_DIR) -> tuple[list[str], list[str]]:
    """Once every process of the deployment has ended: remove from ``shm_dir`` the ``files``
    its processes had in use (name -> inode, still that inode), and the pid-stamped files of
    its ``processes`` ((pid, create time) pairs), unless a live process has one in use.
    Returns (names removed, sentences about files left: in use, or not removable)."""
    created = {}
    for pid, t in processes:
        created[pid] = min(t, created.get(pid, t))
    candidates: dict[str, int] = {}
    for name, inode in files.items():
        try:
            if os.stat(shm_dir / name).st_ino == inode:
                candidates[name] = inode
        except OSError:
            pass  # gone already, or a different file now: not ours to remove
    try:
        names = os.listdir(shm_dir)
    except OSError:
        names = []
    for name in names:
        pid = pid_stamp(name)
        if pid is None or pid not in created or name in candidates:
            continue
        try:
            st = os.stat(shm_dir / name)
        except OSError:
            continue
        # its creator is one of ours: dead now (not alive under that pid) and the file not
        # made before it by an earlier process that had the same pid
        if not os.path.exists(PROC / str(pid)) and st.st_ctime >= created[pid] - 1:
            candidates[name] = st.st_ino
    if not candidates:
        return [], []
    used = inodes_in_use(shm_dir)
    removed, left = [], []
    for name, inode in sorted(candidates.items()):
        if inode in used:
            left.append(f"{shm_dir / name} is still in use by another process; left there")
            continue
        try:
            os.unlink(shm_dir / name)
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            left.append(f"{shm_dir / name} could not be removed: {exc.strerror}")
    return removed, left
