"""One greedy request's routing on the trained checkpoint, token by token (transformers,
float32): the expert ids the router picks per MoE layer for each prompt token and for each
generated one (one forward pass over prompt + output, which is what a decode step with the KV
cache computes). ``bench_forecast_bound`` sums them per request; ``bench_balance_replay``
replays them step by step. Cached on disk per checkpoint, prompt and output length."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sglang_eaas.balance.traces import moe_layers


@dataclass(frozen=True)
class RequestRouting:
    """``prompt [L, P, K]`` and ``output [L, O, K]`` expert ids (int16): the prompt's tokens
    and the generated ones, per MoE layer."""

    prompt: np.ndarray
    output: np.ndarray

    def counts(self, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
        """``[L, E]`` entries of the prompt's tokens and of the generated ones."""
        return tuple(np.stack([np.bincount(layer.reshape(-1), minlength=num_experts)
                               for layer in ids]).astype(np.float64)
                     for ids in (self.prompt, self.output))


def record(model, tokenizer, text: str, output_len: int) -> RequestRouting:
    layers = moe_layers(model)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=False)
    picks: list[torch.Tensor] = []
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(
        lambda module, args, output: picks.append(output[2].reshape(-1, output[2].shape[-1])))
        for i in layers]
    try:
        with torch.no_grad():
            model.model(input_ids=full, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    chosen = torch.stack(picks).numpy().astype(np.int16)  # [L, P + O, K]
    prompt_len = ids.shape[1]
    return RequestRouting(chosen[:, :prompt_len], chosen[:, prompt_len:])


def recorded(model_path: Path, texts: list[str], output_len: int, cache: Path,
             say=lambda line: None) -> dict[str, RequestRouting]:
    """Each distinct text's routing, read from ``cache`` where recorded before (the key: the
    checkpoint's weights file, the text and the output length)."""
    weights = sorted(Path(model_path).glob("*.safetensors"))
    stamp = "|".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    cache.mkdir(parents=True, exist_ok=True)
    out: dict[str, RequestRouting] = {}
    model = tokenizer = None
    for text in dict.fromkeys(texts):
        key = hashlib.sha256(f"{stamp}|{output_len}|{text}".encode()).hexdigest()[:24]
        path = cache / f"{key}.npz"
        if path.exists():
            with np.load(path) as f:
                out[text] = RequestRouting(f["prompt"], f["output"])
            continue
        if model is None:
            from transformers import AutoTokenizer

            from sglang_eaas.balance.traces import load_model

            torch.manual_seed(0)
            model, tokenizer = load_model(model_path), AutoTokenizer.from_pretrained(model_path)
        out[text] = record(model, tokenizer, text, output_len)
        np.savez(path, prompt=out[text].prompt, output=out[text].output)
        if len(out) % 16 == 0:
            say(f"  {len(out)} of {len(dict.fromkeys(texts))} prompts' routing recorded")
    return out
