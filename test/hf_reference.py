"""Greedy decoding with Hugging Face transformers: the reference the project is checked against."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def hf_greedy(model_path: Path, prompts, max_new_tokens: int) -> list[list[int]]:
    """``generate(do_sample=False)`` in float32, never stopping at EOS (like ``ignore_eos``)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, generation_config=config)
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def hf_routed_experts(model_path: Path) -> dict[int, torch.nn.Module]:
    """``{layer: experts}``: each MoE layer's routed-experts module of the checkpoint as
    transformers loads it (its own ``from_pretrained`` and weight conversion), float32.

    The experts run transformers' eager per-expert loop (``experts_implementation="eager"``):
    ``experts(x, top_k_index, top_k_weights)`` is ``sum_k w[t, k] * expert_{ids[t, k]}(x[t])``
    with the routing given, not the gate's. Raises ``ValueError`` if transformers leaves any
    weight unloaded or any checkpoint tensor unused (a reference with random weights would
    prove nothing).
    """
    model, loading = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, experts_implementation="eager", output_loading_info=True
    )
    unloaded = {k: list(v) for k, v in loading.items() if v}
    if unloaded:
        raise ValueError(f"transformers did not load {model_path} cleanly: {unloaded}")
    return {
        i: layer.mlp.experts.eval()
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "experts")
    }


def hf_expert_sum(experts: torch.nn.Module, hidden: torch.Tensor, expert_ids: torch.Tensor,
                  router_weights: torch.Tensor) -> torch.Tensor:
    """transformers' routed-expert output for ``hidden [T, H]`` routed to ``expert_ids [T, K]``
    with ``router_weights [T, K]``."""
    with torch.no_grad():
        return experts(hidden, expert_ids.long(), router_weights.to(hidden.dtype))


def assert_matches_hf(out: torch.Tensor, hf_experts, layer, x, ids, weights) -> None:
    """The servers' sum equals transformers' to within 1e-6 of the result's scale, not bit for
    bit: both run the same float32 ops (F.linear, SiLU * up, F.linear, times the router
    weight; two entries per token add the same either way), but F.linear's value for a row
    depends on how many rows share the call (1-3 rows against 4 or more differ in the last
    bits on this machine's BLAS), and the servers group an expert's rows differently
    (chunks of --max-tokens, a replicated expert split between servers)."""
    reference = hf_expert_sum(hf_experts[layer], x, ids, weights)
    torch.testing.assert_close(out, reference, rtol=1e-6,
                               atol=1e-6 * float(reference.abs().max()))


def hf_greedy_routes(model_path: Path, prompts: list[list[int]], max_new_tokens: int
                     ) -> list[tuple[list[int], dict[int, set[int]]]]:
    """For each token-id prompt: transformers' greedy output, and per MoE layer the experts its
    tokens are routed to on the way (the prompt and every output token but the last, which no
    forward pass reads: ``topk`` of the router logits, as SGLang's TopK picks them)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    top_k = model.config.num_experts_per_tok
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, generation_config=config)[0, len(prompt):].tolist()
            seen = torch.tensor([prompt + out[:-1]])
            logits = model(seen, output_router_logits=True).router_logits
        layers = {layer: set(torch.topk(lg, top_k, dim=-1).indices.flatten().tolist())
                  for layer, lg in enumerate(logits)}
        results.append((out, layers))
    return results
