"""bench_live_balance's measurements: the expert servers' own entry counters, read around a
workload and every few seconds during it, and SGLang's per-exchange histogram.

* ``read_counters``: each server's ``expert_load`` (``protocol.control.probe``: cumulative
  entries per (MoE layer, expert) since it started) as one ``[servers, layers, experts]`` array;
* ``Poller``: those arrays every ``interval`` seconds on a thread of its own, while the
  workload runs;
* ``busiest_over_mean``: per MoE layer, the busiest server's entries over the mean per server
  (every server counts, one given nothing as 0);
* ``interval_ratio``: the mean over the poll intervals of that ratio (intervals where a layer
  has fewer than ``min_entries`` entries are left out: the run's ragged ends);
* ``exchange_means``: ``sglang_eaas_exchange_imbalance``'s sum and count per MoE layer from
  SGLang's ``/metrics``; the difference of two readings gives the mean over the exchanges
  between them; ``table_epoch``: the routing table SGLang's client uses.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np
import requests
from prometheus_client.parser import text_string_to_metric_families

from sglang_eaas.protocol.control import probe

EXCHANGE = "sglang_eaas_exchange_imbalance"


def read_counters(addresses: Sequence[str], token: str, layers: Sequence[int],
                  num_experts: int) -> np.ndarray:
    """``[servers, layers, experts]`` int64: entries each server computed so far."""
    out = np.zeros((len(addresses), len(layers), num_experts), dtype=np.int64)
    row = {layer: i for i, layer in enumerate(layers)}
    for s, address in enumerate(addresses):
        for layer, experts in probe(address, token).expert_load.items():
            if layer not in row:
                continue
            for expert, (tokens, _) in experts.items():
                if expert < num_experts:
                    out[s, row[layer], expert] = tokens
    return out


class Poller:
    """``read()`` every ``interval`` seconds from ``start()`` to ``stop()``; ``stop`` returns
    every reading, the first taken at ``start`` and the last at ``stop`` (``RuntimeError`` if
    one failed: a server gone)."""

    def __init__(self, read, interval: float):
        self._read, self.interval = read, interval
        self._stop = threading.Event()
        self._readings: list[np.ndarray] = []
        self._failed: Exception | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Poller":
        self._readings.append(self._read())
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._readings.append(self._read())
            except Exception as exc:  # noqa: BLE001 - said by stop(), on the caller's thread
                self._failed = exc
                return

    def cancel(self) -> None:
        """Stop reading (the workload failed)."""
        self._stop.set()
        self._thread.join()

    def stop(self) -> list[np.ndarray]:
        self.cancel()
        try:
            if self._failed is None:
                self._readings.append(self._read())
        except Exception as exc:  # noqa: BLE001
            self._failed = exc
        if self._failed is not None:
            raise RuntimeError(f"reading the expert servers' counters failed: {self._failed}")
        return self._readings


def busiest_over_mean(per_server: np.ndarray) -> np.ndarray:
    """``per_server``: ``[servers, layers]`` entries; ``[layers]`` max / mean (nan: none)."""
    per_server = np.asarray(per_server, dtype=np.float64)
    mean = per_server.mean(axis=0)
    return np.divide(per_server.max(axis=0), mean, out=np.full(mean.shape, np.nan),
                     where=mean > 0)


def interval_ratio(readings: list[np.ndarray], min_entries: int) -> np.ndarray:
    """``[layers]``: the mean over consecutive readings' intervals of ``busiest_over_mean``."""
    ratios = []
    for a, b in zip(readings, readings[1:]):
        done = (b - a).sum(axis=2)  # [servers, layers]
        r = busiest_over_mean(done)
        r[done.sum(axis=0) < min_entries] = np.nan
        ratios.append(r)
    if not ratios:
        return np.full(readings[0].shape[1], np.nan)
    stacked = np.array(ratios)
    counted = (~np.isnan(stacked)).sum(axis=0)
    return np.divide(np.nansum(stacked, axis=0), counted, out=np.full(counted.shape, np.nan),
                     where=counted > 0)


def metrics_text(url: str) -> str:
    response = requests.get(f"{url}/metrics", timeout=30)
    response.raise_for_status()
    return response.text


def exchange_means(text: str, layers: Sequence[int]) -> np.ndarray:
    """``[2, layers]``: the histogram's sum and count per MoE layer (over ranks)."""
    out = np.zeros((2, len(layers)))
    row = {str(layer): i for i, layer in enumerate(layers)}
    for family in text_string_to_metric_families(text):
        if family.name != EXCHANGE:
            continue
        for sample in family.samples:
            i = row.get(sample.labels.get("layer", ""))
            if i is not None and sample.name in (EXCHANGE + "_sum", EXCHANGE + "_count"):
                out[0 if sample.name.endswith("_sum") else 1, i] += sample.value
    return out


def exchange_ratio(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """``[layers]`` mean per exchange between two ``exchange_means`` (nan: none)."""
    total, count = after - before
    return np.divide(total, count, out=np.full(count.shape, np.nan), where=count > 0)


def table_epoch(text: str) -> float | None:
    for family in text_string_to_metric_families(text):
        if family.name == "sglang_eaas_table_epoch":
            values = [s.value for s in family.samples]
            return max(values) if values else None
    return None


def wait_for_table(url: str, before: float | None, settle: float, timeout: float) -> float:
    """Wait until SGLang's table epoch is past ``before`` and has not changed for ``settle``
    seconds (the client took every change the rebalance made); seconds waited. Raises
    ``TimeoutError`` after ``timeout``."""
    began = changed = time.monotonic()
    last = table_epoch(metrics_text(url))
    while True:
        time.sleep(0.5)
        now = table_epoch(metrics_text(url))
        if now != last:
            last, changed = now, time.monotonic()
        moved = last is not None and (before is None or last > before)
        if moved and time.monotonic() - changed >= settle:
            return time.monotonic() - began
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"SGLang's routing table epoch stayed at {last} (before the "
                               f"rebalance: {before}) for {timeout:.0f} s")
