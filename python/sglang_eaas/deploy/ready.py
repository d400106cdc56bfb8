"""Whether each part of a deployment serves yet: one check per kind of part, each returning None
once ready or a few words on what it still waits for (the progress lines show them)."""

from __future__ import annotations

import requests

from ibgda import TransportError
from sglang_eaas.membership import current_snapshot
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.monitor import SERVING
from sglang_eaas.routing_table import uncovered

PROBE_PROMPT = "def main():"


def monitor(url: str, token: str) -> str | None:
    """A monitor (standalone or etcd) answers a snapshot with this token."""
    try:
        current_snapshot(url, token)
    except (TransportError, OSError) as exc:
        return f"the monitor at {url} ({_short(exc)})"
    except Exception as exc:  # etcd's client raises its own errors while etcd starts
        return f"the monitor at {url} ({type(exc).__name__})"
    return None


def expert_tier(url: str, token: str, addresses: list[str], info: MoeModelInfo) -> str | None:
    """Every server started is registered and serving at the monitor, and every expert of
    every MoE layer has a live holder."""
    try:
        snapshot = current_snapshot(url, token)
    except (TransportError, OSError) as exc:
        return f"the monitor at {url} ({_short(exc)})"
    serving = {m.id for m in snapshot.servers(info.fingerprint()) if m.status == SERVING}
    waiting = [a for a in addresses if a not in serving]
    if waiting:
        return f"expert servers {', '.join(waiting)} to register"
    holdings = snapshot.holdings(info.fingerprint()).model_experts(info.num_experts)
    missing = uncovered(holdings, list(info.moe_layers), info.num_experts)
    return f"a live holder for {missing}" if missing else None


def http_ok(url: str, path: str, timeout: float = 30.0) -> bool:
    """``GET url+path`` answers 200 (``/health_generate`` runs one token through SGLang)."""
    try:
        return requests.get(url + path, timeout=timeout).status_code == 200
    except requests.RequestException:
        return False


def etcd(url: str) -> str | None:
    http = "http://" + url.removeprefix("etcd://")
    try:
        if requests.get(http + "/health", timeout=5).json().get("health") == "true":
            return None
    except (requests.RequestException, ValueError):
        pass
    return f"etcd at {http}"


def router(url: str) -> str | None:
    """The router is healthy and a real request through it generates tokens."""
    if not http_ok(url, "/health", timeout=10):
        return f"the router at {url} (/health)"
    body = {"text": PROBE_PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
    try:
        reply = requests.post(url + "/generate", json=body, timeout=300)
    except requests.RequestException as exc:
        return f"a first /generate through the router ({_short(exc)})"
    if reply.status_code != 200:
        return f"a first /generate through the router (HTTP {reply.status_code})"
    return None


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
