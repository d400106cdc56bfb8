"""``EaasClient``: one attention rank's dispatch -> (remote run) -> combine over expert servers."""

from __future__ import annotations

import numpy as np
import torch

from ibgda import TransportError
from sglang_eaas import transports
from sglang_eaas.client.connection import ServerConnection
from sglang_eaas.client.device_step import DeviceStep, drives_devices
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.placement import PlacedExperts, PlacementError, layer_holdings
from sglang_eaas.protocol.slot import DTYPE_NAMES, POLL_SPIN_US
from sglang_eaas.routing_table import RoutingTable


class EaasClient:
    """Joins every expert server at construction, so placement errors surface before serving."""

    def __init__(self, addresses: list[str], info: MoeModelInfo, model: ModelIdentity,
                 dtype: torch.dtype, name: str,
                 expected_experts: dict[str, PlacedExperts] | None = None,
                 result_timeout: float = 120.0, transport: str = transports.AUTO,
                 poll_spin: float = POLL_SPIN_US * 1e-6):
        self.info, self.result_timeout, self.poll_spin = info, result_timeout, poll_spin
        self.connections: list[ServerConnection] = []
        try:
            for address in addresses:
                self.connections.append(
                    ServerConnection(address, name, model, DTYPE_NAMES[dtype],
                                     transport=transport))
            for conn in self.connections:
                planned = (None if expected_experts is None else
                           layer_holdings(expected_experts[conn.address], info.moe_layers))
                if planned is not None and conn.layer_experts != planned:
                    raise PlacementError(
                        f"expert server {conn.address} holds experts {conn.layer_experts} (per "
                        f"MoE layer), the placement file says {planned}")
            self._by_id = {c.address: c for c in self.connections}
            self.table = RoutingTable.build(0, {c.address: c.layer_experts
                                                for c in self.connections},
                                            list(info.moe_layers), info.num_experts)
        except BaseException:
            self.close()
            raise
        self._staged: RoutingTable | None = None
        self._first_layer = min(info.moe_layers)
        self.max_tokens = min(c.layout.max_tokens for c in self.connections)
        # Where every server is reached by kernels, the whole exchange runs on the device.
        self.device_step = (DeviceStep(self.connections, self.table, result_timeout)
                            if all(drives_devices(c) for c in self.connections) else None)

    def stage(self, table: RoutingTable) -> None:
        """Use ``table`` from the next step on: it is adopted when the step's first MoE layer
        starts, so every layer of a step sees one table, never half of two. Its servers must be
        connected (joining new ones is the caller's business)."""
        unknown = [s for s in table.servers if s not in self._by_id]
        if unknown:
            raise PlacementError(f"routing table {table.epoch} names servers {unknown} this "
                                 "client is not connected to")
        if table.epoch <= self.table.epoch:
            raise PlacementError(f"routing table {table.epoch} is not newer than the table in "
                                 f"use ({self.table.epoch})")
        self._staged = table

    def _table_for(self, layer_id: int) -> RoutingTable:
        """The table this layer reads: a staged table is adopted at the first MoE layer."""
        staged = self._staged
        if staged is not None and layer_id == self._first_layer:
            self._staged = None
            if self.device_step is not None:
                self.device_step.load_table(staged)
            self.table = staged
        return self.table

    def forward(self, layer_id: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """``sum_k w[t, k] * expert_{ids[t, k]}(x[t])`` computed by the expert servers.

        Args:
            hidden: ``[T, H]``; topk_ids: ``[T, K]`` global expert ids; topk_weights: ``[T, K]``.
        Returns:
            ``[T, H]`` in ``hidden.dtype``: partial sums added in server order (deterministic).
        """
        table = self._table_for(layer_id)  # read once: the whole layer uses this table
        if self.device_step is not None:
            return self.device_step.forward(layer_id, hidden, topk_ids, topk_weights)
        out = torch.zeros_like(hidden)
        all_ids = topk_ids.cpu().numpy()
        all_servers = table.assign(layer_id, all_ids)
        # Chunks of max_tokens consecutive tokens, as the device path makes them, so that each
        # server computes the same batches (and bits) on both paths.
        for start in range(0, hidden.shape[0], self.max_tokens):
            ids_np = all_ids[start : start + self.max_tokens]
            server_of = all_servers[start : start + self.max_tokens]
            sent = []
            for index in np.unique(server_of[server_of >= 0]).tolist():
                mask = server_of == index
                rows = np.flatnonzero(mask.any(axis=1))
                ids = torch.from_numpy(np.where(mask, ids_np, -1)[rows].astype(np.int32))
                rows = torch.from_numpy(rows + start).to(hidden.device)
                conn = self._by_id[table.servers[index]]
                conn.slot.send(layer_id, hidden[rows], ids, topk_weights[rows].float())
                sent.append((conn, rows))
            for conn, rows in sent:
                self._wait(conn, layer_id)
                out.index_add_(0, rows, conn.slot.result().to(out.device))
        return out

    def _wait(self, conn: ServerConnection, layer_id: int) -> None:
        if not conn.slot.wait(self.result_timeout, self.poll_spin):
            raise TransportError(
                f"expert server {conn.address} did not answer layer {layer_id} within "
                f"{self.result_timeout:.0f}s")

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.connections = []
