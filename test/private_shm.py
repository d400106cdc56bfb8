"""A command with a /dev/shm of its own: run inside a mount namespace (``unshare --mount
--propagation private``), this mounts a fresh tmpfs on /dev/shm, runs the command, passes it
SIGTERM and SIGINT, and when it has ended writes the names of the files left in that /dev/shm,
one per line, to LISTING; it exits with the command's status (128 + N for signal N).

    unshare --mount --propagation private python test/private_shm.py LISTING CMD [ARG...]

test_deploy runs the deploy command so: what it leaves in /dev/shm is then exactly its own
processes' files, and tests on other workers may make and leave theirs meanwhile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def available() -> bool:
    """Whether this host lets a process mount a tmpfs over /dev/shm in a mount namespace of its
    own (root, or CAP_SYS_ADMIN)."""
    try:
        made = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "-t",
                               "tmpfs", "shm", "/dev/shm"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return made.returncode == 0


def main(listing: str, command: list[str]) -> int:
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "shm", "/dev/shm"], check=True)
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: child.send_signal(number))
    code = child.wait()
    with open(listing, "w") as out:
        out.writelines(f"{name}\n" for name in sorted(os.listdir("/dev/shm")))
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
