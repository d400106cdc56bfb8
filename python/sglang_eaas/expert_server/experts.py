"""The routed experts an expert server holds, loaded straight from the safetensors files.

No model is instantiated: for each MoE layer only the gate/up/down tensors of this server's
experts are read (safetensors maps the files; each tensor is copied once, into the layer's
rows), so resident memory grows with the number of experts held, not with the model. Where the
rows live is the ``WeightStore``'s choice (a region of the weight fabric, or plain memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from sglang_eaas.checkpoint import tensor_files
from sglang_eaas.slices import Part
from sglang_eaas.expert_server.weight_store import WeightBacking, WeightStore
from sglang_eaas.holdings import HeldParts
from sglang_eaas.model_info import ModelError, MoeModelInfo


@dataclass
class LayerExperts:
    """One MoE layer's local experts.

    ``w13 [E_local, 2 * I, H]`` (gate rows, then up rows) and ``w2 [E_local, H, I]`` exactly as
    SGLang's FusedMoE stores them; ``local_index [num_experts]`` maps a global expert id to its
    row here, -1 for experts this server does not hold. A row no id maps to is never read
    (a layer mapped from a peer keeps the peer's rows; a dropped expert's row stays until the
    layer is compacted). ``backing``: the fabric region the rows live in (None: plain memory);
    versions of a layer may share one (``weight_store.py``, "Spare rows"). ``parts`` > 1: a
    layer of parts of experts (``slices.py``; ``w13 [n, 2I/P, H]``, ``w2 [n, H, I/P]``), whose
    ``local_index`` maps routed part ids ``e * P + p`` to rows.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    local_index: torch.Tensor
    backing: WeightBacking | None = None
    parts: int = 1  # > 1: rows are parts of experts, ``local_index`` over routed part ids

    def run(self, local_expert: int, x: torch.Tensor) -> torch.Tensor:
        """``expert(x)`` for ``x [n, H]``; the same ops as SGLang's ``moe_forward_native``."""
        gate_up = F.linear(x, self.w13[local_expert])
        d = gate_up.shape[-1] // 2
        return F.linear(F.silu(gate_up[..., :d]) * gate_up[..., d:], self.w2[local_expert])


def load_experts(model_path: str | Path, info: MoeModelInfo,
                 experts: list[int] | Mapping[int, list[int]],
                 dtype: torch.dtype, store: WeightStore | None = None,
                 part: Part | None = None) -> dict[int, LayerExperts]:
    """``{layer_id: LayerExperts}``: ``experts`` (global ids) in every MoE layer, or per layer
    (``{layer: ids}``; a layer with no ids, or not named, is not held at all); their rows where
    ``store`` puts them (plain memory by default). ``part``: only that part of each expert
    (``slices.py``; ``store`` then has the part's shape, ``part.info(info)``)."""
    model_path = Path(model_path)
    store = store or WeightStore(None, info if part is None else part.info(info), dtype)
    by_layer = ({layer: list(experts) for layer in info.moe_layers}
                if not isinstance(experts, Mapping) else
                {layer: list(ids) for layer, ids in experts.items() if ids})
    rows = {layer: [(e, part) for e in ids] for layer, ids in by_layer.items()}
    return {layer: LayerExperts(w13, w2, index_of(by_layer[layer], info.num_experts), backing)
            for layer, (w13, w2, backing) in _read_rows(model_path, info, rows, store).items()}


def load_parts(model_path: str | Path, info: MoeModelInfo, held: Mapping[int, HeldParts],
               dtype: torch.dtype, store: WeightStore | None = None
               ) -> dict[int, LayerExperts]:
    """``{layer_id: LayerExperts}`` of the parts of experts ``held`` names per MoE layer
    (``HeldParts``: routed ids ``e * P + p``), read straight from the checkpoint, one row per
    routed id in id order; each layer's ``local_index`` is over routed ids and its ``parts`` is
    ``P``. ``store``: of one part's shape (``Part(0, P).info(info)``: every layer the same
    ``P``); plain memory by default."""
    model_path = Path(model_path)
    if not held:
        return {}
    sizes = {h.parts for h in held.values()}
    if len(sizes) > 1:
        raise ModelError(f"one store holds one part width; layers are cut into {sorted(sizes)}")
    if store is None:
        store = WeightStore(None, Part(0, sizes.pop()).info(info), dtype)
    rows = {layer: [(i // h.parts, Part(i % h.parts, h.parts)) for i in h.ids]
            for layer, h in held.items() if h.ids}
    return {layer: LayerExperts(w13, w2, index_of(list(held[layer].ids),
                                                  info.num_experts * held[layer].parts),
                                backing, held[layer].parts)
            for layer, (w13, w2, backing) in _read_rows(model_path, info, rows, store).items()}


def _read_rows(model_path: Path, info: MoeModelInfo,
               rows: Mapping[int, list[tuple[int, Part | None]]], store: WeightStore
               ) -> dict[int, tuple[torch.Tensor, torch.Tensor, WeightBacking | None]]:
    """Per MoE layer, rows in ``store`` holding ``rows[layer]``'s (expert, part or None for
    whole) in order, read from the checkpoint (each tensor once)."""
    layers = {layer: store.empty(len(held)) for layer, held in rows.items()}
    _fill_rows(model_path, info, rows, {layer: (w13, w2) for layer, (w13, w2, _) in
                                        layers.items()})
    return layers


def read_experts_into(model_path: str | Path, info: MoeModelInfo, layer: int,
                      experts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> None:
    """``experts``' whole rows of ``layer`` from the checkpoint straight into ``w13 [n, 2I, H]``
    and ``w2 [n, H, I]`` (a new version's rows: nothing staged in between)."""
    _fill_rows(Path(model_path), info, {layer: [(e, None) for e in experts]}, {layer: (w13, w2)})


def _fill_rows(model_path: Path, info: MoeModelInfo,
               rows: Mapping[int, list[tuple[int, Part | None]]],
               into: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``rows[layer]``'s (expert, part or None) read from the checkpoint into ``into[layer]``'s
    rows, in order (each tensor read once)."""
    unknown = sorted(set(rows) - set(info.moe_layers))
    if unknown:
        raise ModelError(f"layers {unknown} are not MoE layers of {model_path} "
                         f"(those are {list(info.moe_layers)})")
    bad = sorted({e for held in rows.values() for e, _ in held if not 0 <= e < info.num_experts})
    if bad:
        raise ModelError(f"experts {bad} do not exist: the model has {info.num_experts}")
    files = tensor_files(model_path)
    # file -> (tensor, layer, row, projection: 0 gate, 1 up, 2 down, part)
    wanted: dict[Path, list[tuple[str, int, int, int, Part | None]]] = {}
    for layer, held in rows.items():
        for row, (expert, part) in enumerate(held):
            for projection, name in enumerate(info.expert_tensor_names(layer, expert)):
                if name not in files:
                    raise ModelError(f"tensor {name} is missing from {model_path}")
                wanted.setdefault(files[name], []).append((name, layer, row, projection, part))
    for file, names in wanted.items():
        with safe_open(file, "pt") as f:
            for name, layer, row, projection, part in names:
                w13, w2 = into[layer]
                inter = w2.shape[-1]  # the rows' width: I, or a part's I / P
                dst = (w13[row, :inter], w13[row, inter:], w2[row])[projection]
                tensor = f.get_tensor(name)  # gate, up, down (expert_tensor_names' order)
                dst.copy_(tensor if part is None else part.of(tensor, projection))


def index_of(experts: list[int], size: int) -> torch.Tensor:
    """``local_index [size]``: ``experts[i]`` at row ``i``, -1 elsewhere."""
    index = torch.full((size,), -1, dtype=torch.long)
    index[torch.tensor(experts, dtype=torch.long)] = torch.arange(len(experts))
    return index


def weight_bytes(layers: dict[int, LayerExperts]) -> int:
    """The bytes of the rows held (a layer mapped from a peer counts only the rows it uses)."""
    return sum(int((le.local_index >= 0).sum()) * (le.w13[0].nbytes + le.w2[0].nbytes)
               for le in layers.values() if le.w13.shape[0])


def held(layer: LayerExperts) -> list[int]:
    """The global expert ids of ``layer``'s rows, in row order."""
    rows = torch.nonzero(layer.local_index >= 0).flatten()
    return [int(e) for e in rows[torch.argsort(layer.local_index[rows])]]


def row_experts(layer: LayerExperts) -> np.ndarray:
    """``[rows]`` int64: each row's global expert id, -1 for a row no id maps to."""
    ids = np.full(layer.w13.shape[0], -1, dtype=np.int64)
    index = layer.local_index.numpy()
    mapped = np.flatnonzero(index >= 0)
    ids[index[mapped]] = mapped
    return ids


def grown(base: LayerExperts | None, experts: list[int], size: int, store: WeightStore
          ) -> tuple[LayerExperts, torch.Tensor, torch.Tensor]:
    """A new version of a layer in ``store``: ``base``'s experts (None: a layer not held yet),
    then rows for ``experts``, which the caller fills through the returned ``w13``, ``w2`` views
    of them. The new rows are appended in place where ``base``'s region has room for them (its
    rows are shared, not copied); else the version is a new region with ``base``'s live rows
    copied in order (compaction). ``size``: the local index's length at least (ESFT adapter
    experts' physical ids pass the model's expert count)."""
    size = max([size, *(e + 1 for e in experts)]
               + ([] if base is None else [base.local_index.numel()]))
    room = None if base is None else store.append(base.backing, len(experts))
    if room is not None:
        w13, w2, start = room
        index = torch.full((size,), -1, dtype=torch.long)
        index[:base.local_index.numel()] = base.local_index
        index[torch.tensor(experts, dtype=torch.long)] = torch.arange(start, w13.shape[0])
        return LayerExperts(w13, w2, index, base.backing), w13[start:], w2[start:]
    kept = [] if base is None else held(base)
    out13, out2, backing = store.empty(len(kept) + len(experts))
    if kept:
        _copy_rows(base, kept, out13[:len(kept)], out2[:len(kept)])
    layer = LayerExperts(out13, out2, index_of(kept + list(experts), size), backing)
    return layer, out13[len(kept):], out2[len(kept):]


def with_experts(layer: LayerExperts | None, experts: list[int], w13: torch.Tensor,
                 w2: torch.Tensor, num_experts: int, store: WeightStore) -> LayerExperts:
    """``grown`` with ``experts``' rows from ``w13``/``w2`` (any dtype)."""
    made, new13, new2 = grown(layer, experts, num_experts, store)
    new13.copy_(w13)
    new2.copy_(w2)
    return made


def without_experts(layer: LayerExperts, experts: list[int], store: WeightStore
                    ) -> LayerExperts | None:
    """A new ``LayerExperts`` without ``experts`` (None: nothing left): the same rows with
    those ids unmapped where the rows are this server's own region's (their rows stay, dead,
    until the layer is compacted); else a new version holding the others' rows."""
    keep = [e for e in held(layer) if e not in set(experts)]
    if not keep:
        return None
    if layer.backing is not None and not layer.backing.mapped:
        index = layer.local_index.clone()
        index[torch.tensor([e for e in experts if e < index.numel()], dtype=torch.long)] = -1
        return LayerExperts(layer.w13, layer.w2, index, layer.backing)
    out13, out2, backing = store.empty(len(keep))
    _copy_rows(layer, keep, out13, out2)
    return LayerExperts(out13, out2, index_of(keep, layer.local_index.numel()), backing)


def _copy_rows(layer: LayerExperts, experts: list[int], out13: torch.Tensor,
               out2: torch.Tensor) -> None:
    """``experts``' rows of ``layer`` into ``out13``/``out2``, in that order."""
    rows = layer.local_index[torch.tensor(experts, dtype=torch.long)]
    torch.index_select(layer.w13, 0, rows, out=out13)
    torch.index_select(layer.w2, 0, rows, out=out2)
