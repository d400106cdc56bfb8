"""``--eaas-balance reactive|predictive``: the balancer in the serving stack (attention rank 0;
docs/balancing.md, "In the serving stack").

A thread of rank 0's scheduler process looks at the tier every ``period`` seconds:

* the tier's holdings from the monitor (``balance/live.tier_holdings``) and every serving
  expert server's load counters (``balance/server_load``: read each look, kept for a horizon);
* the estimate: ``predictive``, the forecast of the next ``horizon`` seconds of decode load
  from the routing of the requests that started last (``balance/forecast.RoutingBook``, which
  this rank's client fills from each step's rows: ``client/steps.py``), the steps in it from
  the step time, plus the prefill entries of the prompts to come (``coming_prefill``: as many as the
  last horizon's); ``reactive``, the entries the servers computed over the last ``horizon``
  seconds;
* the decision (``balance/policy.BalancePolicy``) and, when it says so, the re-placement as one
  operation of the tier controller (``controller/rebalance.rebalance``), logged with its reason.

Both modes also judge the forecast made at the last look against the decode entries this rank
computed since (``load_overlap`` per MoE layer), and the reactive estimate the same way, so
``/metrics`` (``--enable-metrics``) compares the two on the same traffic, with the forecast's
cost per step.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import numpy as np

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.balance.forecast import RoutingBook, horizon_steps, load_overlap
from sglang_eaas.balance.known_futures import KnownFutures
from sglang_eaas.balance.live import fullest, plan, tier_holdings
from sglang_eaas.controller.rebalance import rebalance
from sglang_eaas.balance.policy import BalancePolicy, BalanceSettings
from sglang_eaas.balance.server_load import Counters, expert_load, read_counters, since
from sglang_eaas.client.metrics import OptionalMetrics
from sglang_eaas.controller.controller import Busy, TierController, requester_name
from sglang_eaas.membership import connect
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import PlacementError
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.operations import DONE
from sglang_eaas.routing_table import lenient_table

logger = logging.getLogger(__name__)
FAILURES = (TransportError, OSError, ValueError, ControlError, PlacementError, RuntimeError)


class TierBalancer:
    """Rank 0's looks at the tier and the re-placements they decide."""

    def __init__(self, settings: BalanceSettings, monitor: str, info: MoeModelInfo,
                 book: Callable[[], RoutingBook | None]):
        self.settings, self.monitor_url, self.info, self.book = settings, monitor, info, book
        self.token = envs.TOKEN.get()
        self.layers = tuple(info.moe_layers)
        self.policy = BalancePolicy(settings, self.layers)
        self.controller = TierController(monitor, self.token, requester_name(
            f"balancer (--eaas-balance {settings.mode}) of SGLang"), say=logger.info)
        self.metrics = _Metrics.create()
        self._reads: collections.deque[tuple[float, dict[str, Counters]]] = collections.deque()
        self._guesses: dict[str, np.ndarray] = {}  # the last look's estimates, judged next look
        self._said = ""
        self._last_why = ""
        self.known = None  # a measured bound's estimate (balance/known_futures.py), never serving
        if envs.BALANCE_KNOWN_FUTURES.get() and settings.mode == "predictive":
            self.known = KnownFutures.load(envs.BALANCE_KNOWN_FUTURES.get(),
                                           len(self.layers), info.num_experts)
            logger.warning("eaas balance: %s is set: the forecast knows the decode to come of "
                           "%d recorded requests (a measured bound, not serving)",
                           envs.BALANCE_KNOWN_FUTURES.name, len(self.known))
        threading.Thread(target=self._run, name="eaas-balance", daemon=True).start()

    def _run(self) -> None:
        monitor = None
        while True:
            time.sleep(self.settings.period)
            try:
                monitor = monitor or connect(self.monitor_url, self.token)
                self.look(monitor)
                self._said = ""
            except Exception as exc:  # noqa: BLE001 - the next look tries again, anew
                if str(exc) != self._said:
                    logger.warning("eaas balance: this look failed: %s", exc,
                                   exc_info=not isinstance(exc, FAILURES))
                    self._said = str(exc)
                if monitor is not None:
                    monitor.close()
                monitor = None

    def look(self, monitor) -> None:
        now = time.monotonic()
        current, num_experts = tier_holdings(monitor.watch(-1, 0.0))
        book = self.book()
        servers = sorted(current)
        read, _failed = read_counters(servers, self.token)
        self._reads.append((now, {c.server: c for c in read}))
        while len(self._reads) > 2 and now - self._reads[1][0] >= self.settings.horizon:
            self._reads.popleft()  # keep one read at least a horizon old
        parts = lenient_table(current, list(self.layers), num_experts)
        recent = self._since(self._reads[0][1], read, parts, num_experts)
        forecast, steps = None, 0
        if book is not None:
            steps = horizon_steps(self.settings.horizon, book.step_seconds())
            forecast = (book.forecast(steps) if self.known is None
                        else book.forecast_knowing(steps, self.known.entries))
            self._judge(book)
            self._guesses = {"predictive": forecast, "reactive": recent}
        estimate = recent
        if self.settings.mode == "predictive" and book is not None:  # the servers count both
            estimate = forecast + book.coming_prefill(steps)
        slots = self.settings.slots or max(1, fullest(current))
        look, chosen = self.policy.look(now, estimate, current, slots)
        if self.metrics is not None:
            self.metrics.looked(look, book, self.policy.overlap_with_last_plan(estimate))
        why = look.why.split(" (")[0]
        if why != self._last_why:  # each change of verdict, once
            forecast_of = ("" if book is None else f" [forecast of {book.running} running "
                           f"requests over {steps} steps; steps left out: {book.unattributed} "
                           f"of {book.steps}]")
            logger.info("eaas balance (%s): %s%s", self.settings.mode, look.why, forecast_of)
            self._last_why = why
        if chosen is None:
            return
        logger.info("eaas balance (%s): re-placing: %s, %d replicas to add", self.settings.mode,
                    look.why, look.adds)
        self.policy.acted(now)
        target = {"policy": f"moeless ({self.settings.mode} balancer)",
                  "num_experts": num_experts, "grace": 2.0}
        try:
            record = rebalance(self.controller, monitor, self.monitor_url, self.token, chosen,
                               num_experts, lambda tier: plan(tier, estimate, self.layers, slots),
                               target, say=logger.info)
        except Busy as exc:
            logger.info("eaas balance: not re-placing now: %s", exc)
            return
        self.policy.acted(time.monotonic())  # the cooldown counts from the end
        if record.state != DONE:
            logger.warning("eaas balance: operation %s %s: %s", record.id, record.state,
                           record.result)
            return
        logger.info("eaas balance: %s (operation %s)", record.result, record.id)
        if self.metrics is not None:
            self.metrics.replaced(look.adds)

    def _since(self, old: dict[str, Counters], read: list[Counters], parts, num_experts: int
               ) -> np.ndarray:
        measured = [since(c, old.get(c.server)) for c in read]
        measured = [m for m in measured if m.start is not None or not old]
        return expert_load(measured, list(self.layers), num_experts,
                           {layer: parts.parts(layer) for layer in self.layers})

    def _judge(self, book: RoutingBook) -> None:
        """The last look's estimates against the decode entries computed since."""
        decoded, steps = book.take_decoded()
        if not steps or self.metrics is None:
            return
        for name, guess in self._guesses.items():
            overlap = load_overlap(guess, decoded)
            if not np.isnan(overlap).all():
                self.metrics.judged(name, float(np.nanmean(overlap)))


class _Metrics(OptionalMetrics):
    """The balancer's series in SGLang's ``/metrics`` (``--enable-metrics``)."""

    def __init__(self):
        from prometheus_client import Counter, Gauge

        gauge = dict(multiprocess_mode="livemostrecent")
        self._overlap = Gauge("sglang_eaas_balance_estimate_overlap", "Share of the decode "
                              "entries since the last look on experts as often as that look's "
                              "estimate said (mean over MoE layers): predictive is the "
                              "forecast, reactive the servers' entries of the horizon before",
                              ["estimate"], **gauge)
        self._imbalance = Gauge("sglang_eaas_balance_estimate_imbalance", "The estimate's "
                                "busiest expert server over the mean on the current placement "
                                "(worst MoE layer)", **gauge)
        self._cost = Gauge("sglang_eaas_balance_forecast_cost_share", "Time spent recording "
                           "the requests' routing and forecasting per step since the last "
                           "look, over the mean step time", **gauge)
        self._running = Gauge("sglang_eaas_balance_forecast_requests", "Running requests the "
                              "forecast sums", **gauge)
        self._shift = Gauge("sglang_eaas_balance_overlap_with_last_plan", "The estimate's "
                            "overlap with the load the last re-placement was planned on (mean "
                            "over MoE layers; below --eaas-balance-shift the mix shifted and "
                            "the cooldown ends)", **gauge)
        self._replacements = Counter("sglang_eaas_balance_replacements", "Re-placements the "
                                     "balancer made")
        self._replicas = Counter("sglang_eaas_balance_replicas_added", "Replicas its "
                                 "re-placements added")
        self._last = (0.0, 0)  # the book's cost and steps at the last look

    def judged(self, estimate: str, overlap: float) -> None:
        self._overlap.labels(estimate=estimate).set(overlap)

    def looked(self, look, book: RoutingBook | None, shift: float | None) -> None:
        if look.worst is not None:
            self._imbalance.set(look.worst)
        if shift is not None:
            self._shift.set(shift)
        if book is None:
            return
        cost, steps = self._last
        step = book.step_seconds()
        if book.steps > steps and step:  # the cost per step over the step's time
            self._cost.set((book.cost - cost) / (book.steps - steps) / step)
        self._last = (book.cost, book.steps)
        self._running.set(book.running)

    def replaced(self, adds: int) -> None:
        self._replacements.inc()
        self._replicas.inc(adds)
