"""The simulated expert tier: which servers are up, on which node, and what each holds of the
simulated MoE layers (a ``Holdings``, the record the live tier uses), with each layer's cost of
an expert phase on that placement."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sglang_eaas.holdings import Holdings
from sglang_eaas.placement import even_placement
from sglang_eaas.plan.cost import expert_costs, shared_cores
from sglang_eaas.plan.deployment import TP, Deployment
from sglang_eaas.plan.model import ModelSpec
from sglang_eaas.plan.profile import HardwareProfile


@dataclass(frozen=True)
class Phase:
    """One layer's expert phase: each server's seconds and the entries it receives."""

    times: np.ndarray  # [S]
    entries: np.ndarray  # [S]
    routed: float  # the layer's (token, expert) entries (TP sends each to every part)


def hot_placement(shares: np.ndarray, servers: list[str], hot: int) -> dict[str, list[int]]:
    """Even contiguous blocks, then ``hot`` more copies, each of the expert with the most
    load per copy (by ``shares``, one layer), on the least-loaded server that does not hold
    it yet. More servers than experts: one expert each, then one more copy per server left,
    chosen the same way, before the ``hot`` ones."""
    num = len(shares)
    copies = np.zeros(num)
    if len(servers) > num:
        blocks = [[e] for e in range(num)]
        copies += 1
        for _ in range(len(servers) - num):
            e = int(np.argmax(shares / copies))
            blocks.append([e])
            copies[e] += 1
    else:
        blocks = even_placement(num, len(servers))
        copies += 1
    held = np.zeros((len(servers), num), dtype=bool)
    for i, b in enumerate(blocks):
        held[i, b] = True
    for _ in range(hot):
        ratio = shares / copies
        for e in np.argsort(-ratio, kind="stable"):
            if not held[:, e].all():
                break
        else:
            break
        load = held @ ratio  # each server's share of the layer's entries
        target = int(np.argmin(np.where(held[:, e], np.inf, load)))  # the first of the least
        held[target, e] = True
        copies[e] += 1
    return {s: [int(x) for x in np.flatnonzero(held[i])] for i, s in enumerate(servers)}


class Tier:
    """The servers in service (``holdings``), the standby ones, and the layout."""

    def __init__(self, deployment: Deployment, model: ModelSpec, profile: HardwareProfile,
                 layers: tuple[int, ...], shares: np.ndarray):
        self.model, self.profile, self.layers = model, profile, layers
        self.shares = shares
        self.layout = deployment.layout
        first = deployment.attention * deployment.attention_gpus  # device slots before ours
        self.attention_nodes = np.array([(i * deployment.attention_gpus)
                                         // profile.gpus_per_node
                                         for i in range(deployment.attention)])
        self._next_slot = first
        servers = [self._new_id() for _ in range(deployment.expert_servers)]
        self.standby = [self._new_id() for _ in range(deployment.standby)]
        self.hot = deployment.hot_replicas
        self.holdings = self.placement(servers)
        self._tp_parts = len(servers)  # TP: the parts every expert is cut into
        self.epoch = 0
        self._phase_cache: dict = {}
        self._covered = (-1, False)  # (epoch, covered then)

    def _new_id(self) -> str:
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        return f"gpu{slot}"

    def node(self, server: str) -> int:
        return int(server.removeprefix("gpu")) // self.profile.gpus_per_node

    def placement(self, servers: list[str]) -> Holdings:
        return self.placement_as(servers, self.layout)

    def placement_as(self, servers: list[str], layout: str) -> Holdings:
        """The planner's placement over ``servers``: EP as ``hot_placement`` per layer, TP
        every server a part of every expert."""
        num = self.shares.shape[1]
        if layout == TP:
            return Holdings({s: {layer: range(num) for layer in self.layers} for s in servers})
        out: dict[str, dict[int, list[int]]] = {s: {} for s in servers}
        for i, layer in enumerate(self.layers):
            for s, ids in hot_placement(self.shares[i], servers, self.hot).items():
                out[s][layer] = ids
        return Holdings(out)

    # -- changes ------------------------------------------------------------------------------
    def set(self, holdings: Holdings, layout: str | None = None) -> None:
        """A new placement (a resize, a re-placement, a switch): TP cuts into its servers."""
        self.layout = layout or self.layout
        self._tp_parts = len(holdings)
        self._replace(holdings)

    def _replace(self, holdings: Holdings) -> None:
        self.holdings = holdings
        self.epoch += 1
        self._phase_cache = {}

    def covered(self) -> bool:
        """Every expert of every simulated layer has a holder (TP: every part is up)."""
        if self._covered[0] != self.epoch:
            num = self.shares.shape[1]
            self._covered = (self.epoch, len(self.holdings) == self._tp_parts
                             if self.layout == TP else
                             all(len(self.holdings.holders(layer)) == num
                                 for layer in self.layers))
        return self._covered[1]

    def lose(self, server: str) -> None:
        """A server gone: what it held is gone with it (TP: its part of every expert)."""
        self._replace(self.holdings.without(server))

    def join(self, server: str, held) -> None:
        """A server joining with ``held`` (a lost one's holdings, taken over)."""
        self._replace(self.holdings.with_server(server, held))

    def new_server(self) -> str:
        """A device not yet in the tier (a standby one if any is left, else a new one)."""
        return self.standby.pop(0) if self.standby else self._new_id()

    def resized(self, count: int) -> Holdings:
        """The placement over ``count`` servers: the current ones first (kept), new ones
        after."""
        servers = list(self.holdings)[:count]
        while len(servers) < count:
            servers.append(self.new_server())
        return self.placement(servers)

    # -- cost ---------------------------------------------------------------------------------
    def phase(self, row: int, entries: float) -> Phase:
        """Layer ``layers[row]``'s expert phase with ``entries`` (token, expert) pairs in all."""
        key = (row, entries)
        if key not in self._phase_cache:
            self._phase_cache[key] = self._phase(row, entries)
        return self._phase_cache[key]

    def _phase(self, row: int, entries: float) -> Phase:
        counts = self.shares[row] * entries
        servers = list(self.holdings)
        device = self.profile.device
        if self.layout == TP:
            parts = max(self._tp_parts, 1)
            t = float(expert_costs(counts, self.model, device, 1.0 / parts).sum())
            times, got = np.full(len(servers), t), np.full(len(servers), entries)
        else:
            held = self._held(row)
            copies = held.sum(axis=0)
            share = np.where(copies > 0, counts / np.maximum(copies, 1), 0.0)
            times, got = held @ expert_costs(share, self.model, device), held @ share
        return Phase(shared_cores(times, self.server_nodes(), self.profile), got,
                     float(entries))

    def _held(self, row: int) -> np.ndarray:
        """``[S, E]``: 1 where server ``s`` holds expert ``e`` of ``layers[row]``."""
        key = ("held", row)
        if key not in self._phase_cache:
            layer = self.layers[row]
            held = np.zeros((len(self.holdings), self.shares.shape[1]))
            for i, s in enumerate(self.holdings):
                held[i, list(self.holdings[s].get(layer, ()))] = 1.0
            self._phase_cache[key] = held
        return self._phase_cache[key]

    def server_nodes(self) -> np.ndarray:
        if "nodes" not in self._phase_cache:
            self._phase_cache["nodes"] = np.array([self.node(s) for s in self.holdings])
        return self._phase_cache["nodes"]

    def memory_ok(self) -> bool:
        """Every server's experts (all MoE layers, as the simulated ones) fit its memory."""
        most = max((len(h.get(layer, ())) for h in self.holdings.values()
                    for layer in self.layers), default=0)
        width = 1.0 / max(len(self.holdings), 1) if self.layout == TP else 1.0
        need = most * width * self.model.expert_bytes * self.model.moe_layers
        return need <= 0.9 * self.profile.device.memory
