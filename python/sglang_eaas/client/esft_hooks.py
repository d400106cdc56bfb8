"""Hook bodies that serve ESFT adapters through SGLang's own LoRA machinery (``plugin.HOOKS``).

* ``lora_args`` (before ``ServerArgs.from_cli_args``): ``--eaas-esft-adapters`` becomes
  SGLang's ``--enable-lora --lora-paths NAME=PATH ...``, so SGLang's tokenizer manager,
  registry, OpenAI model names, ``/v1/models``, load/unload endpoints and the radix cache's
  per-adapter keys all apply to ESFT adapters unchanged;
* ``init_lora_manager`` (around ``ModelRunner.init_lora_manager``): the rank's LoRA manager is
  an ``EsftManager`` (``esft/manager.py``), not SGLang's ``LoRAManager``, given this rank's
  ``EaasClient`` to place adapters' experts and reroute their tokens through;
* ``resolve_adapter`` (around the OpenAI server's ``_resolve_lora_path``): SGLang takes an
  adapter from ``model`` only as ``BASE:ADAPTER`` and serves any other bare name as the base
  model; with ESFT adapters a bare ``model`` may also name a loaded adapter, and one that names
  neither the served model nor an adapter is refused (404), never answered by the base model.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from sglang_eaas import config as eaas_config
from sglang_eaas.refusal import Refusal


def lora_args(cls: type, args: argparse.Namespace) -> None:
    """BEFORE ``ServerArgs.from_cli_args``: ESFT adapters as SGLang LoRA adapters."""
    if not getattr(args, "eaas", False) or not (getattr(args, "eaas_esft", None)
                                                or getattr(args, "eaas_esft_adapters", None)):
        return
    if getattr(args, "lora_paths", None) or getattr(args, "enable_lora", None) is False:
        raise Refusal("--eaas-esft serves ESFT adapters in SGLang's LoRA slots: "
                                  "drop --lora-paths/--enable-lora (LoRA and ESFT adapters do "
                                  "not mix)")
    adapters = args.eaas_esft_adapters or ()
    args.enable_lora = True
    args.lora_paths = [f"{name}={path}" for name, path in adapters] or None
    if not adapters:  # SGLang asks for these to size LoRA buffers; ESFT has none
        args.max_lora_rank = args.max_lora_rank or 1
        args.lora_target_modules = args.lora_target_modules or ["all"]


BASE_ALIASES = ("default",)  # bare model names taken as the served model (SGLang's examples)


def resolve_adapter(resolve: Callable, serving: Any, request_model: str,
                    explicit_lora_path: Any) -> Any:
    """AROUND ``OpenAIServingBase._resolve_lora_path``: a bare ``model`` naming an ESFT
    adapter selects it; one naming nothing served is a 404."""
    manager = serving.tokenizer_manager
    cfg = getattr(manager.server_args, "_eaas", None)
    if cfg is None or not cfg.esft or not request_model or ":" in request_model:
        return resolve(serving, request_model, explicit_lora_path)
    if request_model in (manager.served_model_name, *BASE_ALIASES):
        return resolve(serving, request_model, explicit_lora_path)
    adapters = manager.lora_registry.get_all_adapters()
    if request_model in adapters:
        return request_model
    from fastapi import HTTPException

    raise HTTPException(status_code=404, detail=(
        f"The model {request_model!r} does not exist: this server serves "
        f"{manager.served_model_name!r} and the ESFT adapters {sorted(adapters)} (name one, or "
        f"'{manager.served_model_name}:ADAPTER')"))


def init_lora_manager(init: Callable, model_runner: Any) -> None:
    """AROUND ``ModelRunner.init_lora_manager``: with ESFT, an ``EsftManager``."""
    cfg = eaas_config.current()
    if cfg is None or not cfg.esft:
        return init(model_runner)
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.runtime_context import get_lora

    from sglang_eaas.client.sglang_moe import current_client
    from sglang_eaas.controller.controller import TierController, requester_name
    from sglang_eaas.esft.manager import EsftManager
    from sglang_eaas.esft.registrar import Registrar

    client = current_client()
    if client is None or client.esft is None:
        raise RuntimeError("--eaas-esft: this model has no MoE layer served by the expert "
                           "servers, so there is nothing for ESFT adapters to replace")
    info = client.info
    monitor = client.tier.settings.monitor
    registrar = Registrar(client, client.tier.token(), cfg.adapter_slots(info.num_experts),
                          cfg.esft_replicas, orchestrate=get_tp_group().rank_in_group == 0,
                          operation=_operations(TierController(
                              monitor, client.tier.token(),
                              requester_name("ESFT adapters of SGLang"))) if monitor else None)
    model_runner.lora_manager = EsftManager(client.esft, registrar,
                                            cfg.adapter_budget(info.num_experts),
                                            get_lora().lora_paths)


def _operations(controller, wait: float = 60.0):
    """The registrar's ``operation``: ``body(fence, held)`` as an operation of ``controller``
    (waiting up to ``wait`` seconds for one holding the tier); ``AdapterError`` unless done."""
    from ibgda import TransportError
    from sglang_eaas.controller.controller import Busy, Ended
    from sglang_eaas.esft.adapter import AdapterError
    from sglang_eaas.protocol.operations import DONE

    def run(kind: str, target: dict, body) -> None:
        try:
            record = controller.run(kind, target, lambda held: Ended(body(held.fence, held)),
                                    wait=wait)
        except (Busy, TransportError) as exc:
            raise AdapterError(f"ESFT adapter {target['adapter']}: {exc}") from None
        if record.state != DONE:
            raise AdapterError(record.result)

    return run
