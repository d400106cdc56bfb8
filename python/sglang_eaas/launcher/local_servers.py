"""``--eaas-expert-servers local:N``: expert servers as child processes of the SGLang launcher."""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from typing import Mapping

from ibgda import TransportError
from sglang_eaas.addresses import parse_address
from sglang_eaas.placement import PlacedExperts

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, however the parent dies (in
    fact when the parent's thread that forked it ends: fork from a thread that lives as long
    as the process, as ``LocalLauncher`` does)."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class LocalServer:
    address: str
    process: subprocess.Popen

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def expert_args(experts: PlacedExperts) -> list[str]:
    """The expert server's flags for a placement entry: ``--experts`` for a list (the same
    experts in every layer), one ``--layer-experts LAYER=IDS`` per layer for a map of layers
    (a layer it does not name: none there)."""
    if not isinstance(experts, Mapping):
        return ["--experts", ",".join(map(str, experts))]
    return [arg for layer, ids in sorted(experts.items())
            for arg in ("--layer-experts", f"{layer}={','.join(map(str, ids)) or 'none'}")]


def start_local_servers(model_path: str | Path, placements: list[PlacedExperts], dtype: str,
                        max_clients: int, extra_args: tuple[str, ...] = (),
                        startup_timeout: float = 180.0, stdout=None,
                        avoid_ports: frozenset[int] = frozenset(),
                        host: str = "127.0.0.1") -> list[LocalServer]:
    """Start one expert server per placement entry; return them once all serve.

    Each binds a port of its own choosing (``--listen HOST:0``) and writes it to a ready file
    once serving (``--ready-file``): a port picked here and handed over would be free only
    until another process on the host took it first (two launchers starting together did).
    One that took a port of ``avoid_ports`` (taken though not bound yet: SGLang's own) is
    stopped and started again. The servers write to ``stdout`` (default: the caller's, so
    their lines land in the SGLang server log) and receive SIGTERM when the process that
    started them dies, however it dies. ``host``: the address they listen on (a loopback one
    gets ``shm`` slots, another ``mooncake``).
    """
    with tempfile.TemporaryDirectory(prefix="eaas-ready-") as ready:
        def spawn(index: int, experts: PlacedExperts) -> tuple[Path, subprocess.Popen]:
            ready_file = Path(ready) / f"{index}-{time.monotonic_ns()}"
            command = [sys.executable, "-m", "sglang_eaas.expert_server", "--model-path",
                       str(model_path), *expert_args(experts), "--listen", f"{host}:0",
                       "--ready-file", str(ready_file), "--dtype", dtype, "--max-clients",
                       str(max_clients), *extra_args]
            return ready_file, subprocess.Popen(
                command, preexec_fn=die_with_parent, stdout=stdout,
                stderr=subprocess.STDOUT if stdout else None)

        starting = [spawn(i, experts) for i, experts in enumerate(placements)]
        servers: list[LocalServer | None] = [None] * len(placements)
        deadline = time.monotonic() + startup_timeout
        try:
            while None in servers:
                for index, (ready_file, process) in enumerate(starting):
                    if servers[index] is not None:
                        continue
                    if ready_file.exists():
                        server = LocalServer(ready_file.read_text().strip(), process)
                        if parse_address(server.address).port in avoid_ports:
                            server.stop()  # it took SGLang's port: again, elsewhere
                            starting[index] = spawn(index, placements[index])
                        else:
                            servers[index] = server
                    elif process.poll() is not None:
                        raise TransportError(f"a local expert server (experts "
                                             f"{placements[index]}) exited with code "
                                             f"{process.returncode}; see its output above")
                if None in servers:
                    if time.monotonic() > deadline:
                        raise TransportError(f"local expert servers did not start within "
                                             f"{startup_timeout:.0f}s; see their output above")
                    time.sleep(0.1)
        except BaseException:
            for _, process in starting:
                LocalServer("", process).stop()
            raise
    return servers


class LocalLauncher:
    """Standby expert servers as child processes of this process: the default
    ``elastic.resize.ServerLauncher`` (docs/elastic.md, "Launchers")."""

    def __init__(self, model_path: str | Path, monitor: str, dtype: str, max_clients: int,
                 extra_args: tuple[str, ...] = (), stdout=None):
        self.model_path, self.monitor, self.dtype = model_path, monitor, dtype
        self.max_clients, self.extra_args, self.stdout = max_clients, extra_args, stdout
        self.started: dict[str, LocalServer] = {}
        # Linux sends PR_SET_PDEATHSIG when the *thread* that forked the child ends: a resize
        # runs on a thread of its own, so the servers are forked from this one, which lives
        # as long as the process
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="eaas-spawn")

    def start(self, count: int) -> list[str]:
        made = self._spawner.submit(
            start_local_servers, self.model_path, [{}] * count, self.dtype, self.max_clients,
            ("--standby", "--monitor", self.monitor, *self.extra_args),
            stdout=self.stdout).result()
        self.started.update({s.address: s for s in made})
        return [s.address for s in made]

    def exited(self, addresses: list[str]) -> bool:
        """Whether one of the servers at ``addresses`` that this launcher started has exited
        (it will not register: the resize starts its batch again)."""
        return any(self.started[a].process.poll() is not None for a in addresses
                   if a in self.started)

    def stop(self, address: str) -> None:
        server = self.started.pop(address, None)
        if server is not None:
            server.stop(timeout=60.0)  # it exits by itself once drained

    def close(self) -> None:
        for address in list(self.started):
            self.stop(address)
