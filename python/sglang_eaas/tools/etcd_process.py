"""A single-node etcd on loopback, for the tests and benchmarks of the etcd monitor backend.

Debian's ``etcd-server`` (installed by scripts/setup.sh). Started with a 50 ms raft heartbeat
and a 250 ms election timeout, so that etcd grants 1 s leases (its minimum lease TTL is 3/2 of
the election timeout, rounded up to whole seconds).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from sglang_eaas.addresses import free_port
from sglang_eaas.membership.etcd import single_node_command


class EtcdProcess:
    """``host``: the address etcd listens on (default loopback; another host's clients need one
    they can reach)."""

    def __init__(self, log_path: str | Path | None = None, host: str = "127.0.0.1"):
        binary = shutil.which("etcd")
        if binary is None:
            raise FileNotFoundError("etcd is not installed: run scripts/setup.sh (Debian's "
                                    "etcd-server)")
        self._dir = tempfile.mkdtemp(prefix="eaas-etcd-")
        client, peer = free_port(), free_port()
        self.address = f"{host}:{client}"
        self.url = f"etcd://{self.address}"
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            single_node_command(binary, self._dir, host, client, peer),
            stdout=log, stderr=subprocess.STDOUT)

    def start(self, timeout: float = 30.0) -> "EtcdProcess":
        from etcd3gw.client import Etcd3Client

        client = Etcd3Client(*self.address.split(":"), timeout=2)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.status()
                client.post(client.get_url("/lease/grant"), json={"TTL": 1, "ID": 0})
                return self
            except Exception:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"etcd on {self.address} did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "EtcdProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
