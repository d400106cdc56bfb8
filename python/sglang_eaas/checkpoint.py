"""A checkpoint's safetensors files: where each tensor is, and digests of its routed experts.

Clients and expert servers must hold the same expert weights, not only the same model shape
(``MoeModelInfo.fingerprint``): two checkpoints of one shape (another seed, a fine-tune, a merged
adapter) would otherwise mix silently. ``expert_digests`` is cheap enough to run at every start:
for each tensor of an expert (every MoE layer, gate/up/down) it hashes the tensor's safetensors
header entry (dtype, shape) and ``SAMPLES`` windows of ``WINDOW`` bytes spread over its data,
read with ``pread``; nothing is loaded. A checkpoint that differs in a few weights inside an
unsampled window goes unnoticed: the check catches another checkpoint, not a flipped bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from sglang_eaas.model_info import ModelError, MoeModelInfo

SAMPLES = 4  # windows per tensor: its first and last bytes and two in between
WINDOW = 64  # bytes per window


def tensor_files(model_path: str | Path) -> dict[str, Path]:
    """Checkpoint tensor name -> the safetensors file holding it."""
    model_path = Path(model_path)
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"cannot read the weight map of {index}: {exc}") from exc
        return {name: model_path / file for name, file in weight_map.items()}
    single = model_path / "model.safetensors"
    if not single.exists():
        raise ModelError(f"no model.safetensors or model.safetensors.index.json in {model_path}")
    return {name: single for name in safetensors_header(single)[0] if name != "__metadata__"}


def safetensors_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> dtype, shape, data_offsets) and where data starts."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise ModelError(f"{path} is not a readable safetensors file: {exc}") from exc
    return header, 8 + size


def expert_digests(model_path: str | Path, info: MoeModelInfo,
                   experts: list[int] | None = None) -> dict[int, str]:
    """``{expert: digest}`` of the routed experts' weights (all experts by default)."""
    files = tensor_files(model_path)
    headers: dict[Path, tuple[dict, int]] = {}
    fds: dict[Path, int] = {}
    digests = {}
    try:
        for expert in range(info.num_experts) if experts is None else experts:
            h = hashlib.sha256()
            for layer in info.moe_layers:
                for name in info.expert_tensor_names(layer, expert):
                    if name not in files:
                        raise ModelError(f"tensor {name} is missing from {model_path}")
                    path = files[name]
                    if path not in headers:
                        headers[path] = safetensors_header(path)
                        fds[path] = os.open(path, os.O_RDONLY)
                    header, data_start = headers[path]
                    entry = header.get(name)
                    if entry is None:
                        raise ModelError(f"tensor {name} is not in {path}")
                    begin, end = entry["data_offsets"]
                    h.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
                    span = max(end - begin - WINDOW, 0)
                    for i in range(SAMPLES):
                        at = data_start + begin + span * i // (SAMPLES - 1)
                        h.update(os.pread(fds[path], min(WINDOW, end - begin), at))
            digests[expert] = h.hexdigest()[:16]
    finally:
        for fd in fds.values():
            os.close(fd)
    return digests


@dataclass(frozen=True)
class ModelIdentity:
    """What a client shows an expert server when it joins: the model's MoE shape and the digests
    of every routed expert's weights (``expert_digests`` in expert order)."""

    fingerprint: str
    expert_digests: tuple[str, ...]

    @classmethod
    def of(cls, model_path: str | Path, info: MoeModelInfo | None = None) -> "ModelIdentity":
        info = info or MoeModelInfo.from_model_path(model_path)
        digests = expert_digests(model_path, info)
        return cls(info.fingerprint(), tuple(digests[e] for e in range(info.num_experts)))
