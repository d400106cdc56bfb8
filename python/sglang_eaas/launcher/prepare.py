"""Before SGLang starts its workers: find or start the expert servers and check the placement.

Runs in the launcher process (AROUND ``Engine._launch_subprocesses``), so a server that cannot
start, an unreachable server or monitor, an expert without a server or a server holding another
model stops the launch with one sentence and exit status 1 before any scheduler exists (no
traceback: ``launch_subprocesses``). Workers then receive the concrete server addresses in
``ServerArgs._eaas`` and join the servers themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable

from ibgda import TransportError
from sglang_eaas import envs, transports
from sglang_eaas.addresses import free_port
from sglang_eaas.checkpoint import expert_digests
from sglang_eaas.config import (
    DEFAULT_LOCAL_SERVERS,
    LOCAL_ONLY,
    EaasConfig,
    LocalServers,
    LocalSpawn,
    RemoteServers,
)
from sglang_eaas.cores import rank_threads, shares_cores
from sglang_eaas.holdings import Holdings
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.membership import EMBEDDED, connect
from sglang_eaas.model_info import ModelError, MoeModelInfo
from sglang_eaas.refusal import Refusal
from sglang_eaas.placement import PlacementError, even_placement
from sglang_eaas.protocol import control
from sglang_eaas.protocol.slot import DTYPE_NAMES, POLL_SPIN_US
from sglang_eaas.routing_table import RoutingTable, uncovered

logger = logging.getLogger(__name__)
LAUNCH_ERRORS = (PlacementError, TransportError, ModelError)  # one sentence each
# What this process started for the tier (the embedded monitor, local expert servers), stopped
# last-started first: at exit, or before by ``stop_started()``.
_started = contextlib.ExitStack()


def _stop_later(stop: Callable[[], Any]) -> None:
    """Run ``stop`` at ``stop_started()`` or at exit, whichever comes first."""
    _started.callback(stop)
    atexit.register(_started.close)  # a second close finds nothing left to stop


def stop_started() -> None:
    """Stop what this process started for the tier now (local expert servers SIGTERMed and
    waited for, then the embedded monitor closed): ``sglang_eaas.Engine.shutdown``, where the
    process goes on after its engine."""
    _started.close()


def probe(address: str, timeout: float = 10.0) -> control.ServerStats:
    """A server's stats (experts, model fingerprint, weight digests...), with this process's
    token."""
    return control.probe(address, envs.TOKEN.get(), timeout)


def sglang_dtype(model_path: str, dtype: str) -> str:
    """The dtype SGLang computes in for ``--dtype dtype`` (any spelling it accepts, 'auto'
    resolved SGLang's way), so local expert servers hold their weights in that dtype too."""
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    config = json.loads((Path(model_path) / "config.json").read_text())
    return DTYPE_NAMES[_get_and_verify_dtype(config, dtype)]


def client_poll_spin_us(given: int | None, servers: int, ranks: int) -> int:
    """How long SGLang's ranks busy-poll for the local expert servers' results before sleeping:
    ``given`` (--eaas-poll-spin-us) if set; else not at all when the servers' and ranks'
    processes outnumber this process's cores (the rank's polls would take a core from the
    servers it waits for), else ``POLL_SPIN_US``. The servers keep their own default: a server
    that sleeps at once after a request would wake up late for the next layer's."""
    if given is not None:
        return given
    return 0 if shares_cores(servers, ranks) else POLL_SPIN_US


def prepare_expert_servers(cfg: EaasConfig, model_path: str, dtype: str,
                           num_ranks: int, sglang_ports: frozenset[int] = frozenset()
                           ) -> EaasConfig:
    """Start the monitor and local servers or check remote ones; returns the config workers
    should use (the monitor's URL, the servers' addresses). ``sglang_ports``: SGLang's own,
    bound only once its workers are up, so neither the monitor nor a local server takes them."""
    info = MoeModelInfo.from_model_path(model_path)
    planned = cfg.placement  # read and checked against the model at parse time
    servers = cfg.expert_servers
    origin = (f"--eaas-placement {planned.path}" if planned else
              f"--eaas-expert-servers {_spec(servers)}" if servers else
              f"--eaas-expert-servers local:{DEFAULT_LOCAL_SERVERS} (the default)")
    if cfg.monitor.kind != EMBEDDED and servers is None and planned is None:
        with blame(f"--eaas-monitor {cfg.monitor}"):
            return registered_servers(dataclasses.replace(cfg, monitor=cfg.monitor.url), info)
    if planned and planned.local:
        if isinstance(servers, LocalServers) and servers.count != len(planned.entries):
            raise PlacementError(f"--eaas-expert-servers local:{servers.count} but "
                                 f"{planned.path} lists {len(planned.entries)} local servers")
        placements = list(planned.entries.values())
    elif planned:
        if cfg.kernel is not None or not cfg.shrink:
            raise PlacementError(LOCAL_ONLY)  # its servers are started separately
        if isinstance(servers, RemoteServers) and set(servers.addresses) != set(planned.entries):
            raise PlacementError(f"{planned.path} names servers {sorted(planned.entries)}, "
                                 f"--eaas-expert-servers names {sorted(servers.addresses)}")
        servers, placements = RemoteServers(tuple(planned.entries)), None
    elif servers is None or isinstance(servers, LocalServers):
        placements = even_placement(info.num_experts,
                                    servers.count if servers else DEFAULT_LOCAL_SERVERS)
        # Every expert of every MoE layer covered, ids in range.
        RoutingTable.build(0, Holdings.uniform({f"local:{i}": p for i, p in enumerate(placements)},
                                               info.moe_layers),
                           list(info.moe_layers), info.num_experts)
    else:
        placements = None
    if placements is not None:
        if not envs.TOKEN.get():  # inherited by the monitor, local servers and workers
            os.environ[envs.TOKEN.name] = secrets.token_hex(16)
        with blame(f"--eaas-monitor {cfg.monitor}"):
            cfg = dataclasses.replace(cfg, monitor=start_monitor(cfg, sglang_ports))
        logger.info("sglang-eaas: starting %d local expert servers: %s", len(placements),
                    placements)
        backend = "shm" if cfg.transport == transports.AUTO else cfg.transport
        spawn = LocalSpawn(sglang_dtype(model_path, dtype),
                           max(8, control.SLOTS_PER_CONNECTION * num_ranks),
                           ("--transport", backend, "--heartbeat", str(cfg.heartbeat),
                            *(("--poll-spin-us", str(cfg.poll_spin_us))
                              if cfg.poll_spin_us is not None else ()),
                            *(("--kernel", cfg.kernel) if cfg.kernel else ()),
                            *(() if cfg.shrink else ("--disable-shrink",))))
        with blame(origin):
            local = start_local_servers(
                model_path, placements, spawn.dtype, spawn.max_clients,
                avoid_ports=sglang_ports, extra_args=("--monitor", cfg.monitor, *spawn.flags))
            _stop_later(lambda: [s.stop() for s in local])
            wait_registered(cfg.monitor, [s.address for s in local])
        return dataclasses.replace(cfg, expert_servers=RemoteServers(
            tuple(s.address for s in local)), placement=None, transport=backend, spawn=spawn,
            poll_spin_us=client_poll_spin_us(cfg.poll_spin_us, len(placements), num_ranks),
            rank_threads=rank_threads(len(placements), num_ranks))
    if not envs.TOKEN.get():
        raise TransportError(f"expert servers started separately need their shared token: set "
                             f"{envs.TOKEN.name} or pass --eaas-token")
    with blame(origin):
        check_remote_servers(servers.addresses, model_path, info,
                             planned.holdings(info.moe_layers) if planned else Holdings())
    with blame(f"--eaas-monitor {cfg.monitor}"):
        return dataclasses.replace(cfg, expert_servers=servers,
                                   monitor=start_monitor(cfg, sglang_ports))


def check_remote_servers(addresses: tuple[str, ...], model_path: str, info: MoeModelInfo,
                         expected: Holdings) -> None:
    """Each server started separately serves this model with these weights, holds what
    ``expected`` (a placement file) says of it, and together they hold every expert."""
    held, digests = {}, expert_digests(model_path, info)
    for address in addresses:
        stats = probe(address)
        if stats.fingerprint != info.fingerprint():
            raise PlacementError(f"expert server {address} serves a different model than "
                                 f"{model_path}")
        differ = [e for e, d in stats.expert_digests.items() if digests[e] != d]
        if differ:
            raise PlacementError(f"expert server {address} holds other weights for experts "
                                 f"{differ} than {model_path} (another checkpoint of the same "
                                 "shape)")
        held[address] = stats.holdings
        if address in expected and not held[address].same_experts(expected[address]):
            raise PlacementError(f"expert server {address} holds experts {held[address]} (per "
                                 f"MoE layer), the file says {expected[address]}")
    RoutingTable.build(0, Holdings(held), list(info.moe_layers), info.num_experts)


class LaunchError(Exception):
    """What stops a launch, naming the flag that led there."""


@contextlib.contextmanager
def blame(flag: str):
    """Errors inside name ``flag`` (what the user gave that led there) first."""
    try:
        yield
    except LAUNCH_ERRORS as exc:
        raise LaunchError(f"{flag}: {exc}") from None


def _spec(servers: LocalServers | RemoteServers) -> str:
    """``--eaas-expert-servers``' value, as given."""
    if isinstance(servers, LocalServers):
        return f"local:{servers.count}"
    return ",".join(servers.addresses)


def start_monitor(cfg: EaasConfig, avoid_ports: frozenset[int] = frozenset()) -> str:
    """The monitor's URL for workers and servers; an embedded one is started here, in the
    launcher process, and lives as long as it does."""
    spec = cfg.monitor
    if spec.kind != EMBEDDED:
        if not envs.TOKEN.get():
            raise TransportError(f"the monitor {spec} needs the shared token: set "
                                 f"{envs.TOKEN.name} or pass --eaas-token")
        return spec.url
    from sglang_eaas.monitor.server import MonitorConfig, MonitorServer

    host, port = spec.address.rsplit(":", 1)
    if int(port) == 0:  # a free port, but not one SGLang is about to bind
        port = str(free_port(avoid_ports))
    try:
        monitor = MonitorServer(MonitorConfig(host, int(port), envs.TOKEN.get(),
                                              cfg.loss_timeout, cfg.suspect_timeout)).start()
    except OSError as exc:
        raise TransportError(f"cannot start the embedded monitor on {spec.address}: "
                             f"{exc.strerror or exc}") from None
    _stop_later(monitor.close)
    logger.info("sglang-eaas: embedded monitor on %s (suspect timeout %ss, loss timeout %ss)",
                monitor.address, cfg.suspect_timeout, cfg.loss_timeout)
    return monitor.address


def wait_registered(monitor: str, addresses: list[str], timeout: float = 60.0) -> None:
    """Wait until the servers this launcher started are registered with the monitor, so a
    worker's first view already knows their incarnations."""
    backend = connect(monitor, envs.TOKEN.get())
    deadline, revision = time.monotonic() + timeout, -1
    try:
        while True:
            snapshot = backend.watch(revision, 1.0)
            revision = snapshot.revision
            waiting = set(addresses) - {m.id for m in snapshot.servers()}
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TransportError(f"local expert servers {sorted(waiting)} did not register "
                                     f"with the monitor {monitor} within {timeout:.0f}s; see "
                                     "their output above")
    finally:
        backend.close()


def registered_servers(cfg: EaasConfig, info: MoeModelInfo) -> EaasConfig:
    """A shared monitor and no servers given: serve with those registered there, once every
    expert of every MoE layer has a live holder (``PlacementError`` after
    ``cfg.wait_for_servers`` seconds, naming what is still missing)."""
    if not envs.TOKEN.get():
        raise TransportError(f"a shared monitor needs the shared token: set {envs.TOKEN.name} "
                             "or pass --eaas-token")
    backend = connect(cfg.monitor, envs.TOKEN.get())
    deadline, last, revision = time.monotonic() + cfg.wait_for_servers, "", -1
    fingerprint = info.fingerprint()
    try:
        while True:
            snapshot = backend.watch(revision, 5.0)
            revision = snapshot.revision
            holdings = snapshot.holdings(fingerprint).model_experts(info.num_experts)
            missing = uncovered(holdings, list(info.moe_layers), info.num_experts)
            if not missing:
                logger.info("sglang-eaas: serving with the %d expert servers registered at %s",
                            len(holdings), cfg.monitor)
                return dataclasses.replace(cfg, expert_servers=RemoteServers(()))
            if time.monotonic() > deadline:
                raise PlacementError(f"after {cfg.wait_for_servers:.0f}s, the monitor "
                                     f"{cfg.monitor} still has no live expert server of this "
                                     f"model for {missing} (--eaas-wait-for-servers)")
            if missing != last:
                logger.warning("sglang-eaas: waiting for expert servers at %s: no live holder "
                               "yet for %s", cfg.monitor, missing)
                last = missing
    finally:
        backend.close()


def launch_subprocesses(launch: Callable, cls: type, server_args: Any, *args, **kwargs):
    """AROUND ``Engine._launch_subprocesses``: what cannot serve ends the launch here, with
    one sentence and exit status 1 (``Refusal``, a ``SystemExit``: SGLang's launcher lets it
    through, and the local servers started so far stop at exit)."""
    cfg = getattr(server_args, "_eaas", None)
    if cfg is not None:
        if cfg.token:
            os.environ[envs.TOKEN.name] = cfg.token
        ranks = server_args.tp_size * server_args.pp_size * max(server_args.dp_size, 1)
        try:
            server_args._eaas = prepare_expert_servers(cfg, server_args.model_path,
                                                       server_args.dtype, ranks,
                                                       frozenset({server_args.port}))
        except (LaunchError, *LAUNCH_ERRORS) as exc:
            raise Refusal(str(exc)) from None
    return launch(cls, server_args, *args, **kwargs)


def unlaunched(load_model: Callable, runner: Any, *args, **kwargs):
    """AROUND ``ModelRunner.load_model``: where no SGLang launcher prepared the expert tier
    (``python -m sglang.benchmark.one_batch`` builds its ``ModelRunner`` itself, in its own
    process), prepare it here, once, before the MoE layers join it. A prepared config names
    its monitor by URL; a launched worker's always is."""
    server_args = runner.server_args
    cfg = getattr(server_args, "_eaas", None)
    if cfg is not None and not isinstance(cfg.monitor, str):
        ranks = server_args.tp_size * server_args.pp_size * max(server_args.dp_size, 1)
        if ranks > 1:
            raise Refusal("--eaas: this command runs each of its ranks without SGLang's "
                          "launcher, so none of them can start the expert tier for the others: "
                          "run it with --tp 1, or start the expert servers and a monitor first "
                          "and pass --eaas-expert-servers HOST:PORT,... and --eaas-monitor")
        if cfg.token:
            os.environ[envs.TOKEN.name] = cfg.token
        try:
            server_args._eaas = prepare_expert_servers(cfg, server_args.model_path,
                                                       server_args.dtype, ranks)
        except (LaunchError, *LAUNCH_ERRORS) as exc:
            raise Refusal(str(exc)) from None
    return load_model(runner, *args, **kwargs)
