"""The command line of every part of a deployment, from its config and the ports picked for it.

Pure functions of their inputs: ``--check`` prints what they return without starting anything.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from sglang_eaas.addresses import free_port
from sglang_eaas.deploy.config import ETCD, STANDALONE, DeployConfig, Instances
from sglang_eaas.deploy.processes import Child
from sglang_eaas.launcher.local_servers import expert_args
from sglang_eaas.membership.etcd import single_node_command
from sglang_eaas.protocol.control import SLOTS_PER_CONNECTION

PYTHON = sys.executable
HOST = "127.0.0.1"  # every part but the router listens on loopback


@dataclass
class Ports:
    """Ports picked for one start, none twice (none is bound before its process binds it)."""

    taken: set[int]

    def pick(self) -> int:
        port = free_port(frozenset(self.taken))
        self.taken.add(port)
        return port


@dataclass(frozen=True)
class SGLangPart:
    child: Child
    mode: str  # plain | prefill | decode
    url: str
    bootstrap_port: int | None = None


def monitor_child(cfg: DeployConfig, ports: Ports, logs: Path, etcd_dir: Path | None
                  ) -> tuple[Child | None, str]:
    """The monitor's process (None for an existing one) and the URL members reach it at."""
    assert cfg.monitor is not None
    if cfg.monitor.kind == STANDALONE:
        address = f"{HOST}:{ports.pick()}"
        return Child("monitor", [PYTHON, "-m", "sglang_eaas.monitor", "--listen", address,
                                 *cfg.monitor.args], address, logs / "monitor.log"), address
    if cfg.monitor.kind == ETCD:
        assert etcd_dir is not None
        client, peer = ports.pick(), ports.pick()
        address = f"{HOST}:{client}"
        return Child("etcd", etcd_command(str(etcd_dir), client, peer), f"etcd://{address}",
                     logs / "etcd.log"), f"etcd://{address}"
    return None, cfg.monitor.url


def etcd_command(data_dir: str, client: int, peer: int) -> list[str]:
    """A single-node etcd on loopback, as ``tools/etcd_process.py`` starts it."""
    return single_node_command(shutil.which("etcd") or "etcd", data_dir, HOST, client, peer)


def expert_server_children(cfg: DeployConfig, monitor_url: str, ports: Ports, logs: Path,
                           dtype: str | None) -> list[Child]:
    """One per planned server, registering with ``monitor_url``; ``dtype``: SGLang's, unless
    the config's args give one."""
    instances = sum(group.count for group in cfg.sglang.instances)
    extra = list(cfg.expert_args)
    if not _has(extra, "--max-clients"):  # each instance joins with up to 2 slots per rank
        extra += ["--max-clients", str(max(8, SLOTS_PER_CONNECTION * instances))]
    if dtype and not _has(extra, "--dtype"):
        extra += ["--dtype", dtype]
    children = []
    for plan in cfg.expert_servers:
        listen = plan.listen or f"{HOST}:{ports.pick()}"
        held = ["--standby"] if plan.standby else expert_args(plan.experts)
        children.append(Child(plan.name, [
            PYTHON, "-m", "sglang_eaas.expert_server", "--model-path", str(cfg.model),
            *held, "--listen", listen, "--monitor", monitor_url, *extra],
            listen, logs / f"{plan.name}.log"))
    return children


HELD_FLAGS = ("--experts", "--layer-experts", "--part")  # an expert server's holdings


def as_standby(command: list[str]) -> list[str]:
    """An expert server's command, holding nothing (``--standby``) instead of its experts."""
    if "--standby" in command:
        return list(command)
    out, skip = [], False
    for arg in command:
        if skip:
            skip = False
        elif arg in HELD_FLAGS:
            skip = True
        else:
            out.append(arg)
    at = out.index("--listen")
    return [*out[:at], "--standby", *out[at:]]


def sglang_parts(cfg: DeployConfig, monitor_url: str | None, ports: Ports, logs: Path
                 ) -> list[SGLangPart]:
    parts = []
    for group in cfg.sglang.instances:
        for i in range(group.count):
            parts.append(_sglang_part(cfg, group, f"{group.mode}-{i}", monitor_url, ports, logs))
    return parts


def _sglang_part(cfg: DeployConfig, group: Instances, name: str, monitor_url: str | None,
                 ports: Ports, logs: Path) -> SGLangPart:
    port = ports.pick()
    url = f"http://{HOST}:{port}"
    command = [PYTHON, "-m", "sglang.launch_server", "--model-path", str(cfg.model),
               "--host", HOST, "--port", str(port), *cfg.sglang.args, *group.args]
    if cfg.sglang.eaas:
        command += ["--eaas", "--eaas-monitor", monitor_url]
    bootstrap = None
    if group.mode != "plain":
        command += ["--disaggregation-mode", group.mode,
                    "--disaggregation-transfer-backend", cfg.sglang.transfer_backend]
    if group.mode == "prefill":
        bootstrap = ports.pick()
        command += ["--disaggregation-bootstrap-port", str(bootstrap)]
    shown = url + (f" (bootstrap port {bootstrap})" if bootstrap else "")
    return SGLangPart(Child(name, command, shown, logs / f"{name}.log"), group.mode, url,
                      bootstrap)


def router_child(cfg: DeployConfig, parts: list[SGLangPart], ports: Ports, logs: Path
                 ) -> tuple[Child, str]:
    """The router and the URL clients send requests to."""
    router = cfg.router
    port = router.port or ports.pick()
    command = [PYTHON, "-m", "sglang_router.launch_router", "--host", router.host,
               "--port", str(port)]
    if cfg.sglang.pd:
        command.append("--pd-disaggregation")
        for part in parts:
            command += (["--prefill", part.url, str(part.bootstrap_port)]
                        if part.mode == "prefill" else ["--decode", part.url])
    else:
        command += ["--worker-urls", *(part.url for part in parts)]
    extra = list(router.args)
    if not _has(extra, "--prometheus-port"):  # its default, 29000, may be taken
        extra += ["--prometheus-port", str(ports.pick()), "--prometheus-host", HOST]
    connect = HOST if router.host in ("0.0.0.0", "") else router.host
    url = f"http://{connect}:{port}"
    return Child("router", command + extra, url, logs / "router.log"), url


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)

