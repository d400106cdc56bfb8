"""Hook bodies that turn SGLang's FusedMoE layers into attention-client MoE layers.

With ``--eaas``, an unquantized FusedMoE creates no routed-expert weights, the weight loader never
reads routed-expert tensors, and the layer's forward sends the routed tokens to the expert
servers through this process's ``EaasClient`` instead of running them. Router (gate), TopK and
shared experts are untouched and stay local.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from typing import Any, Callable, Iterator

import torch

from sglang_eaas import config as eaas_config
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.balance.forecast import RoutingBook
from sglang_eaas.client.load_sinks import DumpFile, Publisher, rank_path
from sglang_eaas.client.metrics import PrometheusTierMetrics, TierMetrics
from sglang_eaas.model_info import MoeModelInfo, is_routed_expert_tensor
from sglang_eaas.protocol.slot import POLL_SPIN_US

logger = logging.getLogger(__name__)
_client: EaasClient | None = None


def _shared_client(dtype: torch.dtype) -> EaasClient:
    """This process's client, joined to every expert server on first use."""
    global _client
    if _client is None:
        from sglang.srt.runtime_context import get_server_args

        cfg, server_args = eaas_config.current(), get_server_args()
        assert isinstance(cfg.expert_servers, eaas_config.RemoteServers), cfg
        _limit_threads(cfg.rank_threads, server_args)
        name = f"{socket.gethostname()}:{os.getpid()}"
        info = MoeModelInfo.from_model_path(server_args.model_path)
        expected = cfg.placement.holdings(info.moe_layers) if cfg.placement else None
        metrics = _metrics(server_args)
        sinks = _load_sinks(cfg, metrics)
        routing = (RoutingBook(info.moe_layers, info.num_experts, info.top_k)
                   if cfg.balance is not None and _first_rank() else None)
        _client = EaasClient(list(cfg.expert_servers.addresses), info,
                             ModelIdentity.of(server_args.model_path, info), dtype, name,
                             expected_experts=expected, transport=cfg.transport,
                             poll_spin=(POLL_SPIN_US if cfg.poll_spin_us is None
                                        else cfg.poll_spin_us) * 1e-6, monitor=cfg.monitor,
                             heartbeat=cfg.heartbeat, result_timeout=cfg.result_timeout,
                             metrics=metrics,
                             micro_batches=2 if overlapped(server_args) else 1,
                             load_window=cfg.load_window, load_sinks=sinks,
                             adapter_slots=cfg.adapter_slots(info.num_experts),
                             routing=routing)
        atexit.register(_client.close)  # atexit runs it first: its last window, then the sinks
        logger.info("sglang-eaas: %s joined expert servers %s over %s%s (monitor %s, routing "
                    "table epoch %d)", name, ", ".join(c.address for c in _client.connections),
                    ", ".join(sorted({c.region.handle.backend for c in _client.connections})),
                    "; the exchange runs on the device" if _client.device_step else "",
                    cfg.monitor, _client.table.epoch)
        if routing is not None:
            from sglang_eaas.client.balance_hooks import TierBalancer

            TierBalancer(cfg.balance, cfg.monitor, info, lambda: routing)
            logger.info("sglang-eaas: --eaas-balance %s over the tier of monitor %s",
                        cfg.balance.mode, cfg.monitor)
    return _client


def _limit_threads(threads: int | None, server_args: Any) -> None:
    """On a CPU, this rank's torch intra-op threads become ``threads`` (the cores the local
    expert servers leave: ``cores.rank_threads``), unless the user chose them
    (``OMP_NUM_THREADS``)."""
    if threads is None or getattr(server_args, "device", None) != "cpu":
        return
    if os.environ.get("OMP_NUM_THREADS"):
        logger.info("sglang-eaas: OMP_NUM_THREADS=%s given: this rank keeps %d torch threads "
                    "(the local expert servers leave it %d cores)",
                    os.environ["OMP_NUM_THREADS"], torch.get_num_threads(), threads)
        return
    if torch.get_num_threads() > threads:
        logger.info("sglang-eaas: this rank runs %d torch thread(s), not %d: the local expert "
                    "servers take the other cores (OMP_NUM_THREADS overrides)", threads,
                    torch.get_num_threads())
        torch.set_num_threads(threads)


def overlapped(server_args: Any) -> bool:
    """Whether SGLang runs two micro-batches interleaved (two-batch overlap): then each may
    have a MoE layer in flight, on a slot of its own at every expert server."""
    return bool(getattr(server_args, "enable_two_batch_overlap", False))


def _metrics(server_args: Any) -> TierMetrics:
    """The tier's Prometheus metrics where SGLang serves /metrics (``--enable-metrics``)."""
    if not getattr(server_args, "enable_metrics", False):
        return TierMetrics()
    from sglang.srt.distributed import get_tp_group

    return PrometheusTierMetrics(get_tp_group().rank_in_group)


def _load_sinks(cfg: eaas_config.EaasConfig, metrics: TierMetrics) -> list[Publisher]:
    """Where the client's load windows go, off the scheduler's thread: ``/metrics`` (with
    ``--enable-metrics``) and this rank's ``--eaas-load-dump`` file."""
    sinks = []
    if isinstance(metrics, PrometheusTierMetrics):
        sinks.append(metrics.load_window)
    if cfg.load_dump is not None:
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
        path = rank_path(cfg.load_dump, group.rank_in_group, group.world_size)
        sinks.append(DumpFile(path))
        logger.info("sglang-eaas: load windows of %d steps go to %s", cfg.load_window, path)
    if cfg.layout is not None and _first_rank():
        from sglang.srt.runtime_context import get_server_args

        from sglang_eaas.client.layout_hooks import LayoutSwitcher

        info = MoeModelInfo.from_model_path(get_server_args().model_path)
        sinks.append(LayoutSwitcher(cfg.layout, cfg.monitor, info,
                                    lambda: None if _client is None else _client.table))
        logger.info("sglang-eaas: --eaas-layout %s over the tier of monitor %s",
                    cfg.layout.mode, cfg.monitor)
    if not sinks:
        return []
    publisher = Publisher(sinks)
    atexit.register(publisher.close)
    return [publisher]


def _first_rank() -> bool:
    """Whether this process is attention rank 0 (of the first data-parallel rank): the one that
    judges the tier's layout."""
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.runtime_context import get_parallel

    try:
        dp_rank = int(getattr(get_parallel(), "attn_dp_rank", 0) or 0)
    except (AttributeError, RuntimeError, ValueError, TypeError):
        dp_rank = 0
    return get_tp_group().rank_in_group == 0 and dp_rank == 0


def current_client() -> EaasClient | None:
    """This process's client, if it has joined (``--eaas`` and a model with MoE layers)."""
    return _client


def create_weights(create: Callable, method: Any, layer: torch.nn.Module, num_experts: int,
                   hidden_size: int, intermediate_size_per_partition: int,
                   params_dtype: torch.dtype, **kwargs) -> None:
    """AROUND ``UnquantizedFusedMoEMethod.create_weights``: no routed-expert weights."""
    if eaas_config.current() is None:
        return create(method, layer, num_experts, hidden_size, intermediate_size_per_partition,
                      params_dtype, **kwargs)
    method.with_bias = kwargs.get("with_bias", False)
    layer._eaas_client = method._eaas_client = _shared_client(params_dtype)


def process_weights_after_loading(process: Callable, method: Any, layer: torch.nn.Module):
    """AROUND ``UnquantizedFusedMoEMethod.process_weights_after_loading``: nothing to process."""
    if hasattr(layer, "_eaas_client"):
        return None
    return process(method, layer)


def create_moe_dispatcher(create: Callable, moe_runner_config: Any, quant_method: Any) -> Any:
    """AROUND SGLang's ``create_moe_dispatcher``: a layer whose experts are remote (its quant
    method joined the expert servers in ``create_weights``) gets ``EaasDispatcher``: dispatch
    sends to the expert servers, combine sums what they answer."""
    client = getattr(quant_method, "_eaas_client", None)
    if client is None:
        return create(moe_runner_config, quant_method)
    from sglang_eaas.client.dispatcher import EaasDispatcher  # imports SGLang's MoE layers

    return EaasDispatcher(client, moe_runner_config.layer_id)


def run_moe_core(run: Callable, layer: torch.nn.Module, dispatch_output: Any) -> Any:
    """AROUND ``FusedMoE.run_moe_core``: under --eaas the experts run on the servers, so
    nothing runs here; the dispatch handle goes on to ``combine``."""
    if getattr(layer, "_eaas_client", None) is None:
        return run(layer, dispatch_output)
    from sglang_eaas.client.dispatcher import EaasCombineInput

    return EaasCombineInput(dispatch_output.hidden_states, dispatch_output.handle,
                            dispatch_output.share)


def skip_routed_expert_weights(get_all_weights: Callable, loader: Any, model_config: Any,
                               model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """AROUND ``DefaultModelLoader._get_all_weights``: the client never reads routed experts."""
    weights = get_all_weights(loader, model_config, model)
    if eaas_config.current() is None:
        return weights
    return ((name, w) for name, w in weights if not is_routed_expert_tensor(name))


def check_loaded_model(_result: Any, model_runner: Any) -> None:
    """AFTER ``ModelRunner.load_model``: with ``--eaas`` every MoE layer must be remote (a
    quantized one is not), then log what this rank holds (the tests read this line)."""
    if eaas_config.current() is not None:
        from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

        local = [m for m in model_runner.model.modules()
                 if isinstance(m, FusedMoE) and not hasattr(m, "_eaas_client")]
        if local:
            raise RuntimeError(
                f"--eaas: MoE layer {local[0].layer_id} uses "
                f"{type(local[0].quant_method).__name__}; expert servers support unquantized "
                "checkpoints only")
    params = list(model_runner.model.named_parameters())
    routed = sum(p.numel() * p.element_size() for name, p in params
                 if ".experts.w13_weight" in name or ".experts.w2_weight" in name)
    total = sum(p.numel() * p.element_size() for _, p in params)
    logger.info("sglang-eaas: model parameters %d bytes, routed-expert parameters %d bytes",
                total, routed)
