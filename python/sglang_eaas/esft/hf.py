"""ESFT adapters on a transformers model: where its routed experts are, and swapping them in.

transformers 5 keeps each MoE layer's routed experts fused in two parameters, ``gate_up_proj
[E, 2 * I, H]`` (gate rows, then up rows) and ``down_proj [E, H, I]``: the rows of the
expert servers' ``LayerExperts``, so an adapter's ``load_weights`` goes in row for row.
"""

from __future__ import annotations

from sglang_eaas.esft.adapter import EsftAdapter
from sglang_eaas.model_info import MoeModelInfo


def routed_experts(model, layer: int):
    """The fused routed-experts module of decoder layer ``layer`` (``gate_up_proj``,
    ``down_proj``); ``ValueError`` when the model does not keep them that way."""
    block = model.model.layers[layer]
    moe = getattr(block, "mlp", None) or getattr(block, "block_sparse_moe", None)
    experts = getattr(moe, "experts", None)
    if not (hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")):
        raise ValueError(f"layer {layer} of this transformers model has no fused routed experts "
                         "(gate_up_proj, down_proj)")
    return experts


def apply_adapter(model, info: MoeModelInfo, adapter: EsftAdapter) -> None:
    """Overwrite, in place, the base experts ``adapter`` replaces with its weights (converted to
    the model's dtype); every other weight is left as it is."""
    import torch

    with torch.no_grad():
        for layer, ids in adapter.experts.items():
            experts = routed_experts(model, layer)
            w13, w2 = adapter.load_weights(info, layer, ids, experts.gate_up_proj.dtype)
            rows = torch.tensor(ids, dtype=torch.long)
            experts.gate_up_proj[rows] = w13
            experts.down_proj[rows] = w2
