"""Two-batch overlap (SGLang's ``--enable-two-batch-overlap``) with the expert servers.

SGLang splits a batch into two micro-batches and interleaves their operations: at each
``YieldOperation`` of the model's operations strategy (``batch_overlap/operations_strategy.py``)
the other micro-batch runs. Its Qwen3-MoE strategy yields right after ``op_dispatch_a`` and
before ``op_combine_b``, so with ``EaasDispatcher`` one micro-batch's tokens are at the expert
servers while the client runs the other's attention and routing (the paper's §4.2).

What the plugin changes for that, and why:

* the MoE block's ``op_dispatch_a/b`` and ``op_combine_a/b`` only call the dispatcher when
  SGLang's expert parallelism is on (``ep_size > 1``); under --eaas the experts are remote
  whatever the EP size, so the hooks below call it;
* ``--eaas`` turns two-batch overlap on (``--eaas-disable-overlap`` keeps it off; so do local
  expert servers that share the ranks' cores, unless ``--enable-two-batch-overlap`` asks for
  it) and sets ``moe_a2a_backend`` to SGLang's ``customized`` (SGLang refuses two-batch
  overlap with no all-to-all backend, which is what the expert servers are); for a model SGLang
  has no Qwen3-MoE-style strategy for, with ``--tp > 1``, or with an option SGLang does not
  overlap with, it serves without overlap, warning if ``--enable-two-batch-overlap`` asked for
  it (``resolve``);
* SGLang's Qwen3-MoE prefill strategy asks CUDA for the GPU's SM count (to size DeepGEMM next to
  DeepEP); on a machine without CUDA the same operations run with no SM budget.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable

from sglang_eaas import cores

logger = logging.getLogger(__name__)
# Model types whose SGLang operations strategy the hooks below route to the expert servers.
OVERLAPPED_MODEL_TYPES = ("qwen3_moe",)


def resolve(server_args: Any) -> None:
    """At launch, with --eaas: turn SGLang's two-batch overlap on where it can run with the
    expert servers (and name the all-to-all backend ``customized``), unless
    --eaas-disable-overlap, or unless local expert servers share the ranks' cores and
    --enable-two-batch-overlap did not ask for it; elsewhere serve without it, with a warning
    when --enable-two-batch-overlap asked for it. Called once the options are parsed."""
    cfg = server_args._eaas
    asked = server_args.enable_two_batch_overlap
    server_args.enable_two_batch_overlap = False
    if not cfg.overlap:
        return
    why = _unsupported(server_args)
    if why:
        (logger.warning if asked else logger.info)(
            "sglang-eaas: serving without two-batch overlap: %s", why)
        return
    ranks = server_args.tp_size * (server_args.pp_size or 1) * max(server_args.dp_size or 1, 1)
    local = cores.planned_local_servers(cfg)
    if not asked and cores.shares_cores(local, ranks):
        logger.info("sglang-eaas: serving without two-batch overlap: the %d local expert "
                    "servers and %d rank(s) share %d cores, where overlap would make the "
                    "servers read every active expert's weights once per micro-batch with no "
                    "idle core to hide it in (--enable-two-batch-overlap turns it on)",
                    local, ranks, cores.usable_cores())
        return
    server_args.enable_two_batch_overlap = True
    server_args.moe_a2a_backend = "customized"  # SGLang's name for an all-to-all of one's own


def _unsupported(server_args: Any) -> str:
    """Why two-batch overlap cannot run with the expert servers here ('' when it can)."""
    config = Path(server_args.model_path) / "config.json"
    try:
        model_type = json.loads(config.read_text()).get("model_type", "")
    except (OSError, ValueError):
        model_type = ""  # a hub id or an unreadable config: SGLang reports that itself
    if model_type not in OVERLAPPED_MODEL_TYPES:
        return (f"SGLang {_version()} has two-batch overlap operations for Qwen3-MoE here, "
                f"not for model type {model_type or '(unknown)'}")
    if server_args.tp_size > 1:
        return ("with --tp > 1 each rank sends a share of the tokens and SGLang's overlapped "
                "operations do not all-reduce the MoE output; use --tp 1 (or --dp) for overlap")
    excluded = [name for name, on in (
        ("LoRA", getattr(server_args, "enable_lora", None) or getattr(server_args, "lora_paths",
                                                                       None)),
        ("speculative decoding", getattr(server_args, "speculative_algorithm", None)),
        ("--pp > 1", (getattr(server_args, "pp_size", 1) or 1) > 1),
        ("attention DP", getattr(server_args, "enable_dp_attention", False)
         or (getattr(server_args, "attn_dp_size", 1) or 1) > 1),
        ("PD-multiplexing", getattr(server_args, "enable_pdmux", False)),
    ) if on]
    if excluded:
        return f"SGLang does not run two-batch overlap with {' or '.join(excluded)}"
    return ""


def _version() -> str:
    from importlib.metadata import version

    return version("sglang")


def _remote(block: Any) -> bool:
    return getattr(block.experts, "_eaas_client", None) is not None


def op_dispatch_a(op: Callable, block: Any, state: Any) -> None:
    """AROUND ``Qwen3MoeSparseMoeBlock.op_dispatch_a``: send this micro-batch's tokens."""
    if not _remote(block):
        return op(block, state)
    block.experts.dispatcher.dispatch_a(
        hidden_states=state.pop("hidden_states_mlp_input"), topk_output=state.pop("topk_output"),
        tbo_subbatch_index=state.get("tbo_subbatch_index"))


def op_dispatch_b(op: Callable, block: Any, state: Any) -> None:
    if not _remote(block):
        return op(block, state)
    state.dispatch_output = block.experts.dispatcher.dispatch_b(
        tbo_subbatch_index=state.get("tbo_subbatch_index"))


def op_combine_a(op: Callable, block: Any, state: Any) -> None:
    if not _remote(block):
        return op(block, state)
    block.experts.dispatcher.combine_a(combine_input=state.pop("combine_input"),
                                       tbo_subbatch_index=state.get("tbo_subbatch_index"))
    state.pop("dispatch_output")


def op_combine_b(op: Callable, block: Any, state: Any) -> None:
    """AROUND ``Qwen3MoeSparseMoeBlock.op_combine_b``: wait for the servers' answers."""
    if not _remote(block):
        return op(block, state)
    state.hidden_states_after_combine = block.experts.dispatcher.combine_b(
        tbo_subbatch_index=state.get("tbo_subbatch_index"))


def qwen3_prefill_strategy(strategy: Callable, layer: Any) -> Any:
    """AROUND ``operations_strategy._compute_moe_qwen3_prefill``: without CUDA, SGLang's
    operations and yields with no DeepGEMM SM budget (there is no GPU to share)."""
    import torch

    if torch.cuda.is_available():
        return strategy(layer)
    from sglang.srt.batch_overlap import operations
    from sglang.srt.batch_overlap.operations_strategy import OperationsStrategy

    return OperationsStrategy(
        deep_gemm_num_sms=None,
        tbo_delta_stages=0,
        operations=[
            layer.op_comm_prepare_attn,
            layer.self_attn.op_prepare,
            layer.self_attn.op_core,
            layer.op_comm_prepare_mlp,
            layer.mlp.op_gate,
            layer.mlp.op_select_experts,
            layer.mlp.op_dispatch_a,
            operations.YieldOperation(),
            layer.mlp.op_dispatch_b,
            layer.mlp.op_experts,
            layer.mlp.op_combine_a,
            operations.YieldOperation(),
            layer.mlp.op_combine_b,
            layer.mlp.op_output,
            layer.op_comm_postprocess_layer,
        ],
    )
