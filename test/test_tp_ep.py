"""``--tp 2 --ep 2`` on the CPU: SGLang's native MoE path made EP-aware by the plugin's hook, and
its two ranks' KV pools sized together from the host's memory (no ``--max-total-tokens``)."""

from __future__ import annotations

import re

import psutil
import pytest
from conftest import greedy_tokens, resident_bytes, start_server

from sglang_eaas.cpu_runtime.server_defaults import HOST_STATIC_SHARE

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang on the CPU runtime (no GPU)

KV_POOL = re.compile(r"KV Cache is allocated\. dtype: \S+, #tokens: \d+, "
                     r"K size: ([\d.]+) GB, V size: ([\d.]+) GB")


def test_tp2_ep2_matches_tp1(monolithic_qwen3, tiny_qwen3):
    """Started as a user would, without --max-total-tokens: stock SGLang gave each rank 0.95 of
    the host's available memory (1.9 times what there is: killed at start-up). The CPU runtime
    gives the two ranks' weights and KV pools half of it together; with the rest of the tree
    (launcher and detokenizer 0.7 GiB each, a rank 0.8 GiB and ~57 bytes a KV token: 13.6 GiB in
    all with 19.5 GiB available) the server stays under three quarters of the host's memory."""
    expected = greedy_tokens(monolithic_qwen3)
    available = psutil.virtual_memory().available
    server = start_server(tiny_qwen3, "--tp", "2", "--ep", "2", name="tp2-ep2-qwen3",
                          small_kv=False)
    try:
        tokens = greedy_tokens(server)
        resident = resident_bytes(server)
        log = server.log_path.read_text()
    finally:
        server.stop()
    assert tokens == expected
    assert "ep_size': 2" in log  # the run really used expert parallelism
    pools = [float(k) + float(v) for k, v in KV_POOL.findall(log)]
    assert len(pools) == 2  # one per rank
    # The ranks size from what they find available once started (less than `available`, read
    # before the start); 0.6 leaves room for memory that other work frees meanwhile.
    assert sum(pools) * 2**30 <= (HOST_STATIC_SHARE + 0.1) * available, (pools, available)
    assert resident < 0.75 * psutil.virtual_memory().total, (resident, pools, available)
