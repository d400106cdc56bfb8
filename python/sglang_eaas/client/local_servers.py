"""``--eaas-expert-servers local:N``: expert servers as child processes of the SGLang launcher."""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from sglang_eaas.tools.server_process import free_port
from sglang_eaas.transport import TransportError

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_local_servers(model_path: str | Path, placements: list[list[int]], dtype: str,
                        max_clients: int, startup_timeout: float = 180.0) -> list[str]:
    """Start one expert server per placement entry; return their addresses once all answer.

    The servers share the launcher's stdout/stderr (so their lines land in the server log) and
    receive SIGTERM when the launcher dies, however it dies.
    """
    procs, addresses = [], []
    for experts in placements:
        address = f"127.0.0.1:{free_port()}"
        command = [sys.executable, "-m", "sglang_eaas.expert_server", "--model-path",
                   str(model_path), "--experts", ",".join(map(str, experts)), "--listen", address,
                   "--dtype", dtype, "--max-clients", str(max_clients)]
        procs.append(subprocess.Popen(command, preexec_fn=_die_with_parent))
        addresses.append(address)
    deadline = time.monotonic() + startup_timeout
    for proc, address in zip(procs, addresses):
        while not _accepts(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                for p in procs:
                    p.terminate()
                why = (f"exited with code {proc.returncode}" if proc.poll() is not None
                       else f"did not answer within {startup_timeout:.0f}s")
                raise TransportError(f"local expert server {address} {why}; see its output above")
            time.sleep(0.2)
    return addresses


def _accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False
