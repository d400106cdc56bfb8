"""``--eaas-layout tp|auto``: the expert tier's layout, switched from SGLang (attention rank 0;
docs/switching.md).

A load sink of rank 0's client (``client/sglang_moe.py``): it sees each load window (entries
per expert and MoE layer over some steps) on the sinks' thread, never the scheduler's.

* ``tp``: once the tier is up, every MoE layer is switched to TP over all its serving expert
  servers (``elastic/switch.py``), in place; the layout then stays.
* ``auto``: each window goes to the policy (``elastic/layout_policy.py``) with the cost model;
  a switch it asks for is made on a thread of its own (windows meanwhile are not judged), over
  the tier's serving servers, and logged with its reason.

Every switch is an operation of the tier controller (``controller/``): where another operation
holds the tier, ``auto``'s switch is not made (logged; judged again after the dwell) and
``tp`` waits for it.

With ``--enable-metrics``, ``/metrics`` shows the switches (``sglang_eaas_layout_switches_total``
by direction) and the last window's predicted MoE time per step in each layout
(``sglang_eaas_layout_predicted_ms``); every rank shows each layer's layout as it routes it
(``sglang_eaas_layer_parts``, client/metrics.py). ``python -m sglang_eaas.status`` shows the
layout of every layer from the monitor's holdings.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Callable

from sglang_eaas import envs
from sglang_eaas.balance.load import LoadWindow
from sglang_eaas.client.metrics import OptionalMetrics
from sglang_eaas.controller.controller import (
    Busy, Ended, Held, TierController, requester_name,
)
from sglang_eaas.controller.end_state import read_end_state
from sglang_eaas.elastic.layout_policy import EP, TP, LayoutChooser, LayoutSettings
from sglang_eaas.elastic.switch import Switcher, SwitchError, layouts
from sglang_eaas.slices import Part
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import PlacementError, even_placement
from sglang_eaas.protocol.operations import DONE, SWITCH
from sglang_eaas.routing_table import RoutingTable

logger = logging.getLogger(__name__)
START_TIMEOUT = 120.0  # seconds ``tp`` waits for the tier's servers before giving up


class LayoutSwitcher:
    """Rank 0's layout decisions and the switches they make."""

    def __init__(self, settings: LayoutSettings, monitor: str, info: MoeModelInfo,
                 table: Callable[[], RoutingTable | None]):
        """``table``: the routing table this rank's client uses now (None before it joined):
        what the policy judges, read in this process rather than asked of the monitor every
        window."""
        self.settings, self.info, self.table = settings, info, table
        self.switcher = Switcher(monitor, envs.TOKEN.get(), info, say=logger.info)
        self.controller = TierController(monitor, envs.TOKEN.get(), requester_name(
            f"layout policy (--eaas-layout {settings.mode}) of SGLang"), say=logger.info)
        self.metrics = _Metrics.create()
        self.chooser: LayoutChooser | None = None
        self._group: tuple[str, ...] = ()
        self._switching = threading.Lock()
        self._refused = ""  # said once: why this tier cannot be cut
        self._attempted = -float("inf")  # the last switch begun (made or failed): the dwell's
        if settings.mode == TP:
            threading.Thread(target=self._to_tp_at_start, name="eaas-layout",
                             daemon=True).start()

    def __call__(self, window: LoadWindow) -> None:
        """A load window (the sinks' thread): judged, and a due switch started."""
        if self.settings.mode != "auto" or self._switching.locked():
            return
        chooser = self._chooser()
        if chooser is None:
            return
        decision = chooser.window(window)
        if self.metrics is not None and chooser.last is not None:
            self.metrics.predicted(chooser.last.ep_us, chooser.last.tp_us)
        if decision is None:
            return
        logger.info("eaas layout: switching every MoE layer to %s: %s", decision.to.upper(),
                    decision.reason)
        self._switching.acquire()
        threading.Thread(target=self._switch, args=(decision.to, list(self._group)),
                         name="eaas-layout", daemon=True).start()

    def _chooser(self) -> LayoutChooser | None:
        """The policy over the tier as the client's table has it (a new one where the servers
        changed)."""
        table = self.table()
        if table is None:
            return None
        holdings, group = table.holdings, tuple(table.servers)
        if len(group) < 2 or not self._can_cut(len(group)):
            return None
        if self.chooser is None or group != self._group:
            current = TP if table.layouts else EP
            first = self.info.moe_layers[0]
            placement = ([list(holdings[s].get(first, ())) for s in group] if current == EP
                         else even_placement(self.info.num_experts, len(group)))
            self.chooser = LayoutChooser(self.settings.policy, self.settings.cost,
                                         self.info.top_k, len(group), placement, current)
            self.chooser.last_switch = self._attempted  # the dwell outlives a new chooser
            self._group = group
        return self.chooser

    def _can_cut(self, parts: int) -> bool:
        try:
            Part(0, parts).check(self.info.moe_intermediate_size)
            return True
        except ValueError as exc:
            if str(exc) != self._refused:
                self._refused = str(exc)
                logger.warning("eaas layout: the tier's %d expert servers cannot hold one part "
                               "each (%s); it stays in EP", parts, exc)
            return False

    def _switch(self, to: str, group: list[str], wait: float = 0.0) -> None:
        self._attempted = time.monotonic()
        layers = list(self.info.moe_layers)
        target = {"layers": layers, "to": to, "group": group, "parts": 0,
                  "grace": self.switcher.grace, "model": asdict(self.info),
                  "fingerprint": self.info.fingerprint()}

        def body(held: Held) -> Ended:
            held.note(_from={str(layer): parts for layer, parts in
                             layouts(self.switcher.holdings(), self.info).items()})
            done = self.switcher.switch(layers, to, group, None, held.fence)
            return Ended(f"switched {len(done)} MoE layers to {to.upper()}",
                         read_end_state(self.switcher.monitor, self.switcher.token,
                                        self.info.fingerprint()))

        try:
            began = time.perf_counter()
            self.switcher.check(layers, to, group)
            record = self.controller.run(SWITCH, target, body, wait=wait)
            if record.state != DONE:
                raise SwitchError(f"operation {record.id} {record.state}: {record.result}")
            logger.info("eaas layout: every MoE layer is %s now (switched in %.2fs, operation "
                        "%s)", to.upper(), time.perf_counter() - began, record.id)
            if self.chooser is not None:
                self.chooser.switched(to)
            if self.metrics is not None:
                self.metrics.switched(to)
        except Busy as exc:
            logger.info("eaas layout: not switching to %s now: %s", to.upper(), exc)
            self.chooser = None
        except (SwitchError, PlacementError, OSError, RuntimeError) as exc:
            logger.warning("eaas layout: the switch to %s failed: %s", to.upper(), exc)
            self.chooser = None  # judged again from the tier as it is, after the dwell
        finally:
            self._switching.release()

    def _to_tp_at_start(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                group = list(self.switcher.holdings().servers)
            except (OSError, RuntimeError, ValueError):
                group = []
            if len(group) >= 2:
                if self._can_cut(len(group)):
                    self._switching.acquire()
                    self._switch(TP, group, wait=START_TIMEOUT)
                return
            time.sleep(0.5)
        logger.warning("eaas layout: no two expert servers came within %.0fs; the tier stays "
                       "in EP", START_TIMEOUT)


class _Metrics(OptionalMetrics):
    """The layout's series in SGLang's ``/metrics`` (``--enable-metrics``)."""

    def __init__(self):
        from prometheus_client import Counter, Gauge

        self._switches = Counter("sglang_eaas_layout_switches", "Switches of every MoE layer "
                                 "of the expert tier, by the layout switched to", ["to"])
        self._predicted = Gauge("sglang_eaas_layout_predicted_ms", "The last load window's "
                                "predicted MoE time per step in each layout", ["layout"],
                                multiprocess_mode="livemostrecent")

    def switched(self, to: str) -> None:
        self._switches.labels(to=to).inc()

    def predicted(self, ep_us: float, tp_us: float) -> None:
        self._predicted.labels(layout=EP).set(ep_us / 1e3)
        self._predicted.labels(layout=TP).set(tp_us / 1e3)
