"""bench_esft's in-process timing of ESFT rerouting on the attention side, per decode step.

Three things are timed, each as the median over ``blocks`` blocks of ``calls`` calls (after a
warm-up block), at the run's decode batch (``tokens`` requests, one token each), the model's
top-k and experts, and ``adapters`` loaded adapters each replacing a few experts per layer:

* **op**: ``sgl_kernel_ext.esft_reroute.reroute(ids, aid, pi, check_aid=False)``, what every
  MoE layer's dispatcher runs (on this machine the C++ op, or the torch fallback when the
  kernel library is unavailable: the report says which);
* **call**: ``AdapterRouting.reroute(layer, topk_ids)``, the whole call the client makes per
  MoE layer (the step's adapter rows sliced, then the op);
* **prepare**: ``EsftManager.prepare_lora_batch`` once per step (the batch's adapter rows as a
  tensor, ``AdapterRouting.set_batch``), on a decode batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from sglang_eaas.tools.train_predictors import median_seconds


@dataclass(frozen=True)
class RerouteTiming:
    op_us: float
    call_us: float
    prepare_us: float
    implementation: str


def _per_call(fn: Callable[[], object], calls: int, blocks: int) -> float:
    """Median over ``blocks`` of the mean time per call of ``calls`` calls (after as many
    warm-up calls), in µs."""
    return median_seconds(fn, calls, blocks, warmup=calls) * 1e6


def _implementation(ids, aid, pi) -> str:
    from sgl_kernel_ext import cpu_ops

    try:
        cpu_ops.esft_reroute(ids, aid, pi, False)
        return "the C++ op (`cpu_ops.esft_reroute`)"
    except cpu_ops.KernelUnavailable:
        return "the torch fallback (`reroute_torch`: the kernel library is unavailable)"


def time_reroute(moe_layers: list[int], num_experts: int, top_k: int, tokens: int,
                 adapters: int, per_layer: int = 3, calls: int = 2000,
                 blocks: int = 15, seed: int = 0) -> RerouteTiming:
    from sgl_kernel_ext.esft_reroute import reroute

    from sglang_eaas.esft.manager import EsftManager
    from sglang_eaas.esft.routing import AdapterRouting

    g = torch.Generator().manual_seed(seed)
    routing = AdapterRouting(moe_layers, num_experts)
    for row in range(adapters):  # each adapter: per_layer experts per layer, ids past E
        routing.set_adapter(row, {layer: {
            int(e): num_experts + row * per_layer + j for j, e in enumerate(
                torch.randperm(num_experts, generator=g)[:per_layer])} for layer in moe_layers})
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                       for _ in range(tokens)]).to(torch.int32)
    rows = [i % adapters for i in range(tokens)]  # every request names an adapter
    manager = EsftManager(routing, registrar=None, max_experts=num_experts)
    manager.rows = {f"adapter-{r}": r for r in range(adapters)}
    batch = SimpleNamespace(lora_ids=[f"adapter-{r}" for r in rows], extend_seq_lens_cpu=None,
                            forward_mode=SimpleNamespace(is_extend=lambda: False))
    manager.prepare_lora_batch(batch)
    layer = moe_layers[0]
    pi, aid = routing.maps[layer], routing.aid
    assert aid is not None and torch.equal(routing.reroute(layer, ids), reroute(ids, aid, pi))
    return RerouteTiming(
        op_us=_per_call(lambda: reroute(ids, aid, pi, check_aid=False), calls, blocks),
        call_us=_per_call(lambda: routing.reroute(layer, ids), calls, blocks),
        prepare_us=_per_call(lambda: manager.prepare_lora_batch(batch), calls, blocks),
        implementation=_implementation(ids, aid, pi))
