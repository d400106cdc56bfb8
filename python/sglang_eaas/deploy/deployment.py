"""``Deployment``: start a whole local deployment in order, watch it, stop it in reverse order.

Start: the monitor (standalone or etcd) -> the expert servers (until each is registered and
every expert of every MoE layer has a live holder) -> the SGLang instances, side by side (until
each answers ``/health_generate``) -> the router (until ``/health`` answers and a real
``/generate`` through it returns tokens). Stop, at ``stop()``, on leaving the ``with`` block and
on any failure while starting: router -> SGLang instances -> expert servers -> monitor, each
stage SIGTERMed as process groups and SIGKILLed after a grace period, until none of their
processes is left; then the ``/dev/shm`` files its processes had in use and left behind
(SGLang's load snapshots and ``multiprocessing`` semaphores, ``shm_files``) are removed. Before
anything starts, every port the config fixes is checked free (``ports``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.controller.end_state import read_end_state
from sglang_eaas import shm_files as shm
from sglang_eaas.deploy import parts, ports, ready
from sglang_eaas.deploy.config import ETCD, DeployConfig
from sglang_eaas.deploy.processes import Child, stop_together
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.operations import DONE, FAILED, RESTART

REPORT_EVERY = 15.0  # seconds between progress lines while waiting
MAX_RESTARTS = 3  # an expert server that exits while serving is started again this many times


class DeployError(RuntimeError):
    """A part did not start or stopped serving; the message says which and where its log is."""


class Interrupted(DeployError):
    """``interrupt()`` (a signal) came while starting."""


@dataclass(frozen=True)
class Endpoint:
    """One running part, as the table shows it."""

    name: str
    address: str
    pid: int
    log: Path


class Deployment:
    """One local deployment of ``config``; ``start()`` returns once it serves at ``url``."""

    def __init__(self, config: DeployConfig, log_dir: str | Path | None = None,
                 progress: Callable[[str], None] = lambda line: None,
                 timeout: float = 600.0, stop_grace: float = 30.0,
                 failure: Callable[[str], None] = lambda message: None):
        self.config = config
        stem = Path(config.source).stem if config.source != "<config>" else "deploy"
        self.log_dir = Path(log_dir or Path(".cache/logs/deploy")
                            / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        self.progress, self.timeout, self.stop_grace = progress, timeout, stop_grace
        self.failure = failure  # told why a start failed, before the parts started are stopped
        self.token = envs.TOKEN.get() or secrets.token_hex(16)
        self.env = {**os.environ, envs.TOKEN.name: self.token}  # never on a command line
        self.stages: list[list[Child]] = []  # in start order
        self.expert_servers: list[Child] = []
        self.restarts: dict[str, int] = {}  # expert server -> times started again
        self._restarting: dict = {}  # expert server -> its restart operation (controller.Held)
        self._waiting: dict[str, str] = {}  # expert server -> why its restart waits (said)
        self.url: str | None = None  # the router's, once serving
        self.monitor_url: str | None = None
        self._etcd_dir: str | None = None
        # plain flags, not threading.Event: a signal handler sets them, and Event.set() from a
        # handler can deadlock with the main thread inside Event.wait()
        self._interrupted = self._hurry = False
        self._stopped, self._stop_notes = False, []

    # -- the API ------------------------------------------------------------------------------
    def start(self) -> "Deployment":
        try:
            self._start()
        except BaseException as exc:
            if isinstance(exc, DeployError) and not isinstance(exc, Interrupted):
                self.failure(str(exc))
            self.stop()
            raise
        return self

    def stop(self) -> list[str]:
        """Stop every part started, in reverse order; lines about parts that had to be killed
        or left processes (none, normally). Idempotent."""
        if self._stopped:
            return self._stop_notes
        self._stopped = True
        for name, held in self._restarting.items():  # before the monitor goes
            held.finish(FAILED, f"{name}: the deployment stopped before it was back")
        self._restarting.clear()
        notes = self._stop_notes
        for stage in reversed(self.stages):
            started = [c for c in stage if c.process is not None]
            if not started:
                continue
            names = ", ".join(c.name for c in started)
            t0 = time.monotonic()
            self.progress(f"deploy: stopping {names}")
            notes += stop_together(started, self.stop_grace, lambda: self._hurry)
            self.progress(f"deploy: stopped {names} ({time.monotonic() - t0:.1f}s)")
        left = [f"{c.name}: {c.left()}" for stage in self.stages for c in stage if c.left()]
        if left:
            notes.append("processes still there after SIGKILL: " + "; ".join(left))
        children = [c for stage in self.stages for c in stage]
        removed, kept = shm.remove_left(
            {name: inode for c in children for name, inode in c.shm_files.items()},
            {p for c in children for p in c.seen})
        if removed:
            self.progress(f"deploy: removed {len(removed)} files the parts left in "
                          f"{shm.SHM_DIR} ({', '.join(removed)})")
        notes += kept
        if self._etcd_dir:
            shutil.rmtree(self._etcd_dir, ignore_errors=True)
        return notes

    def interrupt(self) -> None:
        """Make a running ``start()`` stop what it started and raise ``Interrupted``
        (safe from a signal handler)."""
        self._interrupted = True

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    def wait_interrupt(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``interrupt()``; whether it came."""
        deadline = time.monotonic() + timeout
        while not self._interrupted and time.monotonic() < deadline:
            time.sleep(0.1)
        return self._interrupted

    def hurry(self) -> None:
        """Make a running ``stop()`` SIGKILL what is left at once."""
        self._hurry = True

    def endpoints(self) -> list[Endpoint]:
        return [Endpoint(c.name, c.address, c.pid, c.log_path)
                for stage in self.stages for c in stage if c.process is not None]

    def children(self) -> list[Child]:
        return [c for stage in self.stages for c in stage if c.process is not None]

    def dead(self, serving: bool = False) -> Child | None:
        """A part whose main process has exited (that ends the deployment). ``serving``: an
        expert server is not one until it has been started again ``MAX_RESTARTS`` times
        (``restart_lost_servers``)."""
        for child in self.children():
            child.note_tree()
            if child.exit_code() is None:
                continue
            if serving and self.restarts.get(child.name, 0) < MAX_RESTARTS and (
                    child in self.expert_servers):
                continue
            return child
        return None

    def restart_lost_servers(self) -> list[str]:
        """While serving: start again each expert server that exited, and say when each is
        back in the tier. One that exited with status 0 left in order (the tier retired it:
        drained; or it was stopped) and comes back ``--standby``, holding nothing, warm for the
        next resize (as a Kubernetes pod's container does). One that failed (up to
        ``MAX_RESTARTS`` times) comes back as it was (they hold no state: a new one with the
        same experts and address registers, and the clients join it); meanwhile the other
        holders of its experts serve them, and requests needing an expert it alone held end
        with HTTP 503. Bringing experts back changes what the tier holds, so that restart is
        an operation of the tier controller (``restart``): it waits for the tier's operation
        lease (the next call tries again) and holds it until the server is back. Returns
        progress lines."""
        lines = []
        for child in self.expert_servers:
            code, done = child.exit_code(), self.restarts.get(child.name, 0)
            if code is None or child.name in self._restarting:
                continue
            if code == 0:
                child.command = parts.as_standby(child.command)
                child.start(self.env, again=True)
                lines.append(f"deploy: {child.name} left the tier in order (the tier retired "
                             "it, or it was stopped); starting it again as a standby server")
                continue
            if done >= MAX_RESTARTS:
                continue
            standby = "--standby" in child.command
            held = None if standby else self._take_tier(child, lines)
            if held is None and not standby:
                continue
            self.restarts[child.name] = done + 1
            lines.append(f"deploy: {child.name} (pid {child.pid}) exited with code {code} "
                         f"while serving; starting it again ({done + 1} of {MAX_RESTARTS})")
            child.start(self.env, again=True)
            if held is not None:
                self._restarting[child.name] = held
        if self._restarting:
            info = MoeModelInfo.from_model_path(self.config.model)
            for child in [c for c in self.expert_servers if c.name in self._restarting]:
                held = self._restarting[child.name]
                if child.exit_code() is not None:
                    del self._restarting[child.name]
                    held.finish(FAILED, f"{child.name} exited again (code {child.exit_code()})")
                elif ready.expert_tier(self.monitor_url, self.token, [child.address],
                                       info) is None:
                    del self._restarting[child.name]
                    held.finish(DONE, f"{child.name} is back on {child.address}",
                                read_end_state(self.monitor_url, self.token, None))
                    child.note_shm()
                    lines.append(f"deploy: {child.name} is back on {child.address} (pid "
                                 f"{child.pid})")
        return lines

    def _take_tier(self, child: Child, lines: list[str]):
        """The tier's operation lease for restarting ``child`` (operations left unfinished by
        a dead driver recovered first), or None while another operation holds it (said
        once)."""
        from sglang_eaas.controller.controller import Busy, TierController, requester_name

        controller = TierController(self.monitor_url, self.token,
                                    requester_name("deploy command"), say=self.progress)
        try:
            held = controller.acquire(RESTART, {"server": child.address, "part": child.name})
        except (Busy, TransportError) as exc:
            if self._waiting.get(child.name) != str(exc):
                self._waiting[child.name] = str(exc)
                lines.append(f"deploy: {child.name} exited; it starts again once the tier is "
                             f"free: {exc}")
            return None
        self._waiting.pop(child.name, None)
        held.recover_lapsed()
        held.note(_part=child.name)
        return held

    def __enter__(self) -> "Deployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- starting -----------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.config
        busy = ports.busy_port(cfg)
        if busy:
            raise DeployError(busy)
        # picked ports avoid the fixed ones: free now, they are bound only later
        picked = parts.Ports({p.port for p in ports.fixed_ports(cfg)})
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.progress(f"deploy: logs in {self.log_dir}")
        if cfg.sglang.eaas:
            self._start_expert_tier(picked)
        sglang = parts.sglang_parts(cfg, self.monitor_url, picked, self.log_dir)
        for part in sglang:
            self.progress(f"deploy: starting {part.child.name} on {part.url}")
        self._launch([p.child for p in sglang])
        waiting = {p.child.name: p for p in sglang}

        def serving() -> str | None:
            for name, part in list(waiting.items()):
                if ready.http_ok(part.url, "/health_generate"):
                    del waiting[name]
                    self.progress(f"deploy: {name} serves on {part.url}")
            return ", ".join(f"{n} (/health_generate)" for n in waiting) or None

        self._wait("SGLang instances", serving)
        router, self.url = parts.router_child(cfg, sglang, picked, self.log_dir)
        self.progress(f"deploy: starting the router on {self.url}")
        self._launch([router])
        self._wait("router", lambda: ready.router(self.url))

    def _start_expert_tier(self, picked: parts.Ports) -> None:
        cfg = self.config
        if cfg.monitor.kind == ETCD:
            self._etcd_dir = tempfile.mkdtemp(prefix="eaas-deploy-etcd-")
        monitor, self.monitor_url = parts.monitor_child(
            cfg, picked, self.log_dir, Path(self._etcd_dir) if self._etcd_dir else None)
        if monitor is not None:
            self.progress(f"deploy: starting {monitor.name} on {monitor.address}")
            self._launch([monitor])
            check = (ready.etcd if cfg.monitor.kind == ETCD
                     else lambda url: ready.monitor(url, self.token))
            self._wait(monitor.name, lambda: check(self.monitor_url))
        else:
            self._wait("the monitor", lambda: ready.monitor(self.monitor_url, self.token))
        servers = parts.expert_server_children(cfg, self.monitor_url, picked, self.log_dir,
                                               self._expert_dtype())
        self.progress(f"deploy: starting {len(servers)} expert servers on "
                      f"{', '.join(s.address for s in servers)}")
        self._launch(servers)
        self.expert_servers = servers
        info = MoeModelInfo.from_model_path(cfg.model)
        addresses = [s.address for s in servers]
        self._wait("expert servers",
                   lambda: ready.expert_tier(self.monitor_url, self.token, addresses, info))

    def _expert_dtype(self) -> str:
        """The dtype SGLang computes in, which the expert servers hold their weights in."""
        given = self.config.sglang.dtype
        if given and given != "auto":
            return given
        with warnings.catch_warnings():  # SGLang's import warns of GPU-only quantizations
            warnings.simplefilter("ignore")
            from sglang_eaas.launcher.prepare import sglang_dtype  # imports SGLang: seconds

            return sglang_dtype(str(self.config.model), "auto")

    def _launch(self, children: list[Child]) -> None:
        self.stages.append(children)
        for child in children:
            self._check_interrupt()
            child.start(self.env)

    def _wait(self, what: str, waiting_for: Callable[[], str | None]) -> None:
        """Until ``waiting_for()`` is None; ``DeployError`` when a part started exits or
        after ``timeout`` seconds."""
        t0 = last = time.monotonic()
        while True:
            self._check_interrupt()
            child = self.dead()
            if child is not None:
                raise DeployError(
                    f"{child.name} (pid {child.pid}) exited with code {child.exit_code()} "
                    f"while the deployment started; its log {child.log_path} ends with:\n"
                    + _indent(child.log_tail()))
            left = waiting_for()
            elapsed = time.monotonic() - t0
            if left is None:
                self.progress(f"deploy: {what} ready ({elapsed:.0f}s)")
                for child in self.children():  # the shared-memory files made while starting
                    child.note_shm()
                return
            if elapsed > self.timeout:
                raise DeployError(f"{what} not ready after {self.timeout:.0f}s: still waiting "
                                  f"for {left}; see the logs in {self.log_dir}")
            if time.monotonic() - last > REPORT_EVERY:
                self.progress(f"deploy: waiting for {left} ({elapsed:.0f}s)")
                last = time.monotonic()
            self.wait_interrupt(0.5)

    def _check_interrupt(self) -> None:
        if self._interrupted:
            raise Interrupted("interrupted while starting")


def format_table(endpoints: list[Endpoint]) -> str:
    rows = [("PART", "ADDRESS", "PID", "LOG")] + [
        (e.name, e.address, str(e.pid), str(e.log)) for e in endpoints]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty)"
