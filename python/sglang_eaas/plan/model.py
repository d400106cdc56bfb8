"""The model as the planner sees it: the expert shapes from ``model_info.MoeModelInfo`` (the
same reading of ``config.json`` the servers make) plus the attention shapes from the same file.

DeepSeek-V2/V3 configs (``deepseek_v2``, ``deepseek_v3``) are read here too, for projections and
published anchors only: their attention is MLA (a compressed latent KV of ``kv_lora_rank`` +
``qk_rope_head_dim`` values a token, attention computed on it with the up-projections absorbed,
as SGLang's and FlashMLA's decode do), their MoE layers have shared experts, and an FP8 checkpoint
(``quantization_config.quant_method: fp8``) keeps its KV cache in the activations' dtype (SGLang's
``--kv-cache-dtype auto``). The expert servers do not serve them (``model_info``), so the planner
writes no deploy config for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sglang_eaas.model_info import ModelError, MoeModelInfo
from sglang_eaas.plan.errors import PlanInputError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "fp8": 1}
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3)."""

    q_lora_rank: int  # 0: queries projected from the hidden state directly
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


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
    shared_intermediate: int = 0  # the shared experts' MLP of an MoE layer, on the attention side
    mla: Mla | None = None
    kv_dtype: str = ""  # the KV cache's dtype where it is not the weights' (an FP8 checkpoint's)

    @property
    def servable(self) -> bool:
        """Whether the expert servers serve this model (``model_info`` reads its experts)."""
        return self.mla is None and self.shared_intermediate == 0

    @property
    def kv_dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.kv_dtype] if self.kv_dtype else self.dtype_bytes

    @property
    def activation_bytes(self) -> int:
        """A hidden state's value: the activations' dtype, which an FP8 checkpoint's is not
        (SGLang computes it in BF16; its KV cache, ``kv_dtype``, is in that dtype too). What
        the tier ships to the expert servers and back."""
        return self.kv_dtype_bytes

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
        """Q, K, V and O projections of one layer (MLA: its down- and up-projections)."""
        h, d, m = self.info.hidden_size, self.head_dim, self.mla
        if m is None:
            return h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = (h * m.q_lora_rank + m.q_lora_rank * self.num_heads * qk if m.q_lora_rank
             else h * self.num_heads * qk)
        kv = (h * (m.kv_lora_rank + m.qk_rope_head_dim)
              + m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim))
        return q + kv + self.num_heads * m.v_head_dim * h

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """A token's cached keys and values in one layer (MLA: its latent and rotary key)."""
        if self.mla is not None:
            return (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim) * self.kv_dtype_bytes
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one (query, key) pair over all heads: scores and the weighted values (MLA:
        on the latent, the up-projections absorbed into the query and the output)."""
        if self.mla is not None:
            m = self.mla
            return 2 * self.num_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
        return 4 * self.num_heads * self.head_dim

    @property
    def shared_params(self) -> int:
        """The shared experts' weights of one MoE layer (gate, up and down)."""
        return 3 * self.info.hidden_size * self.shared_intermediate

    @property
    def attention_side_bytes(self) -> int:
        """What an attention instance holds besides the KV cache: attention, router and dense
        layers' weights, embeddings and LM head (the routed experts are the servers')."""
        info = self.info
        dense = info.num_layers - self.moe_layers
        params = (info.num_layers * self.attention_params
                  + self.moe_layers * (info.hidden_size * info.num_experts + self.shared_params)
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
            config = json.loads(path.read_text())
            model_type = config.get("model_type")
        except (OSError, ValueError, AttributeError) as exc:
            raise PlanInputError(f"--model: cannot read {path} as a JSON object: {exc}"
                                 ) from None
        try:
            if model_type in DEEPSEEK_TYPES:
                return _deepseek(config, folder)
            info = MoeModelInfo.from_model_path(folder)
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


def _deepseek(c: dict, folder: Path) -> ModelSpec:
    """A DeepSeek-V2/V3 ``config.json``'s fields (module docstring); KeyError, TypeError or
    ValueError on a missing or malformed field, which ``from_config`` words."""
    layers, dense = int(c["num_hidden_layers"]), int(c.get("first_k_dense_replace", 0))
    step = int(c.get("moe_layer_freq", 1))
    quant = (c.get("quantization_config") or {}).get("quant_method")
    activations = c.get("torch_dtype") or c.get("dtype") or "bfloat16"
    dtype = "float8_e4m3fn" if quant == "fp8" else activations
    info = MoeModelInfo(c["model_type"], layers,
                        tuple(i for i in range(dense, layers) if (i - dense) % step == 0),
                        int(c["n_routed_experts"]), int(c["num_experts_per_tok"]),
                        int(c["hidden_size"]), int(c["moe_intermediate_size"]), dtype)
    heads = int(c["num_attention_heads"])
    mla = Mla(int(c.get("q_lora_rank") or 0), int(c["kv_lora_rank"]),
              int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"]))
    return ModelSpec(info, folder, heads, heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                     int(c["vocab_size"]), int(c.get("intermediate_size", 0)),
                     DTYPE_BYTES[dtype],
                     shared_intermediate=int(c.get("n_shared_experts") or 0)
                     * info.moe_intermediate_size,
                     mla=mla, kv_dtype=activations if dtype != activations else "")
