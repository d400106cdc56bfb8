"""Before SGLang starts its workers: find or start the expert servers and check the placement.

Runs in the launcher process (AROUND ``Engine._launch_subprocesses``), so a server that cannot
start, an unreachable server, an expert without a server or a server holding another model stops
the launch with one clear error before any scheduler exists. Workers then receive the concrete
server addresses in ``ServerArgs._eaas`` and join the servers themselves.
"""

from __future__ import annotations

import atexit
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
from sglang_eaas.checkpoint import expert_digests
from sglang_eaas.config import (
    DEFAULT_LOCAL_SERVERS,
    LOCAL_ONLY,
    EaasConfig,
    LocalServers,
    RemoteServers,
)
from sglang_eaas.cores import shares_cores
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.monitor import EMBEDDED, connect
from sglang_eaas.protocol.monitor import SERVING
from sglang_eaas.protocol import control
from sglang_eaas.protocol.slot import DTYPE_NAMES, POLL_SPIN_US
from sglang_eaas.placement import (
    PlacementError,
    even_placement,
    layer_holdings,
    load_placement_file,
)
from sglang_eaas.routing_table import RoutingTable
from sglang_eaas.tools.server_process import free_port

logger = logging.getLogger(__name__)


def probe(address: str, timeout: float = 10.0) -> dict[str, Any]:
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
    planned = load_placement_file(cfg.placement) if cfg.placement else None
    servers = cfg.expert_servers
    if cfg.monitor.kind != EMBEDDED and servers is None and planned is None:
        return registered_servers(dataclasses.replace(cfg, monitor=cfg.monitor.url), info)
    if planned and all(name.startswith("local:") for name in planned):
        if isinstance(servers, LocalServers) and servers.count != len(planned):
            raise PlacementError(f"--eaas-expert-servers local:{servers.count} but "
                                 f"{cfg.placement} lists {len(planned)} local servers")
        placements = list(planned.values())
    elif planned:
        if cfg.kernel is not None or not cfg.shrink:
            raise PlacementError(LOCAL_ONLY)  # its servers are started separately
        if isinstance(servers, RemoteServers) and set(servers.addresses) != set(planned):
            raise PlacementError(f"{cfg.placement} names servers {sorted(planned)}, "
                                 f"--eaas-expert-servers names {sorted(servers.addresses)}")
        servers, placements = RemoteServers(tuple(planned)), None
    elif servers is None or isinstance(servers, LocalServers):
        placements = even_placement(info.num_experts,
                                    servers.count if servers else DEFAULT_LOCAL_SERVERS)
    else:
        placements = None
    if placements is not None:
        # Every expert of every MoE layer covered, ids in range.
        RoutingTable.build(0, {f"local:{i}": layer_holdings(p, info.moe_layers)
                               for i, p in enumerate(placements)},
                           list(info.moe_layers), info.num_experts)
        if not envs.TOKEN.get():  # inherited by the monitor, local servers and workers
            os.environ[envs.TOKEN.name] = secrets.token_hex(16)
        cfg = dataclasses.replace(cfg, monitor=start_monitor(cfg, sglang_ports))
        logger.info("sglang-eaas: starting %d local expert servers: %s", len(placements),
                    placements)
        backend = "shm" if cfg.transport == transports.AUTO else cfg.transport
        local = start_local_servers(model_path, placements, sglang_dtype(model_path, dtype),
                                    max(8, control.SLOTS_PER_CONNECTION * num_ranks),
                                    avoid_ports=sglang_ports,
                                    extra_args=("--transport", backend, "--monitor", cfg.monitor,
                                                "--heartbeat", str(cfg.heartbeat),
                                                *(("--poll-spin-us", str(cfg.poll_spin_us))
                                                  if cfg.poll_spin_us is not None else ()),
                                                *(("--kernel", cfg.kernel) if cfg.kernel
                                                  else ()),
                                                *(() if cfg.shrink else ("--disable-shrink",))))
        atexit.register(lambda: [s.stop() for s in local])
        wait_registered(cfg.monitor, [s.address for s in local])
        return dataclasses.replace(cfg, expert_servers=RemoteServers(
            tuple(s.address for s in local)), placement=None, transport=backend,
            poll_spin_us=client_poll_spin_us(cfg.poll_spin_us, len(placements), num_ranks))
    if not envs.TOKEN.get():
        raise TransportError(f"expert servers started separately need their shared token: set "
                             f"{envs.TOKEN.name} or pass --eaas-token")
    held, digests = {}, expert_digests(model_path, info)
    for address in servers.addresses:
        stats = probe(address)
        if stats["fingerprint"] != info.fingerprint():
            raise PlacementError(f"expert server {address} serves a different model than "
                                 f"{model_path}")
        differ = [int(e) for e, d in stats["expert_digests"].items() if digests[int(e)] != d]
        if differ:
            raise PlacementError(f"expert server {address} holds other weights for experts "
                                 f"{differ} than {model_path} (another checkpoint of the same "
                                 "shape)")
        held[address] = {int(layer): ids for layer, ids in stats["layer_experts"].items()}
        if planned and held[address] != layer_holdings(planned[address], info.moe_layers):
            raise PlacementError(f"expert server {address} holds experts {held[address]} (per "
                                 f"MoE layer), {cfg.placement} says {planned[address]}")
    RoutingTable.build(0, held, list(info.moe_layers), info.num_experts)
    return dataclasses.replace(cfg, expert_servers=servers,
                               monitor=start_monitor(cfg, sglang_ports))


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
                                              cfg.loss_timeout)).start()
    except OSError as exc:
        raise TransportError(f"cannot start the embedded monitor on {spec.address}: "
                             f"{exc.strerror or exc}") from None
    atexit.register(monitor.close)
    logger.info("sglang-eaas: embedded monitor on %s (loss timeout %ss)", monitor.address,
                cfg.loss_timeout)
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
            servers = [m for m in snapshot.servers(fingerprint) if m.status == SERVING]
            table = RoutingTable.build(0, {m.id: m.base_holdings() for m in servers},
                                       list(info.moe_layers), info.num_experts,
                                       allow_missing=True)
            if not table.missing:
                logger.info("sglang-eaas: serving with the %d expert servers registered at %s",
                            len(servers), cfg.monitor)
                return dataclasses.replace(cfg, expert_servers=RemoteServers(()))
            missing = "; ".join(f"experts {e} of MoE layer {layer}"
                                for layer, e in table.missing.items())
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
    """AROUND ``Engine._launch_subprocesses``."""
    cfg = getattr(server_args, "_eaas", None)
    if cfg is not None:
        if cfg.token:
            os.environ[envs.TOKEN.name] = cfg.token
        ranks = server_args.tp_size * server_args.pp_size * max(server_args.dp_size, 1)
        server_args._eaas = prepare_expert_servers(cfg, server_args.model_path,
                                                   server_args.dtype, ranks,
                                                   frozenset({server_args.port}))
    return launch(cls, server_args, *args, **kwargs)
