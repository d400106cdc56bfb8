"""The routed experts an expert server holds, loaded straight from the safetensors files.

No model is instantiated: for each MoE layer only the gate/up/down tensors of this server's
experts are read (safetensors maps the files; each tensor is copied out once), so resident
memory grows with the number of experts held, not with the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from safetensors import safe_open

from sglang_eaas.checkpoint import tensor_files
from sglang_eaas.model_info import ModelError, MoeModelInfo


@dataclass
class LayerExperts:
    """One MoE layer's local experts.

    ``w13 [E_local, 2 * I, H]`` (gate rows, then up rows) and ``w2 [E_local, H, I]`` exactly as
    SGLang's FusedMoE stores them; ``local_index [num_experts]`` maps a global expert id to its
    row here, -1 for experts this server does not hold.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    local_index: torch.Tensor

    def run(self, local_expert: int, x: torch.Tensor) -> torch.Tensor:
        """``expert(x)`` for ``x [n, H]``; the same ops as SGLang's ``moe_forward_native``."""
        gate_up = F.linear(x, self.w13[local_expert])
        d = gate_up.shape[-1] // 2
        return F.linear(F.silu(gate_up[..., :d]) * gate_up[..., d:], self.w2[local_expert])


def load_experts(model_path: str | Path, info: MoeModelInfo,
                 experts: list[int] | Mapping[int, list[int]],
                 dtype: torch.dtype) -> dict[int, LayerExperts]:
    """``{layer_id: LayerExperts}``: ``experts`` (global ids) in every MoE layer, or per layer
    (``{layer: ids}``; a layer with no ids, or not named, is not held at all)."""
    model_path = Path(model_path)
    by_layer = ({layer: list(experts) for layer in info.moe_layers}
                if not isinstance(experts, Mapping) else
                {layer: list(ids) for layer, ids in experts.items() if ids})
    unknown = sorted(set(by_layer) - set(info.moe_layers))
    if unknown:
        raise ModelError(f"layers {unknown} are not MoE layers of {model_path} "
                         f"(those are {list(info.moe_layers)})")
    bad = sorted({e for ids in by_layer.values() for e in ids if not 0 <= e < info.num_experts})
    if bad:
        raise ModelError(f"experts {bad} do not exist: the model has {info.num_experts}")
    files = tensor_files(model_path)
    wanted: dict[Path, list[str]] = {}
    for layer, ids in by_layer.items():
        for expert in ids:
            for name in info.expert_tensor_names(layer, expert):
                if name not in files:
                    raise ModelError(f"tensor {name} is missing from {model_path}")
                wanted.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in wanted.items():
        with safe_open(file, "pt") as f:
            for name in names:
                tensors[name] = f.get_tensor(name).to(dtype)
    layers = {}
    for layer, ids in by_layer.items():
        local_index = torch.full((info.num_experts,), -1, dtype=torch.long)
        local_index[torch.tensor(ids, dtype=torch.long)] = torch.arange(len(ids))
        gates, ups, downs = zip(*(
            [tensors.pop(n) for n in info.expert_tensor_names(layer, e)] for e in ids))
        layers[layer] = LayerExperts(
            w13=torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)]),
            w2=torch.stack(downs),
            local_index=local_index,
        )
    return layers


def weight_bytes(layers: dict[int, LayerExperts]) -> int:
    return sum(le.w13.nbytes + le.w2.nbytes for le in layers.values())


def held(layer: LayerExperts) -> list[int]:
    """The global expert ids of ``layer``'s rows, in row order."""
    rows = torch.nonzero(layer.local_index >= 0).flatten()
    return [int(e) for e in rows[torch.argsort(layer.local_index[rows])]]


def with_experts(layer: LayerExperts | None, experts: list[int], w13: torch.Tensor,
                 w2: torch.Tensor, num_experts: int) -> LayerExperts:
    """A new ``LayerExperts``: ``layer``'s rows (same local rows), then ``experts`` (rows of
    ``w13``/``w2``). ``layer`` None: a layer this server did not hold. Ids past
    ``num_experts`` (ESFT adapter experts' physical ids) grow the local index."""
    size = max([num_experts, *(e + 1 for e in experts)]
               + ([] if layer is None else [layer.local_index.numel()]))
    if layer is None:
        index = torch.full((size,), -1, dtype=torch.long)
        index[torch.tensor(experts, dtype=torch.long)] = torch.arange(len(experts))
        return LayerExperts(w13.contiguous(), w2.contiguous(), index)
    index = torch.full((size,), -1, dtype=torch.long)
    index[:layer.local_index.numel()] = layer.local_index
    index[torch.tensor(experts, dtype=torch.long)] = torch.arange(
        layer.w13.shape[0], layer.w13.shape[0] + len(experts))
    return LayerExperts(torch.cat([layer.w13, w13.to(layer.w13.dtype)]),
                        torch.cat([layer.w2, w2.to(layer.w2.dtype)]), index)


def without_experts(layer: LayerExperts, experts: list[int]) -> LayerExperts | None:
    """A new ``LayerExperts`` without ``experts``' rows (None: nothing left)."""
    keep = [e for e in held(layer) if e not in set(experts)]
    if not keep:
        return None
    rows = layer.local_index[torch.tensor(keep, dtype=torch.long)]
    index = torch.full_like(layer.local_index, -1)
    index[torch.tensor(keep, dtype=torch.long)] = torch.arange(len(keep))
    return LayerExperts(layer.w13[rows].contiguous(), layer.w2[rows].contiguous(), index)
