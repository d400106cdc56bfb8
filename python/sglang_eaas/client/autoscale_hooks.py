"""``--eaas-autoscale``: the autoscaler in SGLang's scheduler (attention rank 0).

AFTER ``SchedulerOutputStreamer.stream_output``, which sees every request's outputs as the
scheduler produces them: a request's time to first token is from its entry into the waiting
queue (``time_stats.wait_queue_entry_time``, stamped whether or not metrics are on) to the
first call that streams an output token of it, its time per output token the rest of its
time over its other tokens. Finished requests feed ``elastic.autoscaler.Autoscaler``, whose
windows a thread of its own judges (an idle scheduler streams nothing, and idle windows are
what scale a tier in), with the expert servers' utilisation read from the tier's monitor
(``elastic/tier_busy.py``); a decision is sent from that thread to the admin API of this SGLang's
HTTP server (``POST /eaas/autoscale``), which turns it into a server count within the bounds
and, with ``--eaas-autoscale-act resize``, resizes the tier (``publish``: an orchestrator acts
on the published count). Every decision is logged with its reason; with ``--enable-metrics``,
``/metrics`` shows the last window's attainment, pressure and expert servers' utilisation,
the decisions, and the desired
and active server counts the admin API answered.

With data parallelism only the first DP rank's requests are judged (each DP rank schedules its
own); that rank's load stands for the others'.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.request
from typing import Any, Callable

from sglang_eaas import envs
from sglang_eaas.client.metrics import OptionalMetrics
from sglang_eaas.elastic.autoscaler import Autoscaler, Decision, TierBusy
from sglang_eaas.elastic.tier_busy import TierBusySampler
from sglang_eaas.membership import current_snapshot
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.protocol.operations import TOKEN_HEADER

logger = logging.getLogger(__name__)
ADMIN_TIMEOUT = 30.0


class SchedulerAutoscaler:
    """One scheduler's request timings, its ``Autoscaler`` and what it publishes."""

    def __init__(self, cfg: Any, url: str, tier_busy: Callable[[], TierBusy | None]):
        self.cfg, self.url = cfg.autoscale, url
        self.scaler = Autoscaler(self.cfg.policy, tier_busy=tier_busy,
                                 bounds=(self.cfg.min_servers, self.cfg.max_servers))
        self.first_token: dict[str, float] = {}
        self.metrics = _Metrics.create()
        # windows are judged on a thread of their own: an idle scheduler streams nothing,
        # and an idle window is what scales a tier in
        threading.Thread(target=self._judge_windows, name="eaas-autoscaler",
                         daemon=True).start()

    def stream_output(self, reqs: list, skip_req: Any = None) -> None:
        now = time.perf_counter()
        for req in reqs:
            if req is skip_req:
                continue
            tokens = len(req.output_ids)
            if tokens and req.rid not in self.first_token:
                self.first_token[req.rid] = now
            if req.finished():
                stats = req.time_stats
                began = stats.wait_queue_entry_time or stats.scheduler_recv_time or now
                first = self.first_token.pop(req.rid, now)
                self.scaler.finished(first - began, (now - first) / max(tokens - 1, 1))

    def _judge_windows(self) -> None:
        period = min(1.0, self.cfg.policy.window / 4)
        held = ""  # said once while it lasts
        while True:
            time.sleep(period)
            decision = self.scaler.tick()
            window = self.scaler.last_window
            if window is not None and self.metrics is not None:
                self.metrics.window(window)
            if self.scaler.held_by and self.scaler.held_by != held:
                logger.info("eaas autoscaler: %s", self.scaler.held)
            held = self.scaler.held_by
            if decision is not None:
                logger.info("eaas autoscaler: scale %s: %s", decision.direction,
                            decision.reason)
                self._publish(decision)

    def _publish(self, decision: Decision) -> None:
        body = {"direction": decision.direction, "reason": decision.reason,
                "attainment": decision.window.attainment, "pressure": decision.window.pressure,
                "min_servers": self.cfg.min_servers, "max_servers": self.cfg.max_servers,
                "act": self.cfg.act}
        request = urllib.request.Request(
            f"{self.url}/eaas/autoscale", data=json.dumps(body).encode(), method="POST",
            headers={TOKEN_HEADER: envs.TOKEN.get(), "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT) as reply:
                answer = json.loads(reply.read())
        except (OSError, ValueError) as exc:
            logger.warning("eaas autoscaler: the admin API did not take the decision: %s", exc)
            return
        logger.info("eaas autoscaler: desired %s active expert servers (%s active now)%s",
                    answer.get("desired"), answer.get("active"),
                    f"; operation {answer['operation']['id']}" if answer.get("operation")
                    else "")
        if self.metrics is not None:
            self.metrics.decided(decision, answer)


class _Metrics(OptionalMetrics):
    """The autoscaler's gauges in SGLang's ``/metrics`` (``--enable-metrics``)."""

    def __init__(self):
        from prometheus_client import Counter, Gauge

        gauge = dict(multiprocess_mode="livemostrecent")
        self._attainment = Gauge("sglang_eaas_autoscale_attainment", "SLO attainment of the "
                                 "autoscaler's last window of finished requests", **gauge)
        self._pressure = Gauge("sglang_eaas_autoscale_pressure", "The last window's p90 "
                               "latencies over their targets (the larger of TTFT and TPOT)",
                               **gauge)
        self._busy = Gauge("sglang_eaas_autoscale_expert_busy", "The active expert servers' "
                           "mean utilisation (share of time serving batches) in the last window",
                           **gauge)
        self._desired = Gauge("sglang_eaas_autoscale_desired_servers", "Active expert servers "
                              "the autoscaler last asked for", **gauge)
        self._active = Gauge("sglang_eaas_autoscale_active_servers", "Active expert servers "
                             "when the autoscaler last decided", **gauge)
        self._decisions = Counter("sglang_eaas_autoscale_decisions", "Autoscaler decisions",
                                  ["direction"])

    def window(self, window) -> None:
        self._attainment.set(window.attainment)
        self._pressure.set(window.pressure)
        if window.busy is not None:
            self._busy.set(window.busy.utilisation)

    def decided(self, decision: Decision, answer: dict) -> None:
        self._decisions.labels(direction=decision.direction).inc()
        if isinstance(answer.get("desired"), int):
            self._desired.set(answer["desired"])
        if isinstance(answer.get("active"), int):
            self._active.set(answer["active"])


_ONE: dict[int, SchedulerAutoscaler | None] = {}  # per streamer object


def after_stream_output(result: Any, streamer: Any, reqs: list, return_logprob: bool,
                        skip_req: Any = None, *args: Any, **kwargs: Any) -> None:
    """AFTER ``SchedulerOutputStreamer.stream_output``: feed the autoscaler (rank 0 only)."""
    key = id(streamer)
    if key not in _ONE:
        _ONE[key] = _make(streamer.server_args)
    scaler = _ONE[key]
    if scaler is not None:
        scaler.stream_output(reqs, skip_req)


def _make(server_args: Any) -> SchedulerAutoscaler | None:
    cfg = getattr(server_args, "_eaas", None)
    if cfg is None or cfg.autoscale is None:
        return None
    from sglang.srt.runtime_context import get_parallel

    if _rank(get_parallel(), "attn_tp_rank") or _rank(get_parallel(), "attn_dp_rank"):
        return None
    logger.info("eaas autoscaler: judging SLO attainment every %gs (TTFT <= %gs, TPOT <= %gs, "
                "%.0f%% of requests)", cfg.autoscale.policy.window, cfg.autoscale.policy.ttft,
                cfg.autoscale.policy.tpot, 100 * cfg.autoscale.policy.attainment)
    return SchedulerAutoscaler(cfg, server_args.url(), _tier_busy(cfg, server_args.model_path))


def _tier_busy(cfg: Any, model_path: str) -> Callable[[], TierBusy | None]:
    """The expert servers' utilisation, from the tier's monitor (unknown without one here)."""
    if not isinstance(cfg.monitor, str):
        return lambda: None
    monitor, token = cfg.monitor, envs.TOKEN.get()
    return TierBusySampler(lambda: current_snapshot(monitor, token),
                           MoeModelInfo.from_model_path(model_path).fingerprint())


def _rank(parallel: Any, name: str) -> int:
    """A rank SGLang's parallel context may not have written in this process: 0 then."""
    try:
        return int(getattr(parallel, name))
    except (AttributeError, RuntimeError, ValueError, TypeError):
        return 0
