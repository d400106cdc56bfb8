"""The expert tier's admin API on SGLang's HTTP server (docs/elastic.md, "Admin API").

Added to SGLang's FastAPI app in the HTTP server's process (BEFORE
``_setup_and_run_http_server``) when ``--eaas`` is on. Every route asks for the tier's shared
token in the ``X-Eaas-Token`` header (``SGLANG_EAAS_TOKEN``; SGLang's own ``--api-key``, where
set, is checked by SGLang as for any route):

    GET  /eaas/tier                  the active and standby servers, what each holds, the
                                     operation in flight (or the last one)
    POST /eaas/scale {"servers": N, "id": ID}
                                     resize to N active servers in the background; 202 with
                                     the operation, or 200 with the known one when ID was
                                     seen before (a retried request is a no-op); 409 while
                                     another operation runs
    GET  /eaas/operations/{id}       one operation's state: running | done | failed
    POST /eaas/autoscale {"direction": "out"|"in", "reason": ..., "min_servers": m,
                          "max_servers": M, "act": "resize"|"publish", ...}
                                     the scheduler's autoscaler (client/autoscale_hooks.py):
                                     the desired count (active +- 1 within [m, M]) is
                                     recorded and published (GET /eaas/tier), and with
                                     "resize" an operation started; answers
                                     {"desired", "active", "operation"}

A resize takes standby servers first; where the tier's servers are this launcher's children
(``local:N``), it starts more as children too (``LocalLauncher``), else it only takes standby
servers (an orchestrator starts them: docs/elastic.md, "Launchers").
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse

from sglang_eaas import envs
from sglang_eaas.config import EaasConfig
from sglang_eaas.elastic.autoscaler import ACTS
from sglang_eaas.elastic.operations import TOKEN_HEADER, OperationConflict, Operations
from sglang_eaas.elastic.resize import Resizer, active_and_standby
from sglang_eaas.launcher.local_servers import LocalLauncher
from sglang_eaas.model_info import MoeModelInfo

logger = logging.getLogger(__name__)


class TierAdmin:
    """The admin API's state: one ``Resizer`` over the tier, its operations."""

    def __init__(self, resizer: Resizer, launcher: LocalLauncher | None):
        self.resizer, self.launcher = resizer, launcher
        self.operations = Operations(resizer.resize)
        self.autoscale: dict[str, Any] | None = None  # the autoscaler's last decision
        self._decisions = 0

    def decide(self, decision: dict[str, Any]) -> dict[str, Any]:
        """The autoscaler's decision: the desired count, and a resize where it acts."""
        active = len(active_and_standby(self.resizer.snapshot(), self.resizer.fingerprint)[0])
        step = 1 if decision["direction"] == "out" else -1
        desired = min(max(active + step, decision["min_servers"]), decision["max_servers"])
        op = None
        if decision["act"] == "resize" and desired != active:
            self._decisions += 1
            try:
                op = self.operations.start(desired, f"autoscale-{self._decisions}",
                                          f"autoscaler: {decision['reason']}").to_json()
            except OperationConflict as exc:
                logger.info("sglang-eaas autoscaler: not resizing now: %s", exc)
        self.autoscale = {**decision, "desired": desired, "active": active, "at": time.time()}
        logger.info("sglang-eaas autoscaler: scale %s -> desired %d active expert servers (%d "
                    "now): %s", decision["direction"], desired, active, decision["reason"])
        return {"desired": desired, "active": active, "operation": op}

    def tier(self) -> dict[str, Any]:
        snapshot = self.resizer.snapshot()
        active, standby = active_and_standby(snapshot, self.resizer.fingerprint)
        held = snapshot.holdings(self.resizer.fingerprint)
        current = self.operations.current
        return {"monitor": self.resizer.monitor, "active": active, "standby": standby,
                "experts": {s: {str(layer): list(ids) for layer, ids in held[s].items()}
                            for s in active},
                "launcher": "local processes" if self.launcher else "none (standby only)",
                "operation": current.to_json() if current else None,
                "autoscale": self.autoscale}


def install_routes(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``_setup_and_run_http_server``: the admin routes on SGLang's app, with --eaas."""
    cfg = getattr(server_args, "_eaas", None)
    if cfg is not None:
        from sglang.srt.entrypoints import http_server

        install(http_server.app, cfg, server_args.model_path)


def install(app: Any, cfg: EaasConfig, model_path: str) -> TierAdmin:
    """Add the routes to ``app`` for the tier ``cfg`` (the launcher's prepared config); where
    the launcher started the servers, a ``LocalLauncher`` starts more alike (``cfg.spawn``)."""
    info = MoeModelInfo.from_model_path(model_path)
    spawn = cfg.spawn
    launcher = (LocalLauncher(model_path, cfg.monitor, spawn.dtype, spawn.max_clients,
                              spawn.flags) if spawn is not None else None)
    admin = TierAdmin(Resizer(cfg.monitor, envs.TOKEN.get(), info.num_experts, launcher,
                              info.fingerprint()), launcher)

    def refused(request: Request) -> JSONResponse | None:
        given = request.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), envs.TOKEN.get().encode()):
            return JSONResponse({"error": f"the admin API needs the tier's token in the "
                                          f"{TOKEN_HEADER} header"}, status_code=401)
        return None

    async def tier(request: Request):
        return refused(request) or JSONResponse(await asyncio.to_thread(admin.tier))

    async def scale(request: Request):
        if (no := refused(request)) is not None:
            return no
        body = await _body(request)
        servers, op_id = body.get("servers"), body.get("id", "")
        if type(servers) is not int or servers < 1 or not isinstance(op_id, str):
            return JSONResponse({"error": 'the body is {"servers": N >= 1, "id": "optional '
                                          'operation id"}'}, status_code=400)
        known = admin.operations.get(op_id) if op_id else None
        try:
            op = admin.operations.start(servers, op_id, "admin API")
        except OperationConflict as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        return JSONResponse(op.to_json(), status_code=200 if known else 202)

    async def operation(request: Request, op_id: str):
        if (no := refused(request)) is not None:
            return no
        op = admin.operations.get(op_id)
        if op is None:
            return JSONResponse({"error": f"no operation {op_id}"}, status_code=404)
        return JSONResponse(op.to_json())

    async def autoscale(request: Request):
        if (no := refused(request)) is not None:
            return no
        body = await _body(request)
        ok = (body.get("direction") in ("out", "in")
              and isinstance(body.get("reason"), str) and body.get("act") in ACTS
              and all(type(body.get(k)) is int and body[k] >= 1
                      for k in ("min_servers", "max_servers")))
        if not ok:
            return JSONResponse({"error": "the body is the autoscaler's decision: direction "
                                          "out|in, reason, min_servers, max_servers, act"},
                                status_code=400)
        return JSONResponse(await asyncio.to_thread(admin.decide, body))

    app.add_api_route("/eaas/autoscale", autoscale, methods=["POST"])
    app.add_api_route("/eaas/tier", tier, methods=["GET"])
    app.add_api_route("/eaas/scale", scale, methods=["POST"])
    app.add_api_route("/eaas/operations/{op_id}", operation, methods=["GET"])
    logger.info("sglang-eaas: admin API on /eaas/tier, /eaas/scale (%s)",
                "local launcher" if launcher else "standby servers only")
    return admin


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object ({} when it is not one)."""
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
