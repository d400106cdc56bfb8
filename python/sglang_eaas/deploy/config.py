"""A deployment's config file (YAML), read into typed records with every field checked.

One mistake is one ``DeployConfigError`` sentence naming the field's path
(``expert_servers.count: must be a positive integer, got 0``); a key the format does not have is
refused by name, and so is a key given twice in one mapping (PyYAML would keep the last one
silently). What SGLang's own parser would refuse (``sglang.transfer_backend`` not one of its
transfer backends, a flag's value not one of its choices or not of its type) is refused here too,
by that parser (``ServerArgs.add_cli_args``, the plugin's group included), before anything
starts. Relative paths (``model``, ``expert_servers.placement``) are read from the
current directory. The format is ``FORMAT`` below, which ``--help`` prints.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from sglang_eaas.model_info import ModelError, MoeModelInfo
from sglang_eaas.membership import ETCD, parse_monitor
from sglang_eaas.placement import (
    PlacedExperts,
    PlacementError,
    even_placement,
    load_placement_file,
    read_utf8,
    yaml_problem,
    parse_expert_list,
)
from sglang_eaas.holdings import Holdings
from sglang_eaas.routing_table import RoutingTable

FORMAT = """\
model: models/tiny-moe-stdlib    # checkpoint folder (required)
monitor: standalone              # standalone | etcd | HOST:PORT | etcd://HOST:PORT (an existing
                                 #   one); default standalone
monitor_args: ["--loss-timeout", "2"]  # more flags of a standalone monitor
expert_servers:                  # one of count, placement, experts; default count: 2
  count: 2                       #   N servers, experts spread evenly ...
  replicas: 1                    #   ... each expert on this many of them (default 1)
  placement: FILE                #   or a placement file (docs/plugin.md): local:N keys, or
                                 #   HOST:PORT keys (where each server listens)
  experts: ["0-15", "16-31"]     #   or one expert list per server (every MoE layer)
  standby: 1                     # more servers started --standby (warm, holding nothing,
                                 #   taken first by a resize); default 0
  args: ["--kernel", "fast"]     # more flags of every expert server
sglang:
  args: ["--device", "cpu"]      # flags of every SGLang instance
  eaas: true                     # false: monolithic SGLang (no monitor, no expert servers)
  plain: {count: 1, args: []}    # plain instances (the default), or PD instead:
  prefill: {count: 1, args: []}  #   prefill and decode instances (both needed)
  decode: {count: 1, args: []}
  transfer_backend: mooncake_tcp # PD only: --disaggregation-transfer-backend, one of
                                 #   SGLang's (its parser's choices)
router:
  host: 127.0.0.1                # where the router listens (default 127.0.0.1)
  port: 30000                    # default: a free port; a given one is checked free first
  args: []                       # more flags of python -m sglang_router.launch_router
"""

STANDALONE = "standalone"
MAX_STANDBY = 64  # expert_servers.standby at most
# Flags the deployment sets itself, per list of arguments, and what to write instead.
OWN_FLAGS = {
    "monitor_args": {"--listen": None, "--token": "the SGLANG_EAAS_TOKEN environment variable"},
    "expert_servers.args": {
        "--model-path": "model", "--experts": "expert_servers", "--layer-experts":
        "expert_servers.placement", "--listen": "expert_servers.placement (HOST:PORT keys)",
        "--monitor": "monitor", "--token": "the SGLANG_EAAS_TOKEN environment variable",
        "--standby": None, "--drain": None, "--part": None},
    "sglang": {
        "--model-path": "model", "--host": None, "--port": None, "--eaas": "sglang.eaas",
        "--eaas-monitor": "monitor", "--eaas-expert-servers": "expert_servers",
        "--eaas-placement": "expert_servers.placement",
        "--eaas-token": "the SGLANG_EAAS_TOKEN environment variable",
        "--disaggregation-mode": "sglang.prefill and sglang.decode",
        "--disaggregation-bootstrap-port": None,
        "--disaggregation-transfer-backend": "sglang.transfer_backend"},
    "router.args": {
        "--host": "router.host", "--port": "router.port", "--worker-urls": None,
        "--pd-disaggregation": None, "--prefill": None, "--decode": None},
}


class DeployConfigError(ValueError):
    """A config that cannot be deployed; the message is one sentence naming the field."""


@dataclass(frozen=True)
class MonitorPlan:
    kind: str  # STANDALONE | ETCD (started here) | "existing"
    url: str | None = None  # an existing monitor's HOST:PORT or etcd://HOST:PORT
    args: tuple[str, ...] = ()  # more flags of a standalone monitor (monitor_args)


@dataclass(frozen=True)
class ServerPlan:
    name: str  # expert-server-I
    experts: PlacedExperts  # a list (every MoE layer) or a map of layers ([] for standby)
    listen: str | None = None  # HOST:PORT given by a placement file, else a free loopback port
    standby: bool = False  # started --standby (holding nothing)


@dataclass(frozen=True)
class Instances:
    mode: str  # "plain" | "prefill" | "decode"
    count: int
    args: tuple[str, ...]


@dataclass(frozen=True)
class SGLangPlan:
    args: tuple[str, ...]
    eaas: bool
    instances: tuple[Instances, ...]  # plain, or prefill then decode
    transfer_backend: str
    dtype: str | None = None  # the --dtype every instance is given, if any

    @property
    def pd(self) -> bool:
        return self.instances[0].mode != "plain"


@dataclass(frozen=True)
class RouterPlan:
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeployConfig:
    model: Path
    monitor: MonitorPlan | None  # None without EaaS
    expert_servers: tuple[ServerPlan, ...]
    expert_args: tuple[str, ...]
    sglang: SGLangPlan
    router: RouterPlan
    source: str = "<config>"  # the file it was read from


def load_config(path: str | Path) -> DeployConfig:
    """The config file at ``path``; ``DeployConfigError`` for anything that cannot deploy."""
    import yaml

    text = read_utf8(path, DeployConfigError)
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DeployConfigError(f"{path}: not valid YAML{yaml_problem(exc)}") from None
    return parse_config(data, str(path))


def _refuse_duplicate_keys(node: Any, source: str | Path, where: str = "",
                           seen: set[int] | None = None) -> None:
    """``DeployConfigError`` for the first key given twice in one mapping of the composed YAML
    ``node`` (the field's path and both lines)."""
    import yaml

    seen = set() if seen is None else seen
    if node is None or id(node) in seen:  # an alias met again
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            path = f"{where}.{name}" if where else str(name)
            if name is not None and name != "<<":
                if name in lines:
                    raise DeployConfigError(
                        f"{path}: given twice in {source}, at lines {lines[name]} and "
                        f"{key.start_mark.line + 1}; give each key once")
                lines[name] = key.start_mark.line + 1
            _refuse_duplicate_keys(value, source, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicate_keys(item, source, f"{where}[{i}]", seen)


def parse_config(data: Any, source: str = "<config>") -> DeployConfig:
    """A config as YAML reads it (nested dicts and lists) -> ``DeployConfig``."""
    if not isinstance(data, dict):
        raise DeployConfigError(f"{source}: must be a mapping with at least 'model', got "
                                f"{_kind(data)}")
    top = _fields("", data, {"model", "monitor", "monitor_args", "expert_servers", "sglang",
                             "router"}, required=("model",))
    model = _model(top["model"])
    sglang = _sglang(top.get("sglang", {}))
    if not sglang.eaas:
        for key in ("monitor", "monitor_args", "expert_servers"):
            if key in top:
                raise DeployConfigError(f"{key}: sglang.eaas is false, so no {key} is used; "
                                        "remove it or set sglang.eaas: true")
        monitor, servers, expert_args = None, (), ()
    else:
        info = _model_info(model)
        monitor = _monitor(top.get("monitor", STANDALONE))
        if "monitor_args" in top:
            if monitor.kind != STANDALONE:
                raise DeployConfigError("monitor_args: only a standalone monitor (monitor: "
                                        "standalone) is started by the deployment")
            monitor = replace(monitor, args=_args("monitor_args", top["monitor_args"]))
        servers, expert_args = _expert_servers(top.get("expert_servers", {}), info)
    router = _router(top.get("router", {}))
    _as_sglang_reads_it(model, sglang)  # last: it imports SGLang (seconds)
    return DeployConfig(model, monitor, servers, expert_args, sglang, router, source)


# -- sections ---------------------------------------------------------------------------------
def _model(value: Any) -> Path:
    if not isinstance(value, str) or not value:
        raise DeployConfigError(f"model: must be a checkpoint folder's path, got {_kind(value)}")
    path = Path(value).expanduser()
    if not (path / "config.json").is_file():
        raise DeployConfigError(f"model: {value} is not a checkpoint folder (it has no "
                                "config.json)")
    return path


def _model_info(model: Path) -> MoeModelInfo:
    try:
        return MoeModelInfo.from_model_path(model)
    except (ModelError, KeyError) as exc:
        raise DeployConfigError(f"model: {model} cannot be served with expert servers: "
                                f"{exc}") from None


def _monitor(value: Any) -> MonitorPlan:
    if not isinstance(value, str):
        raise DeployConfigError(f"monitor: must be standalone, etcd, HOST:PORT or "
                                f"etcd://HOST:PORT, got {_kind(value)}")
    if value == STANDALONE:
        return MonitorPlan(STANDALONE)
    if value == ETCD:
        if shutil.which("etcd") is None:
            raise DeployConfigError("monitor: etcd is not installed (Debian's etcd-server; "
                                    "scripts/setup.sh installs it)")
        return MonitorPlan(ETCD)
    try:
        spec = parse_monitor(value, embedded_ok=False)
    except ValueError as exc:
        raise DeployConfigError(f"monitor: {exc} (or standalone, etcd)") from None
    return MonitorPlan("existing", spec.url)


def _expert_servers(value: Any, info: MoeModelInfo) -> tuple[tuple[ServerPlan, ...],
                                                             tuple[str, ...]]:
    where = "expert_servers"
    section = _fields(where, value, {"count", "replicas", "placement", "experts", "standby",
                                     "args"})
    given = [k for k in ("count", "placement", "experts") if k in section]
    if len(given) > 1:
        raise DeployConfigError(f"{where}: give one of count, placement and experts, not "
                                f"{' and '.join(given)}")
    if "replicas" in section and given and given[0] != "count":
        raise DeployConfigError(f"{where}.replicas: goes with count, not with {given[0]}")
    args = _args(f"{where}.args", section.get("args", []))
    if "placement" in section:
        servers = _placement_file(section["placement"], info)
    elif "experts" in section:
        servers = _expert_lists(section["experts"], info)
    else:
        count = _positive(f"{where}.count", section.get("count", 2))
        replicas = _positive(f"{where}.replicas", section.get("replicas", 1))
        if count > info.num_experts:
            raise DeployConfigError(f"{where}.count: {count} servers for {info.num_experts} "
                                    "experts would leave a server without one")
        if replicas > count:
            raise DeployConfigError(f"{where}.replicas: {replicas} copies of each expert need "
                                    f"at least {replicas} servers, count is {count}")
        blocks = even_placement(info.num_experts, count)
        # server i holds blocks i, i+1, ..., i+replicas-1: every expert on `replicas` servers
        servers = tuple(ServerPlan(f"expert-server-{i}", sorted(
            e for r in range(replicas) for e in blocks[(i + r) % count])) for i in range(count))
    standby = section.get("standby", 0)
    if type(standby) is not int or not 0 <= standby <= MAX_STANDBY:
        raise DeployConfigError(f"{where}.standby: must be a whole number of standby servers, "
                                f"0-{MAX_STANDBY}, got {_kind(standby)}")
    servers += tuple(ServerPlan(f"expert-server-{len(servers) + i}", [], standby=True)
                     for i in range(standby))
    return servers, args


def _placement_file(value: Any, info: MoeModelInfo) -> tuple[ServerPlan, ...]:
    where = "expert_servers.placement"
    if not isinstance(value, str) or not value:
        raise DeployConfigError(f"{where}: must be a placement file's path, got {_kind(value)}")
    try:
        placement = load_placement_file(Path(value).expanduser())
        _covers(placement.holdings(info.moe_layers, info.num_experts), info)
    except PlacementError as exc:
        raise DeployConfigError(f"{where}: {exc}") from None
    return tuple(ServerPlan(f"expert-server-{i}", experts,
                            None if name.startswith("local:") else name)
                 for i, (name, experts) in enumerate(placement.entries.items()))


def _expert_lists(value: Any, info: MoeModelInfo) -> tuple[ServerPlan, ...]:
    where = "expert_servers.experts"
    if not isinstance(value, list) or not value:
        raise DeployConfigError(f"{where}: must be a non-empty list of expert lists such as "
                                f"'0-15', one per server, got {_kind(value)}")
    servers = []
    for i, spec in enumerate(value):
        if not isinstance(spec, (str, int)) or isinstance(spec, bool):
            raise DeployConfigError(f"{where}[{i}]: must be an expert list such as '0-3,6', got "
                                    f"{_kind(spec)}")
        try:
            ids = parse_expert_list(str(spec), info.num_experts)
            if ids[-1] >= info.num_experts:
                raise PlacementError(f"expert {ids[-1]} does not exist: the model has "
                                     f"{info.num_experts}")
        except PlacementError as exc:
            raise DeployConfigError(f"{where}[{i}]: {exc}") from None
        servers.append(ServerPlan(f"expert-server-{i}", ids))
    try:
        _covers(Holdings.uniform({s.name: s.experts for s in servers}, info.moe_layers), info)
    except PlacementError as exc:
        raise DeployConfigError(f"{where}: {exc}") from None
    return tuple(servers)


def _covers(holdings: Holdings, info: MoeModelInfo) -> None:
    """``PlacementError`` unless every expert of every MoE layer has a server."""
    RoutingTable.build(0, holdings, list(info.moe_layers), info.num_experts)


def _sglang(value: Any) -> SGLangPlan:
    where = "sglang"
    section = _fields(where, value, {"args", "eaas", "plain", "prefill", "decode",
                                     "transfer_backend"})
    eaas = section.get("eaas", True)
    if not isinstance(eaas, bool):
        raise DeployConfigError(f"{where}.eaas: must be true or false, got {_kind(eaas)}")
    args = _args(f"{where}.args", section.get("args", []), own="sglang")
    pd = [k for k in ("prefill", "decode") if k in section]
    if pd and "plain" in section:
        raise DeployConfigError(f"{where}.plain: give plain instances or prefill and decode "
                                "instances, not both")
    if len(pd) == 1:
        other = "decode" if pd == ["prefill"] else "prefill"
        raise DeployConfigError(f"{where}.{other}: a PD deployment needs {other} instances too")
    modes = pd or ["plain"]
    instances = tuple(_instances(f"{where}.{m}", m, section.get(m, {})) for m in modes)
    backend = section.get("transfer_backend", "mooncake_tcp")
    if "transfer_backend" in section and not pd:
        raise DeployConfigError(f"{where}.transfer_backend: only PD instances (prefill and "
                                "decode) transfer KV; remove it or add them")
    if not isinstance(backend, str) or not backend:
        raise DeployConfigError(f"{where}.transfer_backend: must be a name such as "
                                f"mooncake_tcp, got {_kind(backend)}")
    dtypes = {last_value([*args, *group.args], "--dtype") for group in instances}
    if eaas and len(dtypes) > 1:
        raise DeployConfigError(f"{where}: the instances are given different --dtype values "
                                f"({', '.join(sorted(map(str, dtypes)))}) but the expert "
                                f"servers hold one; give --dtype once in {where}.args")
    return SGLangPlan(args, eaas, instances, backend, dtypes.pop())


class _Complaint(Exception):
    """What SGLang's parser says is wrong."""


class _Parser(argparse.ArgumentParser):
    """SGLang's parser, raising its complaint instead of printing usage and exiting."""

    def error(self, message: str):
        raise _Complaint(message)


@functools.cache
def sglang_parser() -> argparse.ArgumentParser:
    """``python -m sglang.launch_server``'s parser: SGLang's ``ServerArgs.add_cli_args`` with
    the plugin's ``--eaas`` group, raising ``_Complaint`` where SGLang would exit."""
    with warnings.catch_warnings():  # SGLang's import warns of GPU-only kernels on CPU hosts
        warnings.simplefilter("ignore")
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import ServerArgs

        load_plugins()  # idempotent: the plugin's hooks (its option group) in this process
        parser = _Parser(prog="sglang.launch_server", add_help=False)
        ServerArgs.add_cli_args(parser)
    return parser


def sglang_choices(flag: str) -> list[str] | None:
    """The values SGLang's parser allows for ``flag`` (None: any, or no such flag)."""
    for action in sglang_parser()._actions:
        if flag in action.option_strings:
            return None if action.choices is None else list(action.choices)
    return None


def _as_sglang_reads_it(model: Path, plan: SGLangPlan) -> None:
    """``DeployConfigError`` for what SGLang's own parser refuses in the instances' flags and
    the transfer backend. Flags it does not know are left to SGLang's launch (its message names
    them)."""
    if plan.pd:
        where = "sglang.transfer_backend"
        choices = sglang_choices("--disaggregation-transfer-backend")
        if choices is not None and plan.transfer_backend not in choices:
            raise DeployConfigError(f"{where}: {plan.transfer_backend!r} is not one of SGLang's "
                                    f"transfer backends ({', '.join(choices)})")
    lists = [("sglang.args", plan.args)] + [(f"sglang.{group.mode}.args", group.args)
                                            for group in plan.instances]
    for where, args in lists:
        if not args:
            continue
        try:
            sglang_parser().parse_known_args(["--model-path", str(model), *args])
        except _Complaint as exc:
            raise DeployConfigError(f"{where}: SGLang's parser refuses it: "
                                    f"{str(exc).removeprefix('argument ')}") from None


def _instances(where: str, mode: str, value: Any) -> Instances:
    section = _fields(where, value or {}, {"count", "args"})
    return Instances(mode, _positive(f"{where}.count", section.get("count", 1)),
                     _args(f"{where}.args", section.get("args", []), own="sglang"))


def _router(value: Any) -> RouterPlan:
    section = _fields("router", value, {"host", "port", "args"})
    host = section.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise DeployConfigError(f"router.host: must be an address such as 127.0.0.1, got "
                                f"{_kind(host)}")
    port = section.get("port", 0)
    if type(port) is not int or not 0 <= port <= 65535:
        raise DeployConfigError(f"router.port: must be a port number in 1-65535 (0 or absent: "
                                f"a free one), got {_kind(port)}")
    return RouterPlan(host, port, _args("router.args", section.get("args", [])))


# -- fields -----------------------------------------------------------------------------------
def _fields(where: str, value: Any, known: set[str], required: tuple[str, ...] = ()
            ) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise DeployConfigError(f"{where}: must be a mapping of {', '.join(sorted(known))}, "
                                f"got {_kind(value)}")
    for key in value:
        if key not in known:
            path = f"{where}.{key}" if where else str(key)
            raise DeployConfigError(f"{path}: unknown field (known here: "
                                    f"{', '.join(sorted(known))})")
    for key in required:
        if key not in value:
            raise DeployConfigError(f"{key}: required field is missing")
    return value


def _positive(where: str, value: Any) -> int:
    if type(value) is not int or value < 1:
        raise DeployConfigError(f"{where}: must be a positive integer, got {_kind(value)}")
    return value


def _args(where: str, value: Any, own: str | None = None) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(
            isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in value):
        raise DeployConfigError(f"{where}: must be a list of command-line arguments (strings), "
                                f"got {_kind(value)}")
    args = tuple(str(a) for a in value)
    for arg in args:
        flag = arg.split("=", 1)[0]
        owned = OWN_FLAGS[own or where]
        if flag in owned:
            instead = owned[flag]
            raise DeployConfigError(f"{where}: {flag} is set by the deployment itself"
                                    + (f"; use {instead}" if instead else "; remove it"))
    return args


def last_value(args: list[str] | tuple[str, ...], flag: str) -> str | None:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``args``."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _kind(value: Any) -> str:
    """How a bad value reads in a sentence."""
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__} ({value!r:.60})"
    return "nothing" if value is None else repr(value)
