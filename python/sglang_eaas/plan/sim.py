"""The discrete-event simulator: a heap of events on a simulated clock (no wall time is read).

The attention instances step together (the expert tier serves each MoE layer for all of them at
once, so the slowest gates the step); each step admits queued requests (continuous batching: up
to ``max_running`` per instance, as the KV memory allows, and ``prefill_budget`` prompt tokens
per instance), prefills them and decodes one token of every other running request. The
instances share the work evenly. A step's time is ``cost.py``'s pieces, summed over the MoE
layers (the simulated layers stand for all of them, scaled) and the rest of the model.

Events: arrivals, step ends, server losses and joins, monitor outages, holdings changes taking
effect, policy ticks (``policies.py``), and the stall timeout: while an expert has no live
holder no step starts, and requests still waiting ``timeout_s`` after the stall began fail (the
live tier's HTTP 503).
"""

from __future__ import annotations

import collections
import heapq
import math
from typing import Callable

import numpy as np

from sglang_eaas.elastic.autoscaler import TierBusy
from sglang_eaas.holdings import Holdings
from sglang_eaas.plan.cost import (
    Work, attention_layer, fabric_phase, layer_time, outside_moe, overlapped_layer_time,
)
from sglang_eaas.plan.deployment import Deployment
from sglang_eaas.plan.load import ExpertLoad
from sglang_eaas.plan.model import ModelSpec
from sglang_eaas.plan.profile import HardwareProfile
from sglang_eaas.plan.records import Controller, Failure, Result, SimSettings
from sglang_eaas.plan.tier import Tier
from sglang_eaas.plan.traffic import Traffic

ARRIVE, STEP, FAIL, JOIN, APPLY, TICK, MONITOR, TIMEOUT = range(8)


class Simulator:
    def __init__(self, deployment: Deployment, model: ModelSpec, profile: HardwareProfile,
                 load: ExpertLoad, traffic: Traffic, settings: SimSettings = SimSettings(),
                 failures: tuple[Failure, ...] = (), controllers: tuple[Controller, ...] = ()):
        self.dep, self.model, self.profile, self.load = deployment, model, profile, load
        self.traffic, self.settings = traffic, settings
        self.tier = Tier(deployment, model, profile, load.layers, load.shares)
        self.now = 0.0
        self._events: list = []
        self._queued = [0] * 8  # events in the heap, by kind
        self._seq = 0
        n = len(traffic)
        self.ttft, self.tpot = np.full(n, np.nan), np.full(n, np.nan)
        self._first = np.full(n, np.nan)
        self._done_at = np.full(n, np.nan)
        self.failed = 0
        self.log: list[str] = []
        self._queue: collections.deque[int] = collections.deque()
        self._running: list[tuple[int, int]] = []  # heap of (finish step, request)
        self._prefilling: list[int] = []
        self._decoders = 0
        self._context = 0.0
        self._step = 0
        self._stepping = False
        self._stall_since: float | None = None
        self._monitor_back = -math.inf  # the monitor is out until then
        self._changing = False  # a change of holdings is under way
        self._pending = 0  # devices paid for, joining
        self._joining = 0  # lost servers' replacements still to join
        self._failures = 0  # server losses so far (a change that saw one fails)
        self._paid_since, self._gpu_seconds = 0.0, 0.0
        self._paid: list[tuple[float, int]] = []  # (from, devices paid) at each change
        self._busy = 0.0  # the expert servers' busy seconds (mean over servers), cumulated
        self._busy_mark = (0.0, 0.0)
        self._tokens = collections.deque()  # (time, tokens) of recent steps
        self._cost_cache: dict = {}
        self.controllers = controllers
        scale = self.model.moe_layers / len(load.layers)
        self._layer_scale = scale
        self.capacity = self._capacity()
        for i, t in enumerate(traffic.arrival):
            self._push(float(t), ARRIVE, i)
        for f in failures:
            self._push(f.at, FAIL, f)
        for c in controllers:
            c.attach(self)
            self._push(c.period, TICK, c)
        self._paid.append((0.0, self._devices()))

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> Result:
        until = self.settings.until
        while self._events:
            t, _, kind, data = heapq.heappop(self._events)
            self._queued[kind] -= 1
            if until is not None and t > until:
                break
            self._pay(t)
            self.now = t
            self._handle(kind, data)
            self._mark()
            if not self._stepping and self._work_left() and self.tier.covered():
                self._start_step()
        self._pay(self.now)
        return Result(self.dep, self.ttft, self.tpot, self.failed, self._gpu_seconds, self.now,
                      self._step, self.log, self._paid, self._done_at)

    def _handle(self, kind: int, data) -> None:
        if kind == ARRIVE:
            self._queue.append(data)
        elif kind == STEP:
            self._end_step(*data)
        elif kind == FAIL:
            self._fail(data)
        elif kind == JOIN:
            self._join(*data)
        elif kind == APPLY:
            holdings, layout, added, done, failures = data
            self._pending -= added
            self._changing = False
            if failures != self._failures:  # a server was lost meanwhile: the operation
                self.log.append(f"{self.now:.1f}s: a change of holdings failed: a server was "
                                "lost while it ran")  # fails; what it added is let go
                return
            self.tier.set(holdings, layout)
            if done is not None:
                done()
        elif kind == TICK:
            data.act(self)
            if self._work_left() or self._pending_events():
                self._push(self.now + data.period, TICK, data)
        elif kind == MONITOR:
            self.log.append(f"{self.now:.1f}s: the monitor is back")
        elif kind == TIMEOUT:
            self._timeout(data)
        if self._stall_since is None and not self.tier.covered():
            self._stall_since = self.now
            self.log.append(f"{self.now:.1f}s: an expert has no live holder: serving stalls")
            self._push(self.now + self.settings.timeout_s, TIMEOUT, self.now)
        elif self._stall_since is not None and self.tier.covered():
            self.log.append(f"{self.now:.1f}s: every expert held again after "
                            f"{self.now - self._stall_since:.1f}s")
            self._stall_since = None

    def _push(self, t: float, kind: int, data) -> None:
        self._seq += 1
        self._queued[kind] += 1
        heapq.heappush(self._events, (t, self._seq, kind, data))

    def _work_left(self) -> bool:
        return bool(self._queue or self._running or self._prefilling)

    def _pending_events(self) -> bool:
        return any(self._queued[k] for k in (ARRIVE, FAIL, JOIN, APPLY))

    # -- steps --------------------------------------------------------------------------------
    def _capacity(self) -> int:
        """Requests all instances hold at once: ``max_running`` each, as their KV memory
        allows at the traffic's mean length (0: the weights alone do not fit)."""
        m, dev = self.model, self.profile.device
        free = 0.9 * dev.memory * self.dep.attention_gpus - m.attention_side_bytes
        mean = float(np.mean(self.traffic.prompt + self.traffic.output)) if len(
            self.traffic) else 1.0
        per_request = mean * m.kv_bytes_per_token_layer * m.info.num_layers
        fits = int(max(free, 0) // per_request)
        return self.dep.attention * min(self.dep.max_running, fits)

    def _start_step(self) -> None:
        room = self.capacity - len(self._running)
        budget = self.dep.prefill_budget * self.dep.attention
        prompts, pairs = 0, 0.0
        while self._queue and room > 0:
            r = self._queue[0]
            p = int(self.traffic.prompt[r])
            if prompts and prompts + p > budget:
                break
            self._queue.popleft()
            self._prefilling.append(r)
            prompts += p
            pairs += p * p / 2
            room -= 1
        if not self._prefilling and not self._decoders:
            return
        decode = self._decoders
        c = self.dep.attention
        work = Work((decode + prompts) / c, (self._context + prompts) / c,
                    (self._context + pairs) / c, (decode + len(self._prefilling)) / c)
        dt, busy = self.step_time(work, decode + prompts)
        self._busy += busy
        self._tokens.append((self.now, decode + prompts))
        self._stepping = True
        self._push(self.now + dt, STEP, (decode, tuple(self._prefilling)))
        self._prefilling = []

    def _end_step(self, decode: int, prefilled: tuple[int, ...]) -> None:
        self._stepping = False
        s, now = self._step, self.now
        self._step += 1
        self._context += decode
        for r in prefilled:
            self.ttft[r] = now - self.traffic.arrival[r]
            self._first[r] = now
            out = int(self.traffic.output[r])
            if out == 1:
                self._finish(r, now)
                continue
            self._context += int(self.traffic.prompt[r]) + 1
            self._decoders += 1
            heapq.heappush(self._running, (s + out - 1, r))
        while self._running and self._running[0][0] <= s:
            _, r = heapq.heappop(self._running)
            self._decoders -= 1
            self._context -= int(self.traffic.prompt[r] + self.traffic.output[r])
            self._finish(r, now)

    def _finish(self, r: int, now: float) -> None:
        out = int(self.traffic.output[r])
        self.tpot[r] = (now - self._first[r]) / (out - 1) if out > 1 else 0.0
        self._done_at[r] = now
        for c in self.controllers:
            c.finished(float(self.ttft[r]), float(self.tpot[r]))

    def step_time(self, work: Work, tokens: float) -> tuple[float, float]:
        """Seconds of one step of ``work`` on every attention instance (``tokens`` in all) and
        the expert servers' mean busy seconds in it, on the tier as it stands."""
        dep, dev, g = self.dep, self.profile.device, self.dep.attention_gpus
        half = work.half() if dep.overlap else work
        attn = attention_layer(half, self.model, dev, g)
        total, busy = outside_moe(work, self.model, dev, g), 0.0
        entries = self._bucket(tokens * self.model.info.top_k / (2 if dep.overlap else 1))
        for row in range(len(self.load.layers)):
            experts, mean, comm = self._moe_cost(row, entries)
            if dep.overlap:
                total += self._layer_scale * overlapped_layer_time(attn, comm, experts, comm)
                busy += self._layer_scale * 2 * mean
            else:
                total += self._layer_scale * layer_time(attn, comm, experts, comm)
                busy += self._layer_scale * mean
        return total, busy

    def _bucket(self, entries: float) -> float:
        if entries <= 1 or self.settings.bucket <= 0:
            return entries
        step = math.log1p(self.settings.bucket)
        return math.exp(round(math.log(entries) / step) * step)

    def _moe_cost(self, row: int, entries: float) -> tuple[float, float, float]:
        """(busiest server, mean server, one dispatch or combine) seconds of a layer."""
        key = (self.tier.epoch, row, entries)
        if key not in self._cost_cache:
            phase = self.tier.phase(row, entries)
            entry_bytes = self.model.info.hidden_size * self.model.activation_bytes
            comm = fabric_phase(phase.entries, self.dep.attention, self.tier.attention_nodes,
                                self.tier.server_nodes(), entry_bytes, self.profile,
                                phase.routed)
            self._cost_cache[key] = (float(phase.times.max(initial=0.0)),
                                     float(phase.times.mean()) if len(phase.times) else 0.0,
                                     comm)
        return self._cost_cache[key]

    # -- failures and changes -----------------------------------------------------------------
    def monitor_up(self) -> bool:
        return self.now >= self._monitor_back

    def _fail(self, f: Failure) -> None:
        if f.monitor > 0:
            self._monitor_back = max(self._monitor_back, self.now + f.monitor)
            self._push(self._monitor_back, MONITOR, None)
            self.log.append(f"{self.now:.1f}s: the monitor is out for {f.monitor:g}s")
            return
        servers = list(self.tier.holdings)
        if not servers:
            return
        if f.node:
            node = self.tier.node(servers[0])
            lost = [s for s in servers if self.tier.node(s) == node]
        else:
            lost = servers[:f.servers]
        self._failures += 1
        for s in lost:
            self._joining += 1
            held = self.tier.holdings[s]
            self.tier.lose(s)
            standby = bool(self.tier.standby)
            new = self.tier.new_server()
            self._pending += 1
            delay = self.settings.join_s if standby else self.settings.cold_s
            self._push(self.now + delay, JOIN, (new, held))
        self.log.append(f"{self.now:.1f}s: lost {len(lost)} expert server(s) "
                        f"({', '.join(lost[:4])}{'...' if len(lost) > 4 else ''})")

    def _join(self, server: str, held) -> None:
        if not self.monitor_up():  # it cannot register: it joins once the monitor is back
            self._push(self._monitor_back, JOIN, (server, held))
            return
        self.tier.join(server, held)
        self._pending -= 1
        self._joining -= 1
        self.log.append(f"{self.now:.1f}s: {server} joined in place of a lost server")

    def _timeout(self, since: float) -> None:
        if self._stall_since is None or self._stall_since > since:
            return
        lost = len(self._queue) + len(self._running) + len(self._prefilling)
        self.failed += lost
        self._queue.clear()
        self._running, self._prefilling = [], []
        self._decoders, self._context = 0, 0.0
        if lost:
            self.log.append(f"{self.now:.1f}s: {lost} request(s) failed after waiting "
                            f"{self.settings.timeout_s:g}s for an expert without a holder")
        if self._pending_events():
            self._push(self.now + self.settings.timeout_s, TIMEOUT, since)

    def change(self, holdings: Holdings, delay: float, layout: str | None = None,
               done: Callable[[], None] | None = None, added: int = 0) -> bool:
        """A change of holdings taking effect after ``delay``; False (nothing done) while the
        monitor is out or another change is under way."""
        if not self._can_change():
            return False
        self._changing = True
        self._pending += added
        self._push(self.now + delay, APPLY, (holdings, layout, added, done, self._failures))
        return True

    def _can_change(self) -> bool:
        """One operation at a time, with the monitor up, on a tier whose every expert has a
        live holder and no lost server's replacement still joining."""
        return (self.monitor_up() and not self._changing and not self._joining
                and self.tier.covered())

    def resize(self, count: int, done: Callable[[], None] | None = None) -> bool:
        """The tier to ``count`` active servers (new ones from standby first)."""
        if not self._can_change():
            return False
        current = len(self.tier.holdings)
        warm = len(self.tier.standby) >= count - current
        target = self.tier.resized(count)  # takes the standby servers it uses
        added = max(count - current, 0)  # paid for from now, in service at APPLY
        delay = 0.0 if added == 0 else (self.settings.join_s if warm else self.settings.cold_s)
        return self.change(target, delay, done=done, added=added)

    # -- what the policies read ---------------------------------------------------------------
    def tier_busy(self) -> TierBusy | None:
        """The expert servers' utilisation since the last call (``Autoscaler``'s input)."""
        at, busy = self._busy_mark
        self._busy_mark = (self.now, self._busy)
        if self.now <= at:
            return None
        return TierBusy(min((self._busy - busy) / (self.now - at), 1.0),
                        len(self.tier.holdings))

    def tokens_since(self, since: float) -> tuple[float, int]:
        """Tokens stepped since ``since`` and the steps that did (older records dropped)."""
        while self._tokens and self._tokens[0][0] < since:
            self._tokens.popleft()
        return float(sum(t for _, t in self._tokens)), len(self._tokens)

    def _pay(self, t: float) -> None:
        """The devices paid since the last event, until ``t``."""
        paid = self._paid[-1][1]
        self._gpu_seconds += paid * max(t - self._paid_since, 0.0)
        self._paid_since = max(t, self._paid_since)

    def _devices(self) -> int:
        return (self.dep.attention * self.dep.attention_gpus + len(self.tier.holdings)
                + len(self.tier.standby) + self._pending)

    def _mark(self) -> None:
        """After an event: the devices paid from now on, where they changed."""
        paid = self._devices()
        if not self._paid or self._paid[-1][1] != paid:
            self._paid.append((self.now, paid))


def simulate(deployment: Deployment, model: ModelSpec, profile: HardwareProfile,
             load: ExpertLoad, traffic: Traffic, settings: SimSettings = SimSettings(),
             failures: tuple[Failure, ...] = (), controllers: tuple[Controller, ...] = ()
             ) -> Result:
    return Simulator(deployment, model, profile, load, traffic, settings, failures,
                     controllers).run()
