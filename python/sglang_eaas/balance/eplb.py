"""SGLang's own EPLB on the same statistics, for comparison: called, not copied.

``sglang.srt.eplb.eplb_algorithms.rebalance_experts`` (the ``deepseek`` algorithm, SGLang's
choice without expert groups) gets ``[1, L, E]`` tokens, ``S * slots`` physical experts and
``slots`` physical experts per GPU, one "GPU" per expert server: every server gets exactly
``slots`` physical experts of each layer, as EPLB requires. Physical expert ``p`` of a layer is
on server ``p // slots`` (EPLB numbers a GPU's physical experts contiguously).

EPLB may put two physical replicas of one expert on one GPU. Our servers hold an expert once,
so ``holdings`` lists it once there, and ``copies`` says how many physical replicas EPLB meant:
``evaluate.layer_load(..., copies=...)`` measures EPLB as SGLang runs it (that server gets that
many shares of the expert's tokens and streams that many weight sets), and without ``copies``
as our tier would run that placement (an even split over distinct holders).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sglang_eaas.holdings import Holdings
from sglang_eaas.placement import PlacementError


@dataclass(frozen=True)
class EplbPlacement:
    """EPLB's answer in our form."""

    holdings: Holdings  # server -> MoE layer -> distinct experts
    copies: dict[str, dict[int, dict[int, int]]]  # server -> layer -> expert -> physical replicas
    physical_to_logical: np.ndarray  # [L, S * slots] int64, EPLB's own map

    def layer_copies(self, layer: int) -> dict[str, dict[int, int]]:
        """``copies`` of one layer, as ``evaluate.layer_load`` takes it."""
        return {s: dict(per_layer[layer]) for s, per_layer in self.copies.items()}


def eplb_placement(loads: np.ndarray, layers: Sequence[int], servers: Sequence[str],
                   slots: int) -> EplbPlacement:
    """SGLang's EPLB placement of ``loads`` (``[L, E]`` tokens, rows in ``layers``' order) on
    ``servers`` with ``slots`` physical experts per layer per server (our placer's capacity)."""
    import torch
    from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm, rebalance_experts

    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2 or loads.shape[0] != len(layers):
        raise ValueError(f"loads must be [layers={len(layers)}, experts], got {loads.shape}")
    num_servers, num_experts = len(servers), loads.shape[1]
    if num_experts > num_servers * slots:
        raise PlacementError(f"{num_servers} servers of {slots} slots per layer cannot hold "
                             f"each of the {num_experts} experts once")
    phy2log, _, _ = rebalance_experts(
        tokens_per_expert=torch.from_numpy(loads).unsqueeze(0),
        num_physical_experts=num_servers * slots, num_local_physical_experts=slots,
        num_groups=None, num_nodes=1, algorithm=EplbAlgorithm.deepseek)
    phy2log = phy2log.numpy().astype(np.int64)
    placement: dict[str, dict[int, list[int]]] = {s: {} for s in servers}
    copies: dict[str, dict[int, dict[int, int]]] = {s: {} for s in servers}
    for row, layer in enumerate(layers):
        for g, s in enumerate(servers):
            counted = Counter(phy2log[row, g * slots:(g + 1) * slots].tolist())
            placement[s][layer] = sorted(counted)
            copies[s][layer] = dict(sorted(counted.items()))
    return EplbPlacement(Holdings(placement), copies, phy2log)
