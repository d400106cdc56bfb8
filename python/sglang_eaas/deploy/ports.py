"""The ports a config fixes, checked free before anything starts.

A config fixes a port in ``router.port``, in a placement file's ``HOST:PORT`` keys (where each
expert server listens), and in any ``--NAME-port N`` flag of an ``args`` list (the router's
``--prometheus-port``, SGLang's ``--nccl-port``, ...). Every other port is picked free at start.
A fixed port that is taken would otherwise be found only when its part fails, after the parts
before it have started (the router: after the whole tier and every SGLang instance). The check
binds each one as its part would (``SO_REUSEADDR``, as servers do: a port with only connections
in TIME_WAIT on it is free) and refuses the first that cannot be, in one sentence naming the
field and the port. An existing monitor (``monitor: HOST:PORT``) is not checked: it is meant to
be there.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from sglang_eaas.deploy.config import DeployConfig

ANY = ""  # a flag's port: the host it binds is the part's business, so every address


@dataclass(frozen=True)
class FixedPort:
    field: str  # the config field that fixes it: router.port, router.args (--prometheus-port)
    host: str
    port: int


def fixed_ports(cfg: DeployConfig) -> list[FixedPort]:
    """Every port ``cfg`` fixes, in the order the fields come in the file."""
    fixed: list[FixedPort] = []
    if cfg.monitor is not None:
        fixed += _flag_ports("monitor_args", cfg.monitor.args)
    fixed += [FixedPort(f"expert_servers.placement ({s.listen})", *_split(s.listen))
              for s in cfg.expert_servers if s.listen]
    fixed += _flag_ports("expert_servers.args", cfg.expert_args)
    fixed += _flag_ports("sglang.args", cfg.sglang.args)
    for group in cfg.sglang.instances:
        fixed += _flag_ports(f"sglang.{group.mode}.args", group.args)
    if cfg.router.port:
        fixed.append(FixedPort("router.port", cfg.router.host, cfg.router.port))
    fixed += _flag_ports("router.args", cfg.router.args)
    return fixed


def busy_port(cfg: DeployConfig) -> str | None:
    """None when every port ``cfg`` fixes can be bound now, else one sentence naming the field
    and the port (``router.port: port 8000 is already in use``)."""
    fixed = fixed_ports(cfg)
    for i, one in enumerate(fixed):
        for other in fixed[:i]:
            if other.port == one.port and (other.host == one.host or {one.host, other.host}
                                           & {ANY, "0.0.0.0"}):
                return (f"{one.field}: port {one.port} is also given by {other.field}; two "
                        "parts cannot listen on one port")
    for one in fixed:
        problem = _cannot_bind(one.host, one.port)
        if problem:
            return f"{one.field}: {problem}"
    return None


def _cannot_bind(host: str, port: int) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)  # a bound socket listening there conflicts only here, on Linux
        except socket.gaierror:
            return f"host {host!r} of port {port} is not a known host name"
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} is already in use"
            if exc.errno == errno.EADDRNOTAVAIL:
                return (f"{host} is not an address of this host, so port {port} cannot be "
                        "listened on there (the deployment starts every part here)")
            if exc.errno == errno.EACCES:
                return f"port {port} needs privileges this user lacks (ports below 1024)"
            return f"port {port} cannot be listened on: {exc.strerror}"
    return None


def _flag_ports(field: str, args: tuple[str, ...]) -> list[FixedPort]:
    """``--NAME-port N`` and ``--NAME-port=N`` in an args list (N a port number)."""
    found = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if not (flag.startswith("--") and flag.endswith("-port")):
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if value.isdigit() and 0 < int(value) <= 65535:
            found.append(FixedPort(f"{field} ({flag})", ANY, int(value)))
    return found


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
