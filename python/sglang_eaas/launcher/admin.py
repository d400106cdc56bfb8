"""The expert tier's admin API on SGLang's HTTP server (docs/elastic.md, "Admin API").

Added to SGLang's FastAPI app in the HTTP server's process (BEFORE
``_setup_and_run_http_server``) when ``--eaas`` is on. Every route asks for the tier's shared
token in the ``X-Eaas-Token`` header (``SGLANG_EAAS_TOKEN``; SGLang's own ``--api-key``, where
set, is checked by SGLang as for any route). Every change is an operation of the tier
controller (``controller/``): one at a time in the whole tier, whichever instance or tool asks,
recorded in the monitor, so any instance answers for any operation.

    GET  /eaas/tier                  the active and standby servers, what each holds, the
                                     operation holding the tier (or the latest one)
    POST /eaas/scale {"servers": N, "id": ID, "wait": S}
    POST /eaas/scale {"retire": [ADDRESS, ...], "servers": N | "replace": true, "id": ID,
                      "wait": S}
                                     resize to N active servers, or retire the named servers
                                     (N: what stays active, by default the active count less
                                     the retired; standby servers fill the difference; with
                                     "replace", the active count as far as standby servers
                                     can take the retired ones' place), in the
                                     background; 202 with the operation, 200 with the known one
                                     when ID was seen before (a retried request is a no-op);
                                     400 with one sentence for a request out of bounds
                                     (controller/bounds.py); 409 naming the running operation
                                     while another holds the tier (after waiting up to S
                                     seconds for it, where given)
    GET  /eaas/operations            the latest operations, newest first
    GET  /eaas/operations/{id}       one operation: pending | running | done | failed |
                                     rolled_back, its result and end state
    POST /eaas/autoscale {"direction": "out"|"in", "reason": ..., "min_servers": m,
                          "max_servers": M, "act": "resize"|"publish", ...}
                                     the scheduler's autoscaler (client/autoscale_hooks.py):
                                     the desired count (active +- 1 within [m, M] and the
                                     bounds) is recorded and published (GET /eaas/tier), and
                                     with "resize" an operation started; answers
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
import uuid
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the handlers' annotations here
from fastapi.responses import JSONResponse

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.config import EaasConfig
from sglang_eaas.controller.bounds import Refusal, check_resize, placement_limit
from sglang_eaas.controller.controller import (
    Busy, Ended, Held, Known, RolledBack, TierController, requester_name,
)
from sglang_eaas.controller.end_state import read_end_state
from sglang_eaas.elastic.autoscaler import ACTS
from sglang_eaas.elastic.resize import Resizer
from sglang_eaas.launcher.local_servers import LocalLauncher
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.lines import ControlError, Refused
from sglang_eaas.protocol.operations import MAX_WAIT, RESIZE, RETIRE, TOKEN_HEADER, check_id

logger = logging.getLogger(__name__)


class TierAdmin:
    """The admin API's state: the tier controller's client and a ``Resizer`` over the tier."""

    def __init__(self, resizer: Resizer, launcher: LocalLauncher | None,
                 controller: TierController, max_servers: int | None = None):
        self.resizer, self.launcher, self.controller = resizer, launcher, controller
        self.max_servers = max_servers
        self.autoscale: dict[str, Any] | None = None  # the autoscaler's last decision

    def _check(self, servers: int, retire: list[str]) -> None:
        check_resize(servers, self.resizer.snapshot(), self.resizer.fingerprint,
                     self.resizer.num_experts, self.max_servers, self.launcher is not None,
                     retire)

    def target(self, servers: int | None, retire: list[str], replace: bool = False
               ) -> tuple[str, dict[str, Any]]:
        """The operation's kind and target for a request (``replace``: a retirement keeps the
        active count where standby servers can take the retired ones' place); ``Refusal`` out
        of bounds."""
        active, standby = self.resizer.snapshot().active_and_standby(self.resizer.fingerprint)
        if servers is None:
            staying = len([s for s in active if s not in retire])
            spare = len([s for s in standby if s not in retire])
            servers = min(len(active), staying + spare) if replace else staying
        self._check(servers, retire)
        target = {"servers": servers, "fingerprint": self.resizer.fingerprint,
                  "num_experts": self.resizer.num_experts}
        return (RETIRE, {**target, "retire": list(retire)}) if retire else (RESIZE, target)

    def start(self, kind: str, target: dict[str, Any], op_id: str, wait: float,
              controller: TierController | None = None):
        """The operation started in the background (``Busy``, ``Known`` as
        ``TierController.start``)."""
        return (controller or self.controller).start(kind, target, self._resize, op_id, wait)

    def _resize(self, held: Held) -> Ended:
        """An operation's body: checked again under the lease, then resized, then read back."""
        target = held.record.target
        retire = list(target.get("retire", ()))
        self._check(target["servers"], retire)
        held.note(_before=self.resizer.active())
        said, self.resizer.say = self.resizer.say, held.progress
        try:
            done = self.resizer.resize(target["servers"], retire, held.fence)
        finally:
            self.resizer.say = said
        end = read_end_state(self.resizer.monitor, self.resizer.token, self.resizer.fingerprint)
        if done.rolled_back:
            raise RolledBack(done.summary(), end)
        return Ended(done.summary(), end)

    def decide(self, decision: dict[str, Any]) -> dict[str, Any]:
        """The autoscaler's decision: the desired count, and a resize where it acts."""
        snapshot = self.resizer.snapshot()
        active = len(snapshot.active_and_standby(self.resizer.fingerprint)[0])
        step = 1 if decision["direction"] == "out" else -1
        high = min(decision["max_servers"], self.max_servers or decision["max_servers"],
                   placement_limit(snapshot.holdings(self.resizer.fingerprint),
                                   self.resizer.num_experts))
        desired = max(min(active + step, high), decision["min_servers"])
        op = None
        if decision["act"] == "resize" and desired != active:
            try:
                kind, target = self.target(desired, [])
                op = self.start(kind, target, f"autoscale-{uuid.uuid4().hex[:8]}", 0.0,
                                self.autoscaler).to_message()
            except (Busy, Refusal, TransportError) as exc:
                logger.info("sglang-eaas autoscaler: not resizing now: %s", exc)
        self.autoscale = {**decision, "desired": desired, "active": active, "at": time.time()}
        logger.info("sglang-eaas autoscaler: scale %s -> desired %d active expert servers (%d "
                    "now): %s", decision["direction"], desired, active, decision["reason"])
        return {"desired": desired, "active": active, "operation": op}

    @property
    def autoscaler(self) -> TierController:
        """The controller's client as the autoscaler (its operations say so)."""
        c = self.controller
        return TierController(c.monitor, c.token, c.requester.replace("admin API", "autoscaler",
                                                                      1), c.ttl, c.say)

    def tier(self) -> dict[str, Any]:
        snapshot = self.resizer.snapshot()
        active, standby = snapshot.active_and_standby(self.resizer.fingerprint)
        held = snapshot.holdings(self.resizer.fingerprint)
        listed = self.controller.operations(1)
        current = listed.running() or (listed.operations[0] if listed.operations else None)
        return {"monitor": self.resizer.monitor, "active": active, "standby": standby,
                "experts": {s: {str(layer): list(ids) for layer, ids in held[s].items()}
                            for s in active},
                "launcher": "local processes" if self.launcher else "none (standby only)",
                "max_servers": min(self.max_servers or 1 << 30,
                                   placement_limit(held, self.resizer.num_experts)),
                "operation": current.to_message() if current else None,
                "autoscale": self.autoscale}


def install_routes(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``_setup_and_run_http_server``: the admin routes on SGLang's app, with --eaas."""
    cfg = getattr(server_args, "_eaas", None)
    if cfg is not None:
        from sglang.srt.entrypoints import http_server

        install(http_server.app, cfg, server_args.model_path,
                f"{server_args.host}:{server_args.port}")


def install(app: Any, cfg: EaasConfig, model_path: str, where: str = "") -> TierAdmin:
    """Add the routes to ``app`` for the tier ``cfg`` (the launcher's prepared config); where
    the launcher started the servers, a ``LocalLauncher`` starts more alike (``cfg.spawn``)."""
    info = MoeModelInfo.from_model_path(model_path)
    spawn = cfg.spawn
    launcher = (LocalLauncher(model_path, cfg.monitor, spawn.dtype, spawn.max_clients,
                              spawn.flags) if spawn is not None else None)
    token = envs.TOKEN.get()
    controller = TierController(str(cfg.monitor), token,
                                requester_name(f"admin API of SGLang {where}".strip()))
    admin = TierAdmin(Resizer(cfg.monitor, token, info.num_experts, launcher,
                              info.fingerprint()), launcher, controller, cfg.max_servers)

    def refused(request: Request) -> JSONResponse | None:
        given = request.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"error": f"the admin API needs the tier's token in the "
                                          f"{TOKEN_HEADER} header"}, status_code=401)
        return None

    def error(status: int, sentence: str, **more: Any) -> JSONResponse:
        return JSONResponse({"error": sentence, **more}, status_code=status)

    async def tier(request: Request):
        if (no := refused(request)) is not None:
            return no
        try:
            return JSONResponse(await asyncio.to_thread(admin.tier))
        except TransportError as exc:
            return error(503, f"the tier's monitor cannot be read: {exc}")

    def scale_now(body: dict[str, Any]) -> JSONResponse:
        servers, retire = body.get("servers"), body.get("retire", [])
        op_id, wait = body.get("id", "") or f"op-{uuid.uuid4().hex[:12]}", body.get("wait", 0)
        replace = body.get("replace", False)
        if not (isinstance(retire, list) and all(isinstance(a, str) for a in retire)
                and (servers is None and retire or type(servers) is int)
                and isinstance(op_id, str) and type(wait) in (int, float)
                and replace in (True, False) and not (replace and servers is not None)
                and 0 <= wait <= MAX_WAIT
                and set(body) <= {"servers", "retire", "replace", "id", "wait"}):
            return error(400, 'the body is {"servers": N >= 1} or {"retire": ["HOST:PORT", '
                              '...]} with "servers": N or "replace": true, and an optional '
                              f'"id" (an operation id) and "wait" (0-{MAX_WAIT:.0f} seconds)')
        try:
            check_id(op_id)
            kind, target = admin.target(servers, retire, replace)
            record = admin.start(kind, target, op_id, float(wait))
        except ControlError as exc:
            return error(400, str(exc))
        except Refusal as exc:
            return error(400, str(exc))
        except Known as exc:  # the same request again (another one under its id: Refused)
            return JSONResponse(exc.record.to_message(), status_code=200)
        except Busy as exc:
            return error(409, str(exc), running=exc.holder.to_message() if exc.holder else None)
        except Refused as exc:
            return error(409, str(exc))
        except TransportError as exc:
            return error(503, f"the tier's monitor cannot be reached: {exc}")
        return JSONResponse(record.to_message(), status_code=202)

    async def scale(request: Request):
        if (no := refused(request)) is not None:
            return no
        return await asyncio.to_thread(scale_now, await _body(request))

    async def operations(request: Request):
        if (no := refused(request)) is not None:
            return no
        try:
            listed = await asyncio.to_thread(controller.operations, 16)
        except TransportError as exc:
            return error(503, f"the tier's monitor cannot be read: {exc}")
        return JSONResponse(listed.to_message())

    async def operation(request: Request, op_id: str):
        if (no := refused(request)) is not None:
            return no
        try:
            check_id(op_id)
            record = await asyncio.to_thread(controller.get, op_id)
        except ControlError as exc:
            return error(400, str(exc))
        except TransportError as exc:
            return error(503, f"the tier's monitor cannot be read: {exc}")
        if record is None:
            return error(404, f"no operation {op_id} (the monitor keeps the latest 64)")
        return JSONResponse(record.to_message())

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
    app.add_api_route("/eaas/operations", operations, methods=["GET"])
    app.add_api_route("/eaas/operations/{op_id}", operation, methods=["GET"])
    logger.info("sglang-eaas: admin API on /eaas/tier, /eaas/scale, /eaas/operations (%s)",
                "local launcher" if launcher else "standby servers only")
    return admin


async def _body(request: Request) -> dict[str, Any]:
    """The request's JSON object ({} when it is not one)."""
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
