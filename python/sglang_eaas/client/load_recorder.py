"""``LoadRecorder``: one attention rank's tokens per (MoE layer, expert), in windows of steps.

``EaasClient.dispatch`` hands it each MoE layer's ``[T, K]`` expert ids once per layer call
(``count``): never again for entries sent a second time after a failover, nor per chunk. The
client's step boundaries end steps (``end_step``); every ``window_steps`` steps the counts
become a ``LoadWindow`` (``balance/load.py``), kept as ``last`` (the presence heartbeat sends
it to the monitor) and handed to the sinks (``client/load_sinks.py``: ``/metrics``, the dump
file).

Host path: the ids are a numpy array already (the client reads them to route), counted with
``np.bincount``. Device path: the ids stay on the device and so do the counts, a ``[L, E + 2]``
tensor added to with ``scatter_add_`` (``torch.bincount`` on CUDA reads the ids' min and max to
the host, a sync per layer; ``scatter_add_`` has none and can be captured in a CUDA graph); it
is read once per window.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from sglang_eaas.balance.load import LoadWindow
from sglang_eaas.protocol.lines import MAX_LINE

logger = logging.getLogger(__name__)
DEFAULT_WINDOW_STEPS = 16
# The heartbeat's window at most (JSON bytes): a monitor's watch answers carry every member's
# load in one line of at most MAX_LINE (DeepSeek's 58 x 256 window is 30-100 KB).
HEARTBEAT_LIMIT = MAX_LINE // 8


class LoadRecorder:
    def __init__(self, source: str, moe_layers: Iterable[int], num_experts: int,
                 window_steps: int = DEFAULT_WINDOW_STEPS,
                 sinks: Sequence[Callable[[LoadWindow], None]] = ()):
        """``source``: who counts (the client id); ``sinks``: called with each closed window,
        on the thread that ends the step (``load_sinks.Publisher`` moves them off it)."""
        assert window_steps >= 1, window_steps
        self.source, self.num_experts, self.window_steps = source, num_experts, window_steps
        self.layers = tuple(moe_layers)
        self.sinks = list(sinks)
        self._row = {layer: row for row, layer in enumerate(self.layers)}
        self._host = np.zeros((len(self.layers), num_experts), dtype=np.int64)
        # Column 0: ids < 0 (none), 1 + e: expert e, E + 1: ids >= E (counted nowhere).
        self._device: torch.Tensor | None = None  # zeroed in place: a captured graph keeps it
        self.steps = 0  # steps ended so far: the next step's number
        self._first = 0  # the open window's first step
        self._start: float | None = None  # when its first step began
        self.last: LoadWindow | None = None  # the last closed window
        self._message: tuple[LoadWindow | None, dict] = (None, {})  # last's heartbeat form
        self._too_big_logged = False

    def count(self, layer: int, ids: np.ndarray | torch.Tensor) -> None:
        """Count one call of MoE layer ``layer``: ``ids [T, K]`` global expert ids (< 0: none),
        a numpy integer array (host path) or a tensor on any device (device path)."""
        row = self._row[layer]
        if self._start is None:
            self._start = time.time()
        if isinstance(ids, np.ndarray):
            flat = ids.reshape(-1)
            self._host[row] += np.bincount(flat[flat >= 0], minlength=self.num_experts
                                           )[: self.num_experts]
            return
        flat = ids.reshape(-1)
        counts = self._device
        if counts is None or counts.device != flat.device:
            self._take_device()  # a new device: what the old one counted goes to the host
            counts = self._device = torch.zeros(len(self.layers), self.num_experts + 2,
                                                dtype=torch.int64, device=flat.device)
        bins = (flat.long() + 1).clamp_(0, self.num_experts + 1)
        # Fresh ones each call, not a cached buffer: a CUDA graph captured here must never
        # read a buffer that a later, larger batch replaced.
        counts[row].scatter_add_(0, bins, torch.ones_like(bins))

    def begin_step(self) -> None:
        if self._start is None:
            self._start = time.time()

    def end_step(self) -> LoadWindow | None:
        """A step ended; the window it closed, if it closed one."""
        self.steps += 1
        if self.steps - self._first >= self.window_steps:
            return self.close_window()
        return None

    def close_window(self) -> LoadWindow | None:
        """Close the open window now (``None`` if no step ended since the last one): to
        ``last`` and the sinks."""
        if self.steps == self._first:
            return None
        self._take_device()
        now = time.time()
        start = self._start if self._start is not None else now
        window = LoadWindow.of(self.source, self._first, self.steps - self._first, start,
                               max(now, start), self.layers, self._host)
        self._host[:] = 0
        self._first, self._start = self.steps, None
        self.last = window
        for sink in self.sinks:
            sink(window)
        return window

    def message(self) -> dict:
        """What the heartbeat carries: the last closed window, ``LoadWindow.to_message()``
        (``{}`` before the first, or when it is over ``HEARTBEAT_LIMIT``). Called on the
        presence thread, every heartbeat: encoded once per window."""
        last = self.last
        window, message = self._message
        if last is window:
            return message
        message = last.to_message()
        size = len(json.dumps(message))
        if size > HEARTBEAT_LIMIT:
            if not self._too_big_logged:
                logger.warning("sglang-eaas: load windows of %d x %d experts are %d bytes, over "
                               "the %d the heartbeat carries; the monitor gets none (they "
                               "are on /metrics and in --eaas-load-dump)", len(self.layers),
                               self.num_experts, size, HEARTBEAT_LIMIT)
                self._too_big_logged = True
            message = {}
        self._message = (last, message)
        return message

    def _take_device(self) -> None:
        """Add the device counts to the host's (the one read of the device per window)."""
        if self._device is not None:
            self._host += self._device[:, 1 : self.num_experts + 1].cpu().numpy()
            self._device.zero_()
