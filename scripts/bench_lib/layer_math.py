"""bench_layer's in-process part: an MoE layer's expert math as the expert server computes it
(``weighted_expert_sum``) against SGLang's own CPU MoE (``moe_forward_native``) on the same
weights and the same (token, expert) entries."""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
from sglang_eaas.cpu_runtime.moe_native_ep import moe_forward_native_ep
from sglang_eaas.expert_server.compute import local_experts, weighted_expert_sum
from sglang_eaas.expert_server.experts import LayerExperts
from sglang_eaas.model_info import MoeModelInfo


@dataclass(frozen=True)
class Batch:
    """One layer's input: ``hidden [T, H]`` in the model dtype, ``expert_ids [T, K]`` int32
    global ids (distinct per token), ``router_weights [T, K]`` float32 summing to 1 per token."""

    layer_id: int
    hidden: torch.Tensor
    expert_ids: torch.Tensor
    router_weights: torch.Tensor


@dataclass(frozen=True)
class MathTiming:
    """Median microseconds per layer call of both implementations on one configuration, and
    how many calls each median is over."""

    experts: int
    threads: int
    tokens: int
    eaas_us: float
    eaas_calls: int
    sglang_us: float
    sglang_calls: int


def make_batches(info: MoeModelInfo, tokens: int, dtype: torch.dtype, count: int,
                 seed: int) -> list[Batch]:
    """``count`` random batches, cycling through the MoE layers; top-k routing of random
    logits with the top-k weights renormalized (as the bench checkpoint's router does)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for i in range(count):
        probs = torch.randn(tokens, info.num_experts, generator=gen).softmax(dim=-1)
        weights, ids = torch.topk(probs, info.top_k, dim=-1)
        hidden = torch.randn(tokens, info.hidden_size, generator=gen).to(dtype)
        batches.append(Batch(info.moe_layers[i % len(info.moe_layers)], hidden, ids.int(),
                             (weights / weights.sum(dim=-1, keepdim=True)).float()))
    return batches


def only_held(batch: Batch, layer: LayerExperts) -> torch.Tensor:
    """The batch's expert ids with -1 for experts ``layer`` does not hold, as a client sends
    them to one server."""
    held = layer.local_index[batch.expert_ids.long()] >= 0
    return torch.where(held, batch.expert_ids, -1)


@dataclass(frozen=True)
class Budget:
    """How long one point is measured: ``warmup`` untimed calls, then ``iterations`` timed
    calls or as many as fit in ``seconds`` (at least ``MIN_CALLS``), whichever is fewer."""

    warmup: int
    iterations: int
    seconds: float

    MIN_CALLS = 3

    def calls(self, call: Callable[[Batch], object], batches: list[Batch]) -> list[float]:
        """Wall times in seconds of the timed calls of ``call``, cycling through ``batches``."""
        for i in range(self.warmup):
            call(batches[i % len(batches)])
        times: list[float] = []
        deadline = time.perf_counter() + self.seconds
        while len(times) < self.iterations and (len(times) < self.MIN_CALLS
                                                or time.perf_counter() < deadline):
            batch = batches[(self.warmup + len(times)) % len(batches)]
            start = time.perf_counter()
            call(batch)
            times.append(time.perf_counter() - start)
        return times


class LayerMath:
    """Both implementations over the experts of ``layers`` (all MoE layers, the same experts)."""

    def __init__(self, layers: dict[int, LayerExperts]):
        from sglang.srt.layers.moe import fused_moe_native
        from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        self.layers = layers
        self.num_experts = next(iter(layers.values())).w13.shape[0]
        self._native = inspect.unwrap(fused_moe_native.moe_forward_native)  # stock
        self._config = MoeRunnerConfig(activation="silu")
        self._topk = StandardTopKOutput
        self._modules = {}
        for layer_id, layer in layers.items():
            module = torch.nn.Module()  # the attributes of FusedMoE moe_forward_native reads
            module.w13_weight, module.w2_weight = layer.w13, layer.w2
            module.num_experts = self.num_experts
            self._modules[layer_id] = module

    def eaas(self, batch: Batch) -> torch.Tensor:
        """``weighted_expert_sum`` alone: the local rows are looked up before, as the server's
        request check does."""
        layer = self.layers[batch.layer_id]
        return weighted_expert_sum(layer, batch.hidden, self._rows(batch), batch.router_weights)

    def sglang(self, batch: Batch) -> torch.Tensor:
        """SGLang's ``moe_forward_native`` with local expert ids. Where some entries are not
        held here (-1), it runs once per top-k slot, as the CPU runtime runs an EP rank."""
        local = self._rows(batch).view(batch.expert_ids.shape)
        topk = self._topk(batch.router_weights, local, None)
        return moe_forward_native_ep(self._native, self._modules[batch.layer_id], batch.hidden,
                                     topk, self._config)

    def _rows(self, batch: Batch) -> torch.Tensor:
        layer = self.layers[batch.layer_id]
        return local_experts(layer, only_held(batch, layer))

    def check(self, batches: list[Batch]) -> None:
        """Both implementations agree (to bfloat16 rounding) on every batch, so the timings
        compare the same computation."""
        for batch in batches:
            mine, theirs = self.eaas(batch).float(), self.sglang(batch).float()
            if not torch.allclose(mine, theirs, rtol=2**-6, atol=theirs.abs().max() * 2**-7):
                raise RuntimeError(f"weighted_expert_sum and moe_forward_native differ on layer "
                                   f"{batch.layer_id} by {(mine - theirs).abs().max():.3g}")

    def time(self, batches: list[Batch], threads: int, budget: Budget) -> MathTiming:
        """Both implementations on ``batches`` with ``threads`` torch threads."""
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            mine, theirs = budget.calls(self.eaas, batches), budget.calls(self.sglang, batches)
        finally:
            torch.set_num_threads(previous)
        return MathTiming(self.num_experts, threads, batches[0].hidden.shape[0],
                          statistics.median(mine) * 1e6, len(mine),
                          statistics.median(theirs) * 1e6, len(theirs))
