"""The SGLang plugin: every hook sglang-eaas puts into SGLang is registered here, in one table.

Entry point ``sglang.srt.plugins: eaas = sglang_eaas.plugin:register``. SGLang calls
``register()`` in every process (launcher, scheduler, detokenizer) and then applies the hooks; it
only *logs* a failing plugin or hook, so the plugin turns that into an error wherever ``--eaas``
is in force: ``--eaas`` is refused at parse time where a hook did not apply, and the
``EaasConfig`` that SGLang pickles into its workers is unpickled there only through
``_restore_config``, which checks the plugin is active in that process
(``ensure_active_in_process``). This module sits on top of everything it hooks; nothing imports
it. An SGLang upgrade should only need to touch this file.
"""

from __future__ import annotations

import copyreg
from dataclasses import fields
from typing import Any, Callable, NamedTuple

from sglang_eaas import config, request_checks
from sglang_eaas.client import (
    autoscale_hooks, esft_hooks, graph_check, overlap, sglang_moe, steps,
)
from sglang_eaas.cpu_runtime import attention, forkserver, moe_native_ep, pd, server_defaults
from sglang_eaas.launcher import admin, prepare
from sglang_eaas.refusal import Refusal


class Hook(NamedTuple):
    target: str  # dotted path in SGLang 0.5.23
    kind: str  # HookType name: BEFORE | AFTER | AROUND | REPLACE
    fn: Callable[..., Any]
    why: str


def _add_cli_args(add_cli_args: Callable, parser: Any) -> None:
    add_cli_args(parser)
    config.add_cli_args(parser, refusal=_refusal)


def _refusal() -> str | None:
    """Why ``--eaas`` cannot be served from this process: hooks that did not apply."""
    missing = unapplied_hooks()
    return inactive_message(missing) if missing else None


def _from_cli_args(server_args: Any, cls: type, args: Any) -> Any:
    try:
        eaas = config.from_cli_args(args)
    except ValueError as exc:
        raise Refusal(str(exc)) from None
    if eaas is not None:
        server_args._eaas = eaas  # bookkeeping attribute: pickled along to every worker
        overlap.resolve(server_args)
    return server_args


HOOKS: tuple[Hook, ...] = (
    Hook(
        "sglang.srt.server_args.ServerArgs.add_cli_args",
        "AROUND",
        _add_cli_args,
        "add the --eaas option group",
    ),
    Hook(
        "sglang.srt.server_args.ServerArgs.from_cli_args",
        "AFTER",
        _from_cli_args,
        "carry the parsed --eaas options on ServerArgs._eaas",
    ),
    Hook(
        "sglang.srt.server_args.ServerArgs.from_cli_args",
        "BEFORE",
        esft_hooks.lora_args,
        "--eaas-esft-adapters: ESFT adapters become SGLang's LoRA adapters (--enable-lora, "
        "--lora-paths), so requests, /v1/models, load/unload and the radix cache treat them so",
    ),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager",
        "AROUND",
        esft_hooks.init_lora_manager,
        "--eaas-esft: the rank's LoRA manager places ESFT adapters' experts on the expert "
        "servers and reroutes their tokens (EsftManager), instead of staging LoRA weights",
    ),
    Hook(
        "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase._resolve_lora_path",
        "AROUND",
        esft_hooks.resolve_adapter,
        "--eaas-esft: an OpenAI model naming an ESFT adapter selects it; a model naming neither "
        "the served model nor an adapter is a 404, not base-model output",
    ),
    Hook(
        "sglang.srt.entrypoints.engine.Engine._launch_subprocesses",
        "AROUND",
        prepare.launch_subprocesses,
        "start local expert servers / check remote ones and the placement before workers start",
    ),
    Hook(
        "sglang.srt.entrypoints.http_server._setup_and_run_http_server",
        "BEFORE",
        admin.install_routes,
        "the expert tier's admin API (/eaas/tier, /eaas/scale, /eaas/operations) on SGLang's "
        "HTTP server",
    ),
    Hook(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
        ".stream_output",
        "AFTER",
        autoscale_hooks.after_stream_output,
        "--eaas-autoscale: rank 0's scheduler times each request (TTFT, TPOT) as it streams "
        "its outputs and judges SLO attainment per window",
    ),
    Hook(
        "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod.create_weights",
        "AROUND",
        sglang_moe.create_weights,
        "--eaas: MoE layers allocate no routed-expert weights; join the expert servers",
    ),
    Hook(
        "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod"
        ".process_weights_after_loading",
        "AROUND",
        sglang_moe.process_weights_after_loading,
        "--eaas: no routed-expert weights to post-process",
    ),
    Hook(
        "sglang.srt.layers.moe.fused_moe_triton.layer.create_moe_dispatcher",
        "AROUND",
        sglang_moe.create_moe_dispatcher,
        "--eaas: MoE layers dispatch to the expert servers and combine their answers "
        "(EaasDispatcher: dispatch_a/b, combine_a/b, as two-batch overlap calls them)",
    ),
    Hook(
        "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.run_moe_core",
        "AROUND",
        sglang_moe.run_moe_core,
        "--eaas: the experts ran on the expert servers; pass the dispatch handle to combine",
    ),
    *(Hook(
        f"sglang.srt.models.qwen3_moe.Qwen3MoeSparseMoeBlock.{name}",
        "AROUND",
        getattr(overlap, name),
        "--eaas with two-batch overlap: the MoE block's split dispatch/combine go to "
        "EaasDispatcher whatever SGLang's EP size",
    ) for name in ("op_dispatch_a", "op_dispatch_b", "op_combine_a", "op_combine_b")),
    Hook(
        "sglang.srt.batch_overlap.operations_strategy._compute_moe_qwen3_prefill",
        "AROUND",
        overlap.qwen3_prefill_strategy,
        "two-batch overlap on a machine without CUDA: Qwen3-MoE's prefill operations with no "
        "DeepGEMM SM budget",
    ),
    Hook(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute",
        "AROUND",
        graph_check.check_after_replay,
        "--eaas device transport: check the device exchange after each decode graph replay; "
        "redo a failed batch once without the graph",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        "AROUND",
        steps.run_batch,
        "--eaas: a rank adopts a new routing table only between steps; requests that needed an "
        "expert with no live holder end with HTTP 503 naming the layer and experts, their KV "
        "kept out of the radix cache; the rest of the batch goes on",
    ),
    Hook(
        "sglang.srt.model_loader.loader.DefaultModelLoader._get_all_weights",
        "AROUND",
        sglang_moe.skip_routed_expert_weights,
        "--eaas: the attention client never reads routed-expert tensors from the checkpoint",
    ),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        "AROUND",
        prepare.unlaunched,
        "--eaas where no launcher ran (python -m sglang.benchmark.one_batch builds its "
        "ModelRunner itself): start or check the expert tier in this process first",
    ),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        "AFTER",
        sglang_moe.check_loaded_model,
        "--eaas: refuse MoE layers that stayed local; log the parameter bytes each rank holds",
    ),
    Hook(
        "sglang.srt.arg_groups.platform_hook.handle_cpu_backends",
        "AROUND",
        server_defaults.apply,
        "CPU runtime defaults: torch_native attention, sleep-on-idle, per-rank core binding, "
        "a PD decode instance's retraction backup in host tensors (not a CUDA-registered pool)",
    ),
    Hook(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.__init__",
        "AFTER",
        pd.plain_kv_indices,
        "CPU runtime, PD prefill: KV page indices computed in place, not staged through pinned "
        "memory and a CUDA event",
    ),
    Hook(
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"
        ".maybe_send_cached_prefix_chunk",
        "AROUND",
        pd.no_early_prefix_send,
        "CPU runtime, PD prefill under overlap scheduling: a cached prefix goes with the "
        "request's regular KV send (its early send records a CUDA event)",
    ),
    Hook(
        "sglang.srt.entrypoints.engine._set_envs_and_config",
        "AROUND",
        forkserver.set_start_method,
        "CPU runtime: SGLang's ranks and detokenizer forked from a forkserver that imported "
        "SGLang once (they share those pages), not each spawned to import it anew",
    ),
    Hook(
        "sglang.srt.arg_groups.memory_hook.handle_gpu_memory_settings",
        "AROUND",
        server_defaults.size_kv_pools,
        "CPU runtime: the ranks of one server share the host's memory (mem_fraction_static "
        "split between the ranks on a NUMA node) instead of each sizing its KV pool to all of "
        "it, and a pool holds the context length times the running requests (max_total_tokens)",
    ),
    Hook(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.__init__",
        "AFTER",
        attention.add_seq_len_fill_value,
        "CPU runtime: two-batch overlap pads batches and asks the CPU attention backend for "
        "the padded sequence length, which the torch-native backend lacks",
    ),
    Hook(
        "sglang.srt.layers.moe.fused_moe_native.moe_forward_native",
        "AROUND",
        moe_native_ep.moe_forward_native_ep,
        "CPU MoE path correct with --ep > 1 (non-local experts arrive as id -1)",
    ),
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        "BEFORE",
        request_checks.check_prompt_token_ids,
        "refuse prompt token ids outside the vocabulary (HTTP 400): the scheduler dies on them",
    ),
)


def register() -> None:
    """Entry point: register every hook with SGLang's HookRegistry, and pickle every
    ``EaasConfig`` through ``_restore_config`` (copyreg: SGLang's spawn pickler reads it)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in HOOKS:
        HookRegistry.register(hook.target, hook.fn, HookType[hook.kind])
    copyreg.pickle(config.EaasConfig, _reduce_config)


def _reduce_config(cfg: config.EaasConfig) -> tuple:
    return _restore_config, tuple(getattr(cfg, f.name) for f in fields(cfg))


def _restore_config(*values: Any) -> config.EaasConfig:
    """Unpickling in a worker: an ``EaasConfig`` only where the plugin is active, so a worker
    in which it failed exits with a clear error instead of silently serving without it."""
    ensure_active_in_process()
    return config.EaasConfig(*values)


def unapplied_hooks() -> list[str]:
    """Targets of ``HOOKS`` that SGLang has not patched in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return [hook.target for hook in HOOKS if hook.target not in HookRegistry._patched]


def inactive_message(missing: list[str]) -> str:
    return (
        "--eaas was given but the sglang-eaas plugin is not active in this process "
        f"(hooks not applied: {', '.join(missing)}). Check that sglang-eaas is installed in this "
        "environment, that SGLANG_PLUGINS (if set) includes 'eaas', and the plugin errors "
        "logged above; for this sglang version see docs/plugin.md."
    )


def ensure_active_in_process() -> None:
    """Load SGLang's plugins here (idempotent) and raise if sglang-eaas's hooks are not applied."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    missing = unapplied_hooks()
    if missing:
        raise RuntimeError(inactive_message(missing))
