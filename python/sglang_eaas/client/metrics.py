"""The expert tier in SGLang's ``/metrics`` (Prometheus), with ``--enable-metrics``.

SGLang runs prometheus_client in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by its
launcher before the workers start), so metrics made in a scheduler process appear in the HTTP
server's ``/metrics`` with SGLang's own. One set per attention rank (label ``rank``):

    sglang_eaas_server_requests_total{server}   requests sent to each expert server
    sglang_eaas_server_timeouts_total{server}   results that did not come within the timeout
    sglang_eaas_failovers_total{server}         times a server was dropped with work in flight
                                                or gone (its tokens went to other holders)
    sglang_eaas_server_suspicions_total{server} times the monitor suspected a server (late
                                                heartbeats: its experts went to other holders)
    sglang_eaas_server_losses_total{server, reason}  servers this rank dropped as lost, by why:
                                                connection_closed, result_timeout, heartbeat,
                                                refused, replaced (a new incarnation), gone
    sglang_eaas_failed_requests_total           requests ended because an expert had no holder
    sglang_eaas_table_epoch                     the routing table in use
    sglang_eaas_table_servers                   expert servers in it
    sglang_eaas_missing_experts                 (MoE layer, expert) pairs with no live holder
    sglang_eaas_layer_parts{layer}              each MoE layer's layout as the table in use
                                                routes it: 1 EP, P TP over P parts
    sglang_eaas_expert_tokens_total{layer, expert}  top-k entries this rank routed to each
                                                expert, added per closed load window
                                                (client/load_recorder.py)
    sglang_eaas_expert_load_imbalance{layer}    the last window's max/mean entries per expert
                                                (1: even; layers with no entries keep theirs)
    sglang_eaas_exchange_imbalance{layer}       histogram, one observation per exchange the
                                                host path starts (a chunk's first send: one
                                                micro-batch's rows of one MoE layer; not the
                                                re-sends after a failure): the busiest expert
                                                server's entries over the mean entries per
                                                server of the routing table's servers (one
                                                given nothing counts as 0); 1: even
                                                (buckets ``EXCHANGE_BUCKETS``)

The load-window metrics are updated on the load sinks' thread (client/load_sinks.py), never
on the scheduler's. The exchange histogram is observed on the scheduler's, from the assignment
the host path has made anyway (its per-server counts are made only with ``--enable-metrics``);
the device path (client/device_step.py) assigns on the device and does not read the
assignment back, so it does not observe it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from sglang_eaas.balance.load import LoadWindow
    from sglang_eaas.client.tier import View

# sglang_eaas_exchange_imbalance's buckets (busiest server / mean; +Inf is added)
EXCHANGE_BUCKETS = (1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 3.0, 4.0)


class OptionalMetrics:
    """Series a hook adds to SGLang's ``/metrics``: ``create()`` makes them where SGLang
    serves it (``--enable-metrics``), and is None elsewhere."""

    @classmethod
    def create(cls):
        return cls() if metrics_enabled() else None


def metrics_enabled() -> bool:
    """Whether this SGLang process serves ``/metrics`` (``--enable-metrics``); False outside
    SGLang."""
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except (ImportError, AttributeError):
        return False


class TierMetrics:
    """No metrics (``--enable-metrics`` off, or outside SGLang): every call does nothing."""

    def sent(self, server: str) -> None:
        pass

    def timeout(self, server: str) -> None:
        pass

    def failover(self, server: str) -> None:
        pass

    def suspected(self, server: str) -> None:
        pass

    def lost(self, server: str, reason: str) -> None:
        pass

    def failed_requests(self, count: int) -> None:
        pass

    def dispatched(self, micro_batch: int) -> None:
        pass

    def view(self, view: "View") -> None:
        pass

    def load_window(self, window: "LoadWindow") -> None:
        pass

    def exchange(self, layer: int, server_of: np.ndarray, servers: int) -> None:
        """An exchange starts: ``server_of`` (``ExpertRouting.assign``'s answer: a server
        index per entry, < 0 for none) over a table of ``servers`` servers."""


class PrometheusTierMetrics(TierMetrics):
    def __init__(self, rank: int, registry: "CollectorRegistry | None" = None):
        """``registry``: where the metrics register; prometheus_client's default one (what
        SGLang's ``/metrics`` serves) unless given."""
        # Imported here: prometheus_client must see PROMETHEUS_MULTIPROC_DIR first.
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        on = {"registry": REGISTRY if registry is None else registry}
        labels = {"rank": str(rank)}
        per_server = ["rank", "server"]
        self._rank = str(rank)
        self._requests = Counter("sglang_eaas_server_requests", "Requests sent to each expert "
                                 "server", per_server, **on)
        self._timeouts = Counter("sglang_eaas_server_timeouts", "Results that did not come "
                                 "within the result timeout", per_server, **on)
        self._failovers = Counter("sglang_eaas_failovers", "Times an expert server was dropped "
                                  "from the routing table by this rank", per_server, **on)
        self._suspicions = Counter("sglang_eaas_server_suspicions", "Times the monitor "
                                   "suspected an expert server (late heartbeats)", per_server,
                                   **on)
        self._losses = Counter("sglang_eaas_server_losses", "Expert servers this rank dropped "
                               "as lost, by reason (connection_closed, result_timeout, "
                               "heartbeat, refused, replaced, gone)", [*per_server, "reason"],
                               **on)
        self._failed = Counter("sglang_eaas_failed_requests", "Requests ended because an expert "
                               "they needed had no live holder", ["rank"], **on).labels(**labels)
        self._layers = Counter(
            "sglang_eaas_dispatched_layers", "MoE layers sent to the expert servers, by "
            "micro-batch (1: the second one of two-batch overlap)", ["rank", "micro_batch"], **on)
        gauge = dict(labelnames=["rank"], multiprocess_mode="livemostrecent", **on)
        self._epoch = Gauge("sglang_eaas_table_epoch", "Epoch of the routing table in use",
                            **gauge).labels(**labels)
        self._servers = Gauge("sglang_eaas_table_servers", "Expert servers in the routing "
                              "table in use", **gauge).labels(**labels)
        self._missing = Gauge("sglang_eaas_missing_experts", "(MoE layer, expert) pairs with no "
                              "live expert server", **gauge).labels(**labels)
        self._expert_tokens = Counter("sglang_eaas_expert_tokens", "Top-k entries this rank "
                                      "routed to each expert of each MoE layer",
                                      ["rank", "layer", "expert"], **on)
        self._imbalance = Gauge("sglang_eaas_expert_load_imbalance", "The last load window's "
                                "max/mean entries per expert, per MoE layer",
                                labelnames=["rank", "layer"], multiprocess_mode="livemostrecent",
                                **on)
        self._parts = Gauge("sglang_eaas_layer_parts", "Each MoE layer's layout in the routing "
                            "table in use: 1 expert parallel, P tensor parallel over P parts",
                            labelnames=["rank", "layer"], multiprocess_mode="livemostrecent",
                            **on)
        self._exchange = Histogram(
            "sglang_eaas_exchange_imbalance", "Per exchange the host path starts (one "
            "micro-batch's rows of one MoE layer): the busiest expert server's entries over "
            "the mean per server of the routing table's servers", ["rank", "layer"],
            buckets=EXCHANGE_BUCKETS, **on)
        self._by_layer: dict[int, object] = {}
        self._by_server: dict[str, tuple] = {}
        self._by_expert: dict[tuple[int, int], object] = {}

    def _of(self, server: str) -> tuple:
        found = self._by_server.get(server)
        if found is None:
            found = self._by_server[server] = tuple(
                c.labels(rank=self._rank, server=server)
                for c in (self._requests, self._timeouts, self._failovers))
        return found

    def sent(self, server: str) -> None:
        self._of(server)[0].inc()

    def timeout(self, server: str) -> None:
        self._of(server)[1].inc()

    def failover(self, server: str) -> None:
        self._of(server)[2].inc()

    def suspected(self, server: str) -> None:
        self._suspicions.labels(rank=self._rank, server=server).inc()

    def lost(self, server: str, reason: str) -> None:
        self._losses.labels(rank=self._rank, server=server, reason=reason).inc()

    def failed_requests(self, count: int) -> None:
        self._failed.inc(count)

    def dispatched(self, micro_batch: int) -> None:
        self._layers.labels(rank=self._rank, micro_batch=str(micro_batch)).inc()

    def view(self, view: "View") -> None:
        self._epoch.set(view.epoch)
        self._servers.set(len(view.table.servers))
        self._missing.set(sum(len(e) for e in view.table.missing.values()))
        for layer in view.table.layers:
            self._parts.labels(rank=self._rank, layer=str(layer)).set(view.table.parts(layer))

    def load_window(self, window: "LoadWindow") -> None:
        counts = window.array()
        for row, layer in enumerate(window.layers):
            line = counts[row]
            for expert in line.nonzero()[0].tolist():
                child = self._by_expert.get((layer, expert))
                if child is None:
                    child = self._by_expert[(layer, expert)] = self._expert_tokens.labels(
                        rank=self._rank, layer=str(layer), expert=str(expert))
                child.inc(int(line[expert]))
            if line.any():
                self._imbalance.labels(rank=self._rank, layer=str(layer)).set(
                    float(line.max() / line.mean()))

    def exchange(self, layer: int, server_of: np.ndarray, servers: int) -> None:
        assigned = server_of[server_of >= 0]
        if not assigned.size or servers < 1:
            return
        child = self._by_layer.get(layer)
        if child is None:
            child = self._by_layer[layer] = self._exchange.labels(rank=self._rank,
                                                                  layer=str(layer))
        busiest = int(np.bincount(assigned, minlength=servers).max())
        child.observe(busiest * servers / assigned.size)
