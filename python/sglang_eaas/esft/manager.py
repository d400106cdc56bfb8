"""``EsftManager``: SGLang's LoRA manager slot, filled with ESFT adapters on the expert servers.

With ``--eaas-esft-adapters`` the plugin turns on SGLang's own LoRA machinery (``--enable-lora``
with the adapters as ``--lora-paths``), so requests pick an adapter as SGLang users already do
(the OpenAI ``model`` name ``base:adapter`` or the adapter's name, or ``lora_path``), unknown
names are refused by SGLang's tokenizer manager, ``/v1/models`` lists the adapters,
``/load_lora_adapter`` and ``/unload_lora_adapter`` change them at runtime (an unload runs only
once no request uses the adapter: SGLang's registry waits for that), and the radix cache keys
every entry by its request's adapter. In each rank's ``ModelRunner`` this class takes the place
of SGLang's ``LoRAManager`` (``plugin.HOOKS``): it has no low-rank weights to stage, only

* ``load_lora_adapter`` / ``unload_lora_adapter``: validate the adapter (``esft/adapter.py``),
  place or find its experts on the expert servers (``esft/registrar.py``), then give it a row of
  the rerouting maps (``esft/routing.py``); unloading frees the row and drops its experts;
* ``prepare_lora_batch``: each token's adapter row for the step, from SGLang's batch.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang_eaas.esft.adapter import AdapterError, load_adapter
from sglang_eaas.esft.registrar import Registered, Registrar
from sglang_eaas.esft.routing import AdapterRouting

logger = logging.getLogger(__name__)


class EsftManager:
    """The methods of SGLang's ``LoRAManager`` that SGLang 0.5.23 calls, for ESFT adapters."""

    attn_dp_enabled = False
    memory_pool = None  # no LoRA weight pool (SGLang's metrics read it when present)
    supports_prefill_cuda_graph = False
    prefill_cuda_graph_max_bs = None

    def __init__(self, routing: AdapterRouting, registrar: Registrar, max_experts: int,
                 lora_paths: list[Any] | None = None):
        """``max_experts``: the most experts one adapter may replace in one MoE layer;
        ``lora_paths``: SGLang's ``LoRARef``s given at launch, loaded now (a failure is
        fatal: the server would otherwise serve without them)."""
        self.routing, self.registrar, self.max_experts = routing, registrar, max_experts
        self.refs: dict[str, Any] = {}  # lora_id -> LoRARef
        self.rows: dict[str, int] = {}  # lora_id -> its row of the rerouting maps
        self.registered: dict[str, Registered] = {}  # lora_id -> its experts on the tier
        for ref in lora_paths or []:
            result = self.load_lora_adapter(ref)
            if not result.success:
                raise RuntimeError(result.error_message)

    # -- adapters ---------------------------------------------------------------------------
    def _result(self, success: bool, error_message: str = ""):
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        return LoRAUpdateOutput(success=success, error_message=error_message,
                                loaded_adapters={r.lora_name: r.lora_path
                                                 for r in self.refs.values()})

    def load_lora_adapter(self, lora_ref: Any):
        """Place ``lora_ref``'s experts and publish it; a failure changes nothing."""
        if lora_ref.lora_id in self.refs:
            return self._result(False, f"ESFT adapter {lora_ref.lora_name} is loaded already")
        try:
            adapter = load_adapter(lora_ref.lora_path, self.registrar.info, self.max_experts)
            registered = self.registrar.register(lora_ref.lora_name, adapter)
        except AdapterError as exc:
            logger.error("sglang-eaas: %s", exc)
            return self._result(False, str(exc))
        used = set(self.rows.values())
        row = next(r for r in range(len(used) + 1) if r not in used)
        self.routing.set_adapter(row, registered.mapping)
        self.refs[lora_ref.lora_id], self.rows[lora_ref.lora_id] = lora_ref, row
        self.registered[lora_ref.lora_id] = registered
        logger.info("sglang-eaas: ESFT adapter %s (%s) serves: %d experts replaced (per MoE "
                    "layer %s)", lora_ref.lora_name, lora_ref.lora_path, adapter.count,
                    {layer: len(ids) for layer, ids in adapter.experts.items()})
        return self._result(True)

    def load_lora_adapter_from_tensors(self, lora_ref: Any, *args, **kwargs):
        return self._result(False, "ESFT adapters are loaded from a directory (expert_config."
                            "json and adapter.safetensors), not from tensors")

    def unload_lora_adapter(self, lora_ref: Any):
        """Free the adapter's row and drop its experts (SGLang calls this once no request
        uses it)."""
        if lora_ref.lora_id not in self.refs:
            return self._result(False, f"ESFT adapter {lora_ref.lora_name} is not loaded")
        row = self.rows.pop(lora_ref.lora_id)
        self.routing.clear_adapter(row)
        del self.refs[lora_ref.lora_id]
        self.registrar.unregister(self.registered.pop(lora_ref.lora_id))
        return self._result(True)

    # -- batches ----------------------------------------------------------------------------
    def validate_lora_batch(self, lora_ids: set[Optional[str]]) -> bool:
        """Any mix of loaded adapters fits one batch: the maps hold a row for each."""
        return True

    def fetch_new_loras(self, new_loras: set, running_loras: set = frozenset()) -> None:
        """Nothing to stage: every loaded adapter's experts are on the servers already."""

    def prepare_lora_batch(self, forward_batch: Any) -> None:
        """Each token's adapter row for this step (-1: the base model)."""
        ids = forward_batch.lora_ids or []
        per_request = torch.tensor([self.rows.get(i, -1) if i is not None else -1 for i in ids],
                                   dtype=torch.int32)
        if not ids or not bool((per_request >= 0).any()):
            self.routing.set_batch(None)
            return
        lens = forward_batch.extend_seq_lens_cpu
        if forward_batch.forward_mode.is_extend() and lens is not None:
            aid = per_request.repeat_interleave(torch.tensor(lens, dtype=torch.long))
        else:  # decode: one token per request
            aid = per_request
        self.routing.set_batch(aid)

    def reset_lora_batch(self) -> None:
        self.routing.set_batch(None)

    def reset_routing_cache(self) -> None:
        pass

    def can_use_prefill_cuda_graph(self, forward_batch: Any) -> bool:
        return False

    def init_cuda_graph_moe_buffers(self, *args, **kwargs) -> None:
        pass

    def init_decode_cuda_graph_batch_info(self, *args, **kwargs) -> None:
        pass

    def init_prefill_cuda_graph_batch_info(self, *args, **kwargs) -> None:
        pass
