"""A prompt token id outside the vocabulary is an HTTP 400, and the server keeps serving."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
import requests
from conftest import MAX_NEW_TOKENS, PROMPTS, greedy_tokens, start_server
from hf_reference import hf_greedy

from sglang_eaas.request_checks import out_of_vocab_message


def test_message_names_first_bad_id_and_position():
    assert out_of_vocab_message([5, 511, 0], 512) is None
    assert out_of_vocab_message([], 512) is None
    assert out_of_vocab_message([5, 512, -1], 512) == (
        "Prompt token 1 has id 512, outside the model's vocabulary of 512 ids "
        "(valid ids are 0 to 511).")
    assert out_of_vocab_message([3, -1], 512).startswith("Prompt token 1 has id -1,")


@pytest.fixture(scope="module")
def eaas_qwen3(tiny_qwen3):
    server = start_server(tiny_qwen3, "--eaas", "--eaas-expert-servers", "local:2",
                          name="request-checks-eaas")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    return hf_greedy(tiny_qwen3, PROMPTS, MAX_NEW_TOKENS)


def _vocab_size(model) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, timeout=120)


def _error_message(response: requests.Response) -> str:
    error = response.json()
    return error["message"] if "message" in error else error["error"]["message"]


class BadPrompt(NamedTuple):
    path: str
    body: dict
    position: int  # of the first out-of-vocabulary id in its prompt
    token_id: int


def _bad_prompts(vocab: int) -> list[BadPrompt]:
    greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    completion = {"model": "default", "max_tokens": 4, "temperature": 0.0}
    return [
        BadPrompt("/generate", {"input_ids": [1, 2, vocab], "sampling_params": greedy},
                  2, vocab),
        BadPrompt("/generate", {"input_ids": [1, -3, 2], "sampling_params": greedy}, 1, -3),
        BadPrompt("/generate", {"input_ids": [[1, 2, 3], [4, 5, 6, 7, vocab + 100]],
                                "sampling_params": greedy}, 4, vocab + 100),
        BadPrompt("/v1/completions", {**completion, "prompt": [7, 8, 9, 10**6]}, 3, 10**6),
        BadPrompt("/v1/completions", {**completion, "prompt": [[7, 8], [vocab, 1]]}, 0, vocab),
    ]


@pytest.mark.slow
@pytest.mark.cpu_only  # SGLang through the CPU runtime
@pytest.mark.parametrize("server_fixture", ["monolithic_qwen3", "eaas_qwen3"])
def test_out_of_vocab_prompt_is_400_and_server_keeps_serving(
        request, server_fixture, tiny_qwen3, reference):
    """Stock SGLang 0.5.23's scheduler dies on such a prompt (IndexError in the embedding)."""
    server = request.getfixturevalue(server_fixture)
    vocab = _vocab_size(tiny_qwen3)
    for bad in _bad_prompts(vocab):
        response = _post(server, bad.path, bad.body)
        assert response.status_code == 400, (bad, response.status_code, response.text)
        assert _error_message(response) == (
            f"Prompt token {bad.position} has id {bad.token_id}, outside the model's "
            f"vocabulary of {vocab} ids (valid ids are 0 to {vocab - 1})."), bad

    greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    stream = _post(server, "/generate", {"input_ids": [vocab], "sampling_params": greedy,
                                         "stream": True})  # the error is an SSE event
    assert f"Prompt token 0 has id {vocab}, outside" in stream.text, stream.text
    edge = _post(server, "/generate", {"input_ids": [0, vocab - 1], "sampling_params": greedy})
    assert edge.status_code == 200 and len(edge.json()["output_ids"]) == 4
    assert greedy_tokens(server) == reference
    assert server.process.poll() is None
