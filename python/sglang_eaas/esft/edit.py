"""Adapters made without training, and adapters merged into a full checkpoint.

- ``random_adapter``: a deterministic adapter for tests: each replaced expert is the base
  expert plus Gaussian noise of ``scale`` times each tensor's own standard deviation, stored in
  the base dtype. Every tensor's noise comes from its own generator, seeded by the seed and a
  CRC of the tensor's name, so one expert's weights do not depend on which others are chosen.
- ``merge``: the base checkpoint with an adapter's experts written over the ones they replace:
  ESFT's merge-and-serve, the reference a served adapter must equal token for token.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Mapping, Sequence

from sglang_eaas.checkpoint import tensor_files
from sglang_eaas.esft.adapter import AdapterError, EsftAdapter, load_adapter, write_adapter
from sglang_eaas.model_info import MoeModelInfo

DEFAULT_SCALE = 2.0  # twice the weights' spread: most 12-token greedy continuations change (tested)
DEFAULT_EXPERTS_PER_LAYER = 4


def choose_experts(info: MoeModelInfo, seed: int, per_layer: int,
                   layers: Sequence[int] | None = None) -> dict[int, list[int]]:
    """``per_layer`` experts of each of ``layers`` (default every MoE layer), drawn by ``seed``."""
    import torch

    layers = list(info.moe_layers) if layers is None else list(layers)
    bad = [layer for layer in layers if layer not in info.moe_layers]
    if bad:
        raise ValueError(f"--layers: {bad[0]} is not a MoE layer of the model (those are "
                         f"{list(info.moe_layers)})")
    if not 0 <= per_layer <= info.num_experts:
        raise ValueError(f"--experts-per-layer must be in 0..{info.num_experts}")
    gen = torch.Generator().manual_seed(seed)
    return {layer: sorted(torch.randperm(info.num_experts, generator=gen)[:per_layer].tolist())
            for layer in sorted(layers)}


def parse_experts(text: str) -> dict[int, list[int]]:
    """``--experts`` JSON (``{"<layer>": [expert ids]}``) as ``{layer: ids}``."""
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        return {int(layer): [int(e) for e in ids] for layer, ids in raw.items()}
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--experts must be a JSON object of layer ids to expert id lists, "
                         f"like '{{\"0\": [1, 2]}}' ({exc})") from exc


def random_adapter(model_path: str | Path, out: str | Path, experts: Mapping[int, list[int]],
                   seed: int = 0, scale: float = DEFAULT_SCALE) -> EsftAdapter:
    """Write an adapter replacing ``experts`` (``{layer: ids}``) with noisy copies of the base
    experts to ``out``; checked with ``load_adapter`` against the base checkpoint."""
    import torch
    from safetensors import safe_open

    if not scale >= 0:
        raise ValueError("--scale must be >= 0")
    info = MoeModelInfo.from_model_path(model_path)
    for layer, ids in experts.items():
        if layer not in info.moe_layers:
            raise ValueError(f"--experts: layer {layer} is not a MoE layer of the model (those "
                             f"are {list(info.moe_layers)})")
        if any(not 0 <= e < info.num_experts for e in ids) or len(set(ids)) < len(ids):
            raise ValueError(f"--experts: layer {layer}'s ids must be distinct experts in "
                             f"0..{info.num_experts - 1}")
    files = tensor_files(model_path)
    weights: dict[int, dict[int, tuple]] = {}
    for layer, ids in sorted(experts.items()):
        for e in ids:
            noisy = []
            names = info.expert_tensor_names(layer, e)
            for name in names:
                with safe_open(files[name], "pt") as f:
                    base = f.get_tensor(name)
                # CPU generators use 32 bits of a seed: one CRC of both seed and name.
                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
                noise = torch.randn(base.shape, generator=gen, dtype=torch.float32)
                noisy.append((base.float() + scale * base.float().std() * noise).to(base.dtype))
            weights.setdefault(layer, {})[e] = tuple(noisy)
    write_adapter(out, info, weights, {"tool": "python -m sglang_eaas.tools.esft random",
                                       "seed": str(seed), "scale": str(scale)})
    return load_adapter(out, info, model_path=model_path)


def merge(model_path: str | Path, adapter_path: str | Path, out: str | Path) -> EsftAdapter:
    """Write ``model_path`` with the adapter's experts in place of the base ones to ``out``:
    the same safetensors file names and metadata, every other tensor byte for byte, the
    adapter's weights converted to the base tensors' dtype, and the configuration, generation
    and tokenizer files copied (not the base's README.md and metrics.json)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    model_path, out = Path(model_path), Path(out)
    info = MoeModelInfo.from_model_path(model_path)
    adapter = load_adapter(adapter_path, info, model_path=model_path)
    if out.resolve() == model_path.resolve():
        raise AdapterError(f"ESFT adapter {adapter.path}: merge would overwrite its base model "
                           f"{model_path}; give another output directory")
    out.mkdir(parents=True, exist_ok=True)
    for item in sorted(model_path.iterdir()):
        if item.is_file() and not item.name.endswith(".safetensors") \
                and item.name not in ("README.md", "metrics.json"):
            shutil.copy2(item, out / item.name)
    replaced = {}
    with safe_open(adapter.path / "adapter.safetensors", "pt") as f:
        for layer, ids in adapter.experts.items():
            for e in ids:
                for name in info.expert_tensor_names(layer, e):
                    replaced[name] = f.get_tensor(name)
    for file in sorted(set(tensor_files(model_path).values())):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(file, "pt") as f:
            metadata = f.metadata()
            for name in f.keys():
                base = f.get_tensor(name)
                tensors[name] = replaced[name].to(base.dtype) if name in replaced else base
        save_file(tensors, out / file.name, metadata=metadata)
    (out / "README.md").write_text(
        f"# Merged: {model_path.name} + ESFT adapter {adapter.path.name}\n\n"
        f"`{model_path}` with the {adapter.count} routed experts of the ESFT adapter "
        f"`{adapter.path}` in place of the base ones (python -m sglang_eaas.tools.esft merge); "
        "every other tensor is the base model's, byte for byte.\n")
    return adapter
