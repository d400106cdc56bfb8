"""The versioned routing table: per MoE layer, which expert servers hold which experts.

Servers are named by a stable id (their control address), never by a list position, so a table
can lose or gain a server and the ids of the others keep their meaning. A table is immutable:
every change is a new table with the next epoch, and a client swaps the whole table between
steps (``EaasClient.stage``), so no layer ever sees half of two tables.

Each layer has a layout, part of the table's epoch (docs/switching.md): expert parallelism
(``parts`` 1: a token's entry goes to one holder of its expert), or tensor parallelism over
``P`` parts (a token's entry for expert ``e`` becomes ``P`` entries, one per part, routed ids
``e * P + p``, each to a holder of that part; their partial sums add up to the expert's output).
The layout is read from the holdings, so it changes exactly when what the servers hold does: a
layer is EP while whole experts cover it, else TP over the smallest ``P`` whose parts cover it.
A switch therefore adds the new layout's weights, then drops the old ones; the drop flips it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from sglang_eaas.holdings import Holdings, ServerHoldings
from sglang_eaas.placement import ExpertRouting, PlacementError


@dataclass(frozen=True)
class RoutingTable:
    epoch: int
    holdings: Holdings  # what ``build`` was given: the servers, in this order, and their experts
    layers: Mapping[int, ExpertRouting]  # MoE layer id -> who holds which expert there
    num_experts: int  # expert ids per layer: the model's, then ESFT adapter experts' slots
    base_experts: int = 0  # the model's experts (0: all ``num_experts`` are)
    # MoE layer -> adapter experts' physical ids that servers describe differently: held, but
    # routed to no server (``assign`` gives ``NO_HOLDER``), for no holder can be trusted to be
    # the expert a request was rerouted to
    untrusted: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    # MoE layer -> the parts its experts are routed in (1: whole experts, EP); a layer not
    # named is EP
    layouts: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def build(cls, epoch: int, holdings: Holdings, moe_layers: list[int], num_experts: int,
              allow_missing: bool = False, base_experts: int = 0) -> "RoutingTable":
        """The table of ``holdings``; ``PlacementError`` if a layer is missing, or (unless
        ``allow_missing``: a live tier that lost the last holder of an expert) if an expert of
        some layer has no holder. ``base_experts``: the model's experts, when ``num_experts``
        also counts ESFT adapter slots (ids ``base_experts ..``, held or not: a free slot is
        not missing); the holdings' adapter records say which held experts are adapters'."""
        assert isinstance(holdings, Holdings), type(holdings)
        base = base_experts or num_experts
        untrusted = _described_differently(holdings)
        layers, layouts = {}, {}
        for layer in moe_layers:
            missing = [s for s, held in holdings.items() if layer not in held]
            if missing:
                raise PlacementError(f"servers {missing} say nothing about MoE layer {layer}")
            routed = [[e for e in held[layer] if e not in untrusted.get(layer, ())]
                      for held in holdings.values()]
            try:
                whole = ExpertRouting(routed, num_experts, True)
            except PlacementError as exc:
                raise PlacementError(f"MoE layer {layer}: {exc}") from None
            # the layouts that could route this layer: (experts missing, parts, routing)
            candidates = [(_experts_missing(whole, 1, base), 1, whole)]
            for parts in sorted({h.parts[layer].parts for h in holdings.values()
                                 if layer in h.parts}):
                held = [h.parts[layer].ids if layer in h.parts and h.parts[layer].parts == parts
                        else () for h in holdings.values()]
                try:
                    routing = ExpertRouting([list(ids) for ids in held], num_experts * parts, True)
                except PlacementError as exc:
                    raise PlacementError(f"MoE layer {layer}, {parts}-part slices: "
                                         f"{exc}") from None
                candidates.append((_experts_missing(routing, parts, base), parts, routing))
            lost, parts, layers[layer] = min(candidates, key=lambda c: (len(c[0]), c[1]))
            if lost and not allow_missing:
                raise PlacementError(f"MoE layer {layer}: experts {lost} are on no expert "
                                     "server")
            if parts > 1:
                layouts[layer] = parts
        return cls(epoch, holdings, layers, num_experts, base,
                   {layer: tuple(sorted(ids)) for layer, ids in untrusted.items()}, layouts)

    @property
    def servers(self) -> tuple[str, ...]:
        """Stable server ids; ``ExpertRouting`` indices point into this."""
        return self.holdings.servers

    def adapters(self) -> dict[str, dict[int, dict[int, int]]]:
        """The ESFT adapters the servers hold experts of: adapter -> MoE layer -> base expert
        -> physical id. A physical id two servers describe differently is left out (and so
        is its adapter's use of it): it cannot be trusted to be either (``untrusted``)."""
        described = {(layer, physical): d for by_layer in self.holdings.adapters.values()
                     for layer, held in by_layer.items() for physical, d in held.items()
                     if physical not in self.untrusted.get(layer, ())}
        out: dict[str, dict[int, dict[int, int]]] = {}
        for (layer, physical), d in sorted(described.items()):
            out.setdefault(d.adapter, {}).setdefault(layer, {})[d.base] = physical
        return out

    def adapter_digests(self, name: str) -> dict[int, dict[int, str]]:
        """Adapter ``name``'s experts' digests as the servers describe them: MoE layer ->
        base expert -> digest."""
        out: dict[int, dict[int, str]] = {}
        for by_layer in self.holdings.adapters.values():
            for layer, held in by_layer.items():
                for d in held.values():
                    if d.adapter == name:
                        out.setdefault(layer, {})[d.base] = d.digest
        return out

    @classmethod
    def uniform(cls, epoch: int, experts: Mapping[str, list[int]], moe_layers: list[int],
                num_experts: int) -> "RoutingTable":
        """Every server holds the same experts in every layer."""
        return cls.build(epoch, Holdings.uniform(experts, moe_layers), moe_layers, num_experts)

    @property
    def missing(self) -> dict[int, list[int]]:
        """MoE layer -> the model's experts no server of this table holds (only with
        ``allow_missing``); free ESFT adapter slots are not missing."""
        base = self.base_experts or self.num_experts
        missing = {layer: _experts_missing(r, self.parts(layer), base)
                   for layer, r in self.layers.items()}
        return {layer: ids for layer, ids in missing.items() if ids}

    def parts(self, layer: int) -> int:
        """The parts ``layer``'s experts are routed in: 1 (EP), or P (TP over P parts)."""
        return self.layouts.get(layer, 1)

    def expand(self, layer: int, expert_ids: np.ndarray) -> np.ndarray:
        """``[T, K]`` expert ids -> the ids ``assign`` takes in ``layer``: the same in an EP
        layer; in a TP layer of P parts, ``[T, K * P]``, entry ``(t, k * P + p)`` part ``p`` of
        expert ``ids[t, k]`` (``e * P + p``; -1 stays -1)."""
        parts = self.parts(layer)
        if parts == 1:
            return expert_ids
        ids = expert_ids.astype(np.int64, copy=False)
        routed = ids[..., None] * parts + np.arange(parts)
        return np.where(ids[..., None] >= 0, routed, -1).reshape(ids.shape[0], ids.shape[1] * parts)

    def without(self, server: str, allow_missing: bool = False) -> "RoutingTable":
        """The next epoch without ``server``; ``PlacementError`` naming the layer and experts
        that would lose their last holder, unless ``allow_missing``."""
        return RoutingTable.build(self.epoch + 1, self.holdings.without(server), list(self.layers),
                                  self.num_experts, allow_missing, self.base_experts)

    def with_server(self, server: str, layers: Mapping[int, list[int]]) -> "RoutingTable":
        """The next epoch with ``server`` holding ``layers`` (replacing what it held)."""
        return RoutingTable.build(self.epoch + 1, self.holdings.with_server(server, layers),
                                  list(self.layers), self.num_experts, bool(self.missing),
                                  self.base_experts)

    def assign(self, layer: int, expert_ids: np.ndarray) -> np.ndarray:
        """``[T, K]`` expert ids of ``layer`` -> ``[T, K]`` indices into ``servers`` (-1 for -1,
        ``placement.NO_HOLDER`` for an expert no server holds)."""
        return self.layers[layer].assign(expert_ids)


def lenient_table(holdings: Holdings, moe_layers: list[int], base_experts: int) -> RoutingTable:
    """The table of ``holdings``' model experts as a tier that may be missing some would route
    them: a layer a server does not name holds nothing of it there, ESFT adapter experts are
    left out, an expert no server holds is ``missing`` (status, coverage checks)."""
    every = Holdings({s: ServerHoldings({layer: [e for e in held.get(layer, ()) if e < base_experts]
                                         for layer in moe_layers}, None, held.parts)
                      for s, held in holdings.items()})
    return RoutingTable.build(0, every, moe_layers, base_experts, allow_missing=True)


def uncovered(holdings: Holdings, moe_layers: list[int], num_experts: int) -> str:
    """What a tier holding ``holdings`` lacks to route every expert of every MoE layer:
    ``experts [ids] of MoE layer L; ...``, or ``""`` when every expert has a holder."""
    table = RoutingTable.build(0, holdings, moe_layers, num_experts, allow_missing=True)
    return "; ".join(f"experts {e} of MoE layer {layer}" for layer, e in table.missing.items())


def unroutable(holdings: Holdings, moe_layers: list[int], base_experts: int
               ) -> dict[int, set[int]]:
    """MoE layer -> the model's experts (ids under ``base_experts``) a table of ``holdings``
    could not compute, whole or in parts."""
    table = lenient_table(holdings, moe_layers, base_experts)
    return {layer: set(ids) for layer, ids in table.missing.items()}


def _experts_missing(routing: ExpertRouting, parts: int, base: int) -> list[int]:
    """The model's experts (ids under ``base``) ``routing`` of ``parts``-part slices cannot
    compute: a part of theirs (or they, when whole) is on no server."""
    return sorted({i // parts for i in routing.missing if i // parts < base})


def _described_differently(holdings: Holdings) -> dict[int, set[int]]:
    """MoE layer -> the physical ids that two servers describe as different adapter experts
    (two SGLang servers that placed two adapters under one id at the same moment)."""
    seen: dict[tuple[int, int], set] = {}
    for by_layer in holdings.adapters.values():
        for layer, held in by_layer.items():
            for physical, described in held.items():
                seen.setdefault((layer, physical), set()).add(described)
    out: dict[int, set[int]] = {}
    for (layer, physical), described in seen.items():
        if len(described) > 1:
            out.setdefault(layer, set()).add(physical)
    return out


class DeviceRoutingTable:
    """A table's per-layer holders as device tensors, updated in place by ``load``.

    A captured CUDA graph keeps pointers to these tensors, so it stays valid when the table
    changes; what cannot change in place is the set of servers (each has a channel with its own
    buffers), nor the layers. Assignment is ``ExpertRouting.assign``'s, in torch ops and one
    Triton kernel that read nothing back to the host.
    """

    def __init__(self, table: RoutingTable, device: torch.device | str):
        self.servers, self.num_experts = table.servers, table.num_experts
        self.rows = {layer: row for row, layer in enumerate(table.layers)}
        width = max(1, len(table.servers))  # room for an expert on every server
        self.holders = torch.zeros(len(self.rows), table.num_experts, width, dtype=torch.int64,
                                   device=device)
        self.replicas = torch.ones(len(self.rows), table.num_experts, dtype=torch.int64,
                                   device=device)
        self.epoch = -1
        self.load(table)

    def load(self, table: RoutingTable) -> None:
        """Copy ``table`` into the tensors (between steps)."""
        if table.servers != self.servers or set(table.layers) != set(self.rows):
            raise ValueError(f"a device routing table keeps its servers {list(self.servers)} "
                             f"and layers; table {table.epoch} has servers {list(table.servers)}")
        holders, replicas = self.holders.new_zeros(self.holders.shape), self.replicas.clone()
        for layer, row in self.rows.items():
            routing = table.layers[layer]
            width = routing.table.shape[1]
            holders[row, :, :width] = torch.from_numpy(routing.table)
            holders[row, :, width:] = holders[row, :, :1]
            replicas[row] = torch.from_numpy(routing.replicas)
        self.holders.copy_(holders)
        self.replicas.copy_(replicas)
        self.epoch = table.epoch

    def assign(self, layer: int, expert_ids: torch.Tensor) -> torch.Tensor:
        """``[T, K]`` expert ids of ``layer`` -> ``[T, K]`` server indices (-1 for id -1),
        dealt by load as ``ExpertRouting.assign`` deals them (``dealing``'s rule: steps 1 and 3
        and step 2's order in torch ops, step 2 in ``sgl_kernel_ext.deal_entries_kernel``),
        nothing read back."""
        from sgl_kernel_ext.deal_entries_kernel import launch_deal

        row = self.rows[layer]
        holders, replicas = self.holders[row], self.replicas[row]
        flat = expert_ids.reshape(-1).long()
        valid = flat >= 0
        ids = flat.clamp(min=0)
        # (always computed: whether a table has replicas is device data, and a graph must not
        # depend on it)
        seen = torch.nn.functional.one_hot(ids, self.num_experts) * valid.unsqueeze(1)
        counts = seen.sum(0)
        rank = seen.cumsum(0).gather(1, ids.unsqueeze(1)).squeeze(1) - 1  # among its expert's
        single = (replicas == 1) & (holders[:, 0] >= 0)
        load = counts.new_zeros(len(self.servers)).scatter_add_(  # step 1
            0, holders[:, 0].clamp(min=0), counts * single)
        # step 2's order: the replicated experts with entries, most first, then by id (unique
        # keys: no tie for the sort to break); round q deals the first dealing[q] of them
        experts = torch.arange(self.num_experts, device=counts.device)
        dealing_now = (replicas > 1) & (counts > 0)
        order = torch.argsort(torch.where(dealing_now, -counts * self.num_experts + experts,
                                          self.num_experts * (flat.numel() + 1)))
        rounds = torch.arange(flat.numel(), device=counts.device)  # at most N entries each
        ascending = torch.sort(counts * dealing_now).values
        dealing = self.num_experts - torch.searchsorted(ascending, rounds, right=True)
        first = counts.cumsum(0) - counts
        dealt = torch.zeros_like(flat)
        launch_deal(order, dealing, ascending[-1:], first, replicas, holders, load,
                    (flat * valid).sum().reshape(1), dealt)
        place = (first[ids] + rank).clamp(0, max(0, flat.numel() - 1))  # step 3
        server = torch.where(replicas[ids] > 1, dealt[place], holders[ids, 0])
        return torch.where(valid, server, -1).reshape(expert_ids.shape)
