"""The model as the planner sees it: the expert shapes from ``model_info.MoeModelInfo`` (the
same reading of ``config.json`` the servers make) plus the attention shapes from the same file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sglang_eaas.model_info import ModelError, MoeModelInfo
from sglang_eaas.plan.errors import PlanInputError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec:
    info: MoeModelInfo
    folder: Path  # the checkpoint folder holding config.json (what a deploy config names)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dense_intermediate: int  # the MLP of a layer that is not MoE (0: every layer is MoE)
    dtype_bytes: int

    @property
    def moe_layers(self) -> int:
        return len(self.info.moe_layers)

    @property
    def expert_bytes(self) -> int:
        """One routed expert's weights: gate, up and down projections."""
        return 3 * self.info.hidden_size * self.info.moe_intermediate_size * self.dtype_bytes

    @property
    def expert_flops_per_entry(self) -> int:
        """FLOPs of one (token, expert) entry: three products of hidden x intermediate."""
        return 2 * 3 * self.info.hidden_size * self.info.moe_intermediate_size

    @property
    def attention_params(self) -> int:
        """Q, K, V and O projections of one layer."""
        h, d = self.info.hidden_size, self.head_dim
        return h * d * (2 * self.num_heads + 2 * self.num_kv_heads)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_side_bytes(self) -> int:
        """What an attention instance holds besides the KV cache: attention, router and dense
        layers' weights, embeddings and LM head (the routed experts are the servers')."""
        info = self.info
        dense = info.num_layers - self.moe_layers
        params = (info.num_layers * self.attention_params
                  + self.moe_layers * info.hidden_size * info.num_experts
                  + dense * 3 * info.hidden_size * self.dense_intermediate
                  + 2 * self.vocab_size * info.hidden_size)
        return params * self.dtype_bytes

    @classmethod
    def from_config(cls, path: str | Path) -> "ModelSpec":
        """From a checkpoint's ``config.json`` (or the folder holding one)."""
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        if path.is_dir():
            path = path / "config.json"
        if path.name != "config.json":
            raise PlanInputError(f"--model: {path} must be a checkpoint's config.json (or its "
                                 "folder): the servers read a file of that name")
        try:
            info = MoeModelInfo.from_model_path(folder)
            config = json.loads(path.read_text())
            heads = int(config["num_attention_heads"])
            spec = cls(info, folder, heads, int(config.get("num_key_value_heads", heads)),
                       int(config.get("head_dim") or info.hidden_size // heads),
                       int(config["vocab_size"]), int(config.get("intermediate_size", 0)),
                       DTYPE_BYTES[info.dtype])
        except ModelError as exc:
            raise PlanInputError(f"--model: {exc}") from None
        except KeyError as exc:
            raise PlanInputError(f"--model: {path} has no {exc.args[0]!r} (or a dtype the "
                                 f"planner knows: {', '.join(DTYPE_BYTES)})") from None
        except (TypeError, ValueError) as exc:
            raise PlanInputError(f"--model: {path} has a field of the wrong type ({exc})"
                                 ) from None
        if not info.moe_layers or not info.num_experts:
            raise PlanInputError(f"--model: {path} has no MoE layer")
        return spec
