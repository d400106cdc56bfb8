"""``--tp 2 --ep 2`` on the CPU: SGLang's native MoE path made EP-aware by the plugin's hook."""

from __future__ import annotations

import pytest
from conftest import greedy_tokens, start_server

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang on the CPU runtime (no GPU)


def test_tp2_ep2_matches_tp1(monolithic_qwen3, tiny_qwen3):
    expected = greedy_tokens(monolithic_qwen3)
    server = start_server(tiny_qwen3, "--tp", "2", "--ep", "2", name="tp2-ep2-qwen3")
    try:
        tokens = greedy_tokens(server)
        log = server.log_path.read_text()
    finally:
        server.stop()
    assert tokens == expected
    assert "ep_size': 2" in log  # the run really used expert parallelism
