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
