"""An ESFT adapter on disk: which routed experts it replaces, and their weights.

The layout is ESFT's (Wang et al. 2024, deepseek-ai/ESFT): a directory with

- ``expert_config.json``: ``{"experts": {"<layer id>": [expert ids]}, "shared_experts": false,
  "non_expert_modules": false}``; layer keys are the model's decoder layer ids as strings;
- ``adapter.safetensors``: the replaced experts' gate/up/down tensors and nothing else, under
  the base checkpoint's own names (``MoeModelInfo.expert_tensor_names``);
- optionally ``metrics.json`` and ``README.md`` (written by the tools, not read here).

Only routed experts can be served as an adapter over a shared base model (ExpertWeave §2): an
adapter that also trained shared experts or non-expert weights (attention, router, norms) is
refused, as is every other inconsistency, with one sentence naming the adapter and the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from sglang_eaas.checkpoint import safetensors_header, tensor_files
from sglang_eaas.model_info import ModelError, MoeModelInfo, is_routed_expert_tensor

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "expert_config.json"
WEIGHTS_FILE = "adapter.safetensors"
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # safetensors dtype -> bytes
_TORCH_SIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


class AdapterError(ValueError):
    """An ESFT adapter that cannot be served over the given base model."""


def default_max_experts(num_experts: int) -> int:
    """The most experts an adapter replaces in one MoE layer, by default: a quarter of the
    model's (``--eaas-esft-max-experts``' default, and the most ``tools.esft random``
    replaces unless told, so that what the tool makes is served with default flags)."""
    return max(1, num_experts // 4)


@dataclass(frozen=True)
class EsftAdapter:
    """A validated adapter (``load_adapter``): ``experts`` maps a MoE layer id to the sorted base
    expert ids it replaces; layers it does not touch are absent."""

    path: Path
    experts: Mapping[int, tuple[int, ...]]

    @property
    def count(self) -> int:
        """Experts replaced, over all layers."""
        return sum(len(ids) for ids in self.experts.values())

    @property
    def per_layer_max(self) -> int:
        """The most experts replaced in one layer (0 for an empty adapter)."""
        return max((len(ids) for ids in self.experts.values()), default=0)

    def weight_bytes(self, info: MoeModelInfo, dtype: str | None = None) -> int:
        """Bytes of the replaced experts' weights held in ``dtype`` (torch name, default the
        model's ``info.dtype``): ``count`` x 3 projections of ``hidden x intermediate``."""
        size = _TORCH_SIZE[(dtype or info.dtype).removeprefix("torch.")]
        return self.count * 3 * info.hidden_size * info.moe_intermediate_size * size

    def load_weights(self, info: MoeModelInfo, layer: int, experts, dtype: torch.dtype):
        """``(w13 [n, 2 * I, H], w2 [n, H, I])`` in ``dtype`` for ``experts`` (n ids this adapter
        replaces in ``layer``), rows in the order given, as ``expert_server.experts.LayerExperts``
        stores them: w13 = gate rows then up rows, w2 = down."""
        import torch
        from safetensors import safe_open

        experts = [int(e) for e in experts]
        held = self.experts.get(layer, ())
        missing = [e for e in experts if e not in held]
        if missing:
            raise AdapterError(f"ESFT adapter {self.path} does not replace experts {missing} of "
                               f"layer {layer} (it replaces {list(held)} there)")
        w13, w2 = [], []
        with safe_open(self.path / WEIGHTS_FILE, "pt") as f:
            for expert in experts:
                gate, up, down = (f.get_tensor(n).to(dtype)
                                  for n in info.expert_tensor_names(layer, expert))
                w13.append(torch.cat([gate, up]))
                w2.append(down)
        if not experts:
            inter, hidden = info.moe_intermediate_size, info.hidden_size
            return (torch.empty(0, 2 * inter, hidden, dtype=dtype),
                    torch.empty(0, hidden, inter, dtype=dtype))
        return torch.stack(w13), torch.stack(w2)

    def digest(self, info: MoeModelInfo, layer: int, expert: int) -> str:
        """sha256 (hex) of the raw bytes of one replaced expert's gate, up and down tensors, in
        that order, as stored in ``adapter.safetensors``."""
        return self.digests(info, {layer: (expert,)})[layer][expert]

    def digests(self, info: MoeModelInfo, wanted: Mapping[int, Iterable[int]]
                ) -> dict[int, dict[int, str]]:
        """``digest`` of each of ``wanted``'s experts (MoE layer -> expert ids), the file's
        header read once: MoE layer -> expert -> digest."""
        for layer, experts in wanted.items():
            missing = [e for e in experts if e not in self.experts.get(layer, ())]
            if missing:
                raise AdapterError(f"ESFT adapter {self.path} does not replace experts "
                                   f"{missing} of layer {layer}")
        path = self.path / WEIGHTS_FILE
        header, data_start = _read_header(self.path, path)
        out: dict[int, dict[int, str]] = {}
        fd = os.open(path, os.O_RDONLY)
        try:
            for layer, experts in wanted.items():
                for expert in experts:
                    h = hashlib.sha256()
                    for name in info.expert_tensor_names(layer, expert):
                        begin, end = header[name]["data_offsets"]
                        h.update(os.pread(fd, end - begin, data_start + begin))
                    out.setdefault(layer, {})[expert] = h.hexdigest()
        finally:
            os.close(fd)
        return out


def _fail(path: Path, problem: str) -> AdapterError:
    return AdapterError(f"ESFT adapter {path}: {problem}")


def _read_header(adapter: Path, path: Path, whole: bool = False) -> tuple[dict, int]:
    """The header of ``path`` (``whole``: and safetensors' own check of the file: offsets
    within it, no gaps, the length)."""
    from safetensors import SafetensorError, safe_open

    try:
        header = safetensors_header(path)
        if whole:
            with safe_open(path, "pt"):
                pass
        return header
    except ModelError as exc:
        raise _fail(adapter, f"{path.name} is missing or not a readable safetensors file "
                             f"({exc.__cause__ or exc})") from exc
    except SafetensorError as exc:
        raise _fail(adapter, f"{path.name} is not a valid safetensors file ({exc})") from exc


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise _fail(path, f"cannot read {CONFIG_FILE} ({exc})") from exc
    if not isinstance(config, dict) or not isinstance(config.get("experts"), dict):
        raise _fail(path, f"{CONFIG_FILE} has no \"experts\" object mapping layer ids to "
                          "expert lists")
    if config.get("shared_experts", False) is not False:
        raise _fail(path, "it touches shared experts (\"shared_experts\" is not false), "
                          "which an adapter over a shared base model cannot replace")
    if config.get("non_expert_modules", False) is not False:
        raise _fail(path, "it touches non-expert weights (\"non_expert_modules\" is not "
                          "false), which an adapter over a shared base model cannot replace")
    return config


def _parse_experts(path: Path, config: dict, info: MoeModelInfo,
                   slot_budget: int | None) -> dict[int, tuple[int, ...]]:
    experts: dict[int, tuple[int, ...]] = {}
    for key, ids in config["experts"].items():
        if not (isinstance(key, str) and key.isdigit()):
            raise _fail(path, f"layer key {key!r} in {CONFIG_FILE} is not a decoder layer id")
        layer = int(key)
        if layer not in info.moe_layers:
            raise _fail(path, f"layer {layer} is not a MoE layer of the model (its MoE layers "
                              f"are {list(info.moe_layers)})")
        if not isinstance(ids, list) or any(type(e) is not int for e in ids):
            raise _fail(path, f"layer {layer}'s entry in {CONFIG_FILE} is not a list of "
                              "integer expert ids")
        bad = [e for e in ids if not 0 <= e < info.num_experts]
        if bad:
            raise _fail(path, f"expert {bad[0]} of layer {layer} is out of range (the model "
                              f"has experts 0..{info.num_experts - 1})")
        twice = sorted({e for e in ids if ids.count(e) > 1})
        if twice:
            raise _fail(path, f"expert {twice[0]} is listed twice in layer {layer}")
        if slot_budget is not None and len(ids) > slot_budget:
            raise _fail(path, f"layer {layer} replaces {len(ids)} experts, more than the "
                              f"{slot_budget} adapter slots per layer")
        if ids:
            experts[layer] = tuple(sorted(ids))
    return dict(sorted(experts.items()))


def _expected(info: MoeModelInfo, experts: Mapping[int, tuple[int, ...]]) -> dict[str, tuple]:
    """Tensor name -> (layer, expert, projection: 0 gate, 1 up, 2 down) of every tensor the
    adapter must hold."""
    return {name: (layer, e, proj) for layer, ids in experts.items() for e in ids
            for proj, name in enumerate(info.expert_tensor_names(layer, e))}


def _base_shapes(info: MoeModelInfo, model_path: str | Path | None,
                 expected: dict[str, tuple]) -> dict[str, list[int]]:
    """The base checkpoint's shape of each expected tensor: from its safetensors headers when
    ``model_path`` is given, else from ``info`` (gate and up [I, H], down [H, I])."""
    if model_path is None:
        inter, hidden = info.moe_intermediate_size, info.hidden_size
        return {name: [hidden, inter] if proj == 2 else [inter, hidden]
                for name, (_, _, proj) in expected.items()}
    files = tensor_files(model_path)
    headers: dict[Path, dict] = {}
    shapes = {}
    for name in expected:
        if name not in files:
            raise ModelError(f"tensor {name} is missing from {model_path}")
        if files[name] not in headers:
            headers[files[name]] = safetensors_header(files[name])[0]
        shapes[name] = headers[files[name]][name]["shape"]
    return shapes


def load_adapter(path: str | Path, info: MoeModelInfo, slot_budget: int | None = None, *,
                 model_path: str | Path | None = None) -> EsftAdapter:
    """Read and validate the adapter at ``path`` for the model ``info`` describes; with
    ``slot_budget``, no layer may replace more experts than that. Tensor shapes are checked
    against the base checkpoint's safetensors headers at ``model_path`` (if given, else against
    ``info``'s sizes); their dtype may differ from the base's (weights are converted on load)
    but must be floating point. Raises ``AdapterError`` (one sentence) on any problem."""
    path = Path(path)
    if not path.is_dir():
        raise _fail(path, "no such directory")
    experts = _parse_experts(path, _read_config(path), info, slot_budget)
    header, _ = _read_header(path, path / WEIGHTS_FILE, whole=True)
    expected = _expected(info, experts)
    for name in sorted(header):
        if name == "__metadata__" or name in expected:
            continue
        if not is_routed_expert_tensor(name):
            raise _fail(path, f"{WEIGHTS_FILE} holds {name}, which is not a routed expert's "
                              "weight (an adapter may replace routed experts only)")
        raise _fail(path, f"{WEIGHTS_FILE} holds {name}, a routed expert's weight that "
                          f"{CONFIG_FILE} does not list")
    for name, (layer, expert, _) in expected.items():
        if name not in header:
            raise _fail(path, f"{WEIGHTS_FILE} lacks {name} of expert {expert} in layer "
                              f"{layer}, which {CONFIG_FILE} lists")
    try:
        shapes = _base_shapes(info, model_path, expected)
    except ModelError as exc:
        raise _fail(path, f"its base checkpoint cannot be checked ({exc})") from exc
    for name in expected:
        entry = header[name]
        if entry["dtype"] not in FLOAT_DTYPES:
            raise _fail(path, f"{name} has dtype {entry['dtype']}, not a floating-point type")
        if list(entry["shape"]) != list(shapes[name]):
            raise _fail(path, f"{name} has shape {list(entry['shape'])} but the base "
                              f"checkpoint's is {list(shapes[name])}")
    return EsftAdapter(path, experts)


def write_adapter(out: str | Path, info: MoeModelInfo,
                  experts_weights: Mapping[int, Mapping[int, tuple]],
                  metadata: Mapping[str, str] | None = None) -> EsftAdapter:
    """Write an adapter to ``out`` (created if needed): ``experts_weights`` is
    ``{layer: {expert: (gate [I, H], up [I, H], down [H, I])}}`` (tensors in the dtype to store;
    layers with no experts are left out of ``expert_config.json``); ``metadata`` (strings) goes,
    with the base model's fingerprint, as JSON into the safetensors header's ``esft`` entry.
    Returns the adapter as ``load_adapter`` reads it back."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    experts = {int(layer): sorted(int(e) for e in by_expert)
               for layer, by_expert in sorted(experts_weights.items()) if by_expert}
    tensors = {}
    for layer, ids in experts.items():
        for e in ids:
            names = info.expert_tensor_names(layer, e)
            for name, tensor in zip(names, experts_weights[layer][e], strict=True):
                tensors[name] = tensor.detach().contiguous()
    config = {"experts": {str(layer): ids for layer, ids in experts.items()},
              "shared_experts": False, "non_expert_modules": False}
    (out / CONFIG_FILE).write_text(json.dumps(config) + "\n")
    # One metadata key: safetensors writes several in hash order, which would change the bytes.
    meta = {"base_fingerprint": info.fingerprint(), **(metadata or {})}
    save_file(tensors, out / WEIGHTS_FILE, metadata={"esft": json.dumps(meta, sort_keys=True)})
    return load_adapter(out, info)
