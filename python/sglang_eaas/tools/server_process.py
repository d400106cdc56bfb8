"""Run ``python -m sglang.launch_server`` as a child process and talk to it over HTTP.

Used by the demo, the tests and the benchmarks: start on a free loopback port, wait until
``/health_generate`` answers, send requests, stop the whole process group cleanly, and remove
the files its processes left in ``/dev/shm`` (SGLang leaves some at every stop; ``shm_files``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from sglang_eaas.addresses import free_port
from sglang_eaas import shm_files as shm
from sglang_eaas.shm_files import alive


# What the CPU tests and the demo pass on top of the user's arguments. The CPU runtime supplies
# torch_native attention, sleep-on-idle and the KV pools' size by itself (docs/cpu-runtime.md);
# --max-total-tokens 4096 keeps a test server's pool small where the runtime would give its ranks
# up to half the host's available memory (GiBs, zero-filled: seconds of start-up).
CPU_DEVICE_ARGS = ("--device", "cpu")
CPU_ARGS = (*CPU_DEVICE_ARGS, "--max-total-tokens", "4096")
PORT_ATTEMPTS = 3


class ServerError(RuntimeError):
    """The server process exited or did not become ready; the message ends with its log tail."""


class SGLangServer:
    """One SGLang HTTP server child process; use as a context manager."""

    def __init__(
        self,
        model_path: str | Path,
        *args: str,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        startup_timeout: float = 300.0,
    ):
        self.model_path, self.args = str(model_path), args
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self._seen: set[tuple[int, float]] = set()  # its processes: (pid, create time)
        self._shm_files: dict[str, int] = {}  # what they had in /dev/shm: name -> inode
        self._pick_port()

    def _pick_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
            "--host", "127.0.0.1", "--port", str(self.port), *self.args,
        ]

    def start(self) -> "SGLangServer":
        """Start and wait until ``/health_generate`` answers. A port free when chosen may be
        taken before SGLang binds it (minutes later, once the model is loaded: another process
        starting at the same time may get it), and SGLang then hangs instead of exiting: the
        start is retried on another port."""
        for attempt in range(PORT_ATTEMPTS):
            if attempt:
                self._pick_port()
            if self._start_once():
                return self
        raise ServerError(f"no free port after {PORT_ATTEMPTS} attempts\n{self.log_tail()}")

    def _start_once(self) -> bool:
        """True once ready; False if the port was taken meanwhile (the process is stopped)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"server exited with code {self.process.returncode}\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health_generate", timeout=5).status_code == 200:
                    shm.note_tree(self.process.pid, self._seen, self._shm_files)
                    return True
            except requests.RequestException:
                pass
            if f"{self.port}): address already in use" in self.log_tail():
                self.stop()
                return False
            time.sleep(1.0)
        self.stop()
        raise ServerError(f"server not ready after {self.startup_timeout:.0f}s\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def generate(self, prompt: str | list[int], max_new_tokens: int = 16,
                 adapter: str | None = None) -> dict[str, Any]:
        """Greedy ``/generate``; ``prompt`` is text or token ids; ``adapter``: SGLang's
        ``lora_path`` (a LoRA or ESFT adapter's name)."""
        key = "text" if isinstance(prompt, str) else "input_ids"
        body = {
            key: prompt,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True},
            **({"lora_path": adapter} if adapter is not None else {}),
        }
        return self._post("/generate", body)

    def chat(self, content: str, max_tokens: int = 16) -> dict[str, Any]:
        """Greedy ``/v1/chat/completions`` with one user message."""
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        return self._post("/v1/chat/completions", body)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = requests.post(f"{self.url}{path}", json=body, timeout=300)
        response.raise_for_status()
        return response.json()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``timeout``; then remove the ``/dev/shm``
        files its processes had in use that they left. Returns the exit code."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        shm.note_tree(self.process.pid, self._seen, self._shm_files)
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        self._remove_left()
        return code

    def _remove_left(self) -> None:
        """Once its group has ended (SGLang kills its own children; a moment for them to go),
        the /dev/shm files they left."""
        deadline = time.monotonic() + 10
        while any(alive(pid, created) for pid, created in self._seen):
            if time.monotonic() > deadline:
                return  # still running: their files may be in use; left for whoever ends them
            time.sleep(0.1)
        shm.remove_left(self._shm_files, self._seen)

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

