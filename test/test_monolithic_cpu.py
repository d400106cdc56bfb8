"""Stock SGLang with the plugin installed serves generated MoE checkpoints on the CPU."""

from __future__ import annotations

import pytest
from conftest import MAX_NEW_TOKENS, PROMPTS, greedy_tokens, start_server
from hf_reference import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang on the CPU runtime (no GPU)


def test_generate_answers(monolithic_qwen3):
    out = monolithic_qwen3.generate(PROMPTS[0], MAX_NEW_TOKENS)
    assert len(out["output_ids"]) == MAX_NEW_TOKENS
    assert out["meta_info"]["completion_tokens"] == MAX_NEW_TOKENS
    assert isinstance(out["text"], str) and out["text"]


def test_chat_completions_answers(monolithic_qwen3):
    reply = monolithic_qwen3.chat("Tell me a story about a robot.", max_tokens=8)
    assert reply["object"] == "chat.completion"
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["usage"]["prompt_tokens"] > 8  # the chat template wrapped the message


def test_cpu_defaults_applied(monolithic_qwen3):
    """Started with only --device cpu: the CPU runtime chose the attention backend and idling."""
    import requests

    info = requests.get(f"{monolithic_qwen3.url}/server_info", timeout=30).json()
    assert info["attention_backend"] == "torch_native"
    assert info["sleep_on_idle"] is True


def test_qwen3_greedy_matches_hf(monolithic_qwen3, tiny_qwen3):
    assert greedy_tokens(monolithic_qwen3) == hf_greedy(tiny_qwen3, PROMPTS, MAX_NEW_TOKENS)


def test_mixtral_greedy_matches_hf(tiny_mixtral):
    server = start_server(tiny_mixtral, name="monolithic-mixtral")
    try:
        tokens = greedy_tokens(server)
    finally:
        server.stop()
    assert tokens == hf_greedy(tiny_mixtral, PROMPTS, MAX_NEW_TOKENS)
