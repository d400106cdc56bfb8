"""What both ends need to know about an MoE checkpoint, read from its ``config.json`` alone."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path


# Per-expert checkpoint tensors: "...mlp.experts.3.gate_proj.weight" (Qwen3-MoE, DeepSeek),
# "...block_sparse_moe.experts.3.w1.weight" (Mixtral). Shared experts have no index after
# "experts" ("shared_expert.", "shared_experts.") and do not match.
_ROUTED_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")


def is_routed_expert_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to a routed expert (the expert servers' share)."""
    return _ROUTED_EXPERT_TENSOR.search(name) is not None


class ModelError(ValueError):
    """The checkpoint is not an MoE model this version can serve with expert servers."""


# model_type -> (expert tensor name pattern, gate/up/down projection names)
_EXPERT_NAMES = {
    "qwen3_moe": ("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight",
                  ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
                ("w1", "w3", "w2")),
}


@dataclass(frozen=True)
class MoeModelInfo:
    model_type: str
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    dtype: str  # the checkpoint's stored dtype, e.g. "float32"

    @classmethod
    def from_model_path(cls, model_path: str | Path) -> "MoeModelInfo":
        path = Path(model_path) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read {path}: {exc}") from exc
        model_type = config.get("model_type")
        if model_type not in _EXPERT_NAMES:
            raise ModelError(
                f"model_type {model_type!r} is not supported with expert servers "
                f"(supported: {', '.join(_EXPERT_NAMES)})"
            )
        layers = config["num_hidden_layers"]
        num_experts = config.get("num_local_experts", config.get("num_experts"))
        if model_type == "qwen3_moe":
            step = config.get("decoder_sparse_step", 1)
            dense = set(config.get("mlp_only_layers", []))
            moe_layers = tuple(i for i in range(layers)
                               if i not in dense and num_experts and (i + 1) % step == 0)
            intermediate = config["moe_intermediate_size"]
        else:
            moe_layers, intermediate = tuple(range(layers)), config["intermediate_size"]
        return cls(model_type, layers, moe_layers, num_experts, config["num_experts_per_tok"],
                   config["hidden_size"], intermediate,
                   config.get("dtype") or config.get("torch_dtype") or "float32")

    def expert_tensor_names(self, layer: int, expert: int) -> tuple[str, str, str]:
        """Checkpoint names of the gate, up and down projections of one routed expert."""
        pattern, projs = _EXPERT_NAMES[self.model_type]
        return tuple(pattern.format(layer=layer, expert=expert, proj=p) for p in projs)

    def fingerprint(self) -> str:
        """Digest of the expert-relevant shape of the model; clients and servers must agree."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]
