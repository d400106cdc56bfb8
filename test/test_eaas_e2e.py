"""SGLang with --eaas: token-identical to monolithic SGLang, with the experts on expert servers."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch
from conftest import MAX_NEW_TOKENS, PROMPTS, greedy_tokens, open_log, start_server
from hf_reference import hf_greedy

from sglang_eaas import cores, cpu_runtime
from sglang_eaas.launcher.local_servers import start_local_servers

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # SGLang through the CPU runtime
PARAMS = re.compile(r"model parameters (\d+) bytes, routed-expert parameters (\d+) bytes")


# A prompt longer than the chunked-prefill size used below, and two sharing a prefix.
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)
BATCH = (LONG, PROMPTS[0] + " again", PROMPTS[0] + " and more", *PROMPTS)


@pytest.fixture(scope="module")
def expected(monolithic_qwen3):
    """Monolithic tokens and parameter bytes (the baseline every --eaas run must reproduce)."""
    (total, routed), = {m.groups() for m in PARAMS.finditer(monolithic_qwen3.log_path.read_text())}
    return greedy_tokens(monolithic_qwen3), int(total), int(routed)


def _concurrently(server, prompts) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return [r["output_ids"] for r in pool.map(
            lambda p: server.generate(p, MAX_NEW_TOKENS), prompts)]


def test_continuous_batching_chunked_prefill_and_radix_cache(monolithic_qwen3, tiny_qwen3):
    """Concurrent requests (batched together), a prompt split into prefill chunks and prompts
    sharing a cached prefix give, one by one, the tokens monolithic SGLang gives alone."""
    alone = greedy_tokens(monolithic_qwen3, BATCH)
    server = start_server(tiny_qwen3, "--eaas", "--eaas-expert-servers", "local:2",
                          "--chunked-prefill-size", "32", name="eaas-batching")
    try:
        together = _concurrently(server, BATCH)
        again = _concurrently(server, BATCH)  # now with the prefixes in the radix cache
        log = server.log_path.read_text()
    finally:
        server.stop()
    assert together == alone and again == alone
    assert re.search(r"#new-seq: [2-9]", log)  # requests really were batched (one prefill)
    assert re.search(r"#cached-token: [1-9]", log)  # and the radix cache was hit
    # the rank runs the torch threads its 2 local servers leave it (one on 2 cores)
    threads = cores.rank_threads(2, 1)
    if cpu_runtime.is_active() and threads < torch.get_num_threads():
        assert f"this rank runs {threads} torch thread(s), not {torch.get_num_threads()}" in log


def test_mixtral(tiny_mixtral):
    """Also: SGLang has no two-batch overlap operations for Mixtral, so asking for it serves
    without, saying so."""
    tokens, log = _run_eaas(tiny_mixtral, "--eaas-expert-servers", "local:2",
                            "--enable-two-batch-overlap", name="eaas-mixtral")
    assert tokens == hf_greedy(tiny_mixtral, PROMPTS, MAX_NEW_TOKENS)
    assert "routed-expert parameters 0 bytes" in log
    assert ("serving without two-batch overlap: SGLang 0.5.23 has two-batch overlap operations "
            "for Qwen3-MoE here, not for model type mixtral") in log


def _run_eaas(model, *args: str, name: str,
              env: dict[str, str] | None = None) -> tuple[list[list[int]], str]:
    server = start_server(model, "--eaas", *args, name=name, env=env)
    try:
        tokens = greedy_tokens(server)
        chat = server.chat("Tell me a story about a robot.", max_tokens=4)
    finally:
        server.stop()
    assert chat["usage"]["completion_tokens"] == 4
    log = server.log_path.read_text()
    spawned = re.findall(r"expert server ready on (\S+):", log)
    deadline = time.monotonic() + 15
    while _live_expert_servers(spawned) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _live_expert_servers(spawned) == []  # the local expert servers stopped with SGLang
    return tokens, log


def _live_expert_servers(addresses: list[str]) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE
            and any(f"--listen {a}" in " ".join(p.info["cmdline"] or []) for a in addresses)]


def _check(expected, tokens, log, ranks: int = 1):
    mono_tokens, mono_total, mono_routed = expected
    assert tokens == mono_tokens
    held = [tuple(map(int, m.groups())) for m in PARAMS.finditer(log)]
    assert len(held) == ranks
    for total, routed in held:  # no routed-expert weights on any attention rank
        assert routed == 0
        # One rank holds exactly the non-expert weights; TP ranks hold shards of them.
        assert total == mono_total - mono_routed if ranks == 1 else total < mono_total - mono_routed


@pytest.mark.parametrize("transport", ["mooncake", "device"])
def test_transports_match_monolithic(tiny_qwen3, expected, transport):
    """The same tokens when the slots travel over Mooncake (loopback TCP) or the device kernels
    (under the Triton interpreter: the CPU twin of the GPU path)."""
    env = {"TRITON_INTERPRET": "1"} if transport == "device" else None
    tokens, log = _run_eaas(tiny_qwen3, "--eaas-expert-servers", "local:2", "--eaas-transport",
                            transport, name=f"eaas-{transport}", env=env)
    _check(expected, tokens, log)
    assert f"over {transport}" in log  # every connection used it
    # On device, no host step in the exchange (client/device_step.py) drove these tokens.
    assert ("the exchange runs on the device" in log) == (transport == "device")


def test_uneven_per_layer_placement_with_replicas(tiny_qwen3, expected, tmp_path):
    """Three servers holding other experts in each MoE layer (a placement file's per-layer
    form), unevenly, some experts on two of them."""
    placement = tmp_path / "per-layer.yaml"
    placement.write_text("servers:\n"
                         "  local:0: {0: [0, 1, 2, 3, 4, 5], 1: [4, 5, 6, 7, 0]}\n"
                         "  local:1: {0: [6, 7, 0], 1: [0, 1, 2, 3]}\n"
                         "  local:2: {0: [1, 6], 1: [6]}\n")
    tokens, log = _run_eaas(tiny_qwen3, "--eaas-placement", str(placement),
                            name="eaas-per-layer-replicas")
    _check(expected, tokens, log)
    assert log.count("sglang-eaas expert server ready") == 3
    assert "experts per MoE layer {0: [0, 1, 2, 3, 4, 5], 1: [0, 4, 5, 6, 7]}" in log


def test_sglang_dtype_spellings_reach_one_local_server(tiny_qwen3):
    """``--dtype half`` (SGLang's alias): a local expert server holding every expert holds
    float16 weights, as monolithic SGLang does, and the tokens are the same (local:1; two
    servers are test_continuous_batching's and the transports', three
    test_uneven_per_layer_placement_with_replicas's). The reference kernel (SGLang's op order):
    one server sums a token's experts itself, and the fast kernel's float16 sums differ from
    SGLang's in the last bits (exact only in float32's token outputs, as the equality tests
    say)."""
    def monolithic() -> list[list[int]]:
        mono = start_server(tiny_qwen3, "--dtype", "half", name="monolithic-half")
        try:
            return greedy_tokens(mono)
        finally:
            mono.stop()

    with ThreadPoolExecutor(2) as pool:  # both at once: their start-up is mostly imports
        expected = pool.submit(monolithic)
        eaas = pool.submit(_run_eaas, tiny_qwen3, "--dtype", "half", "--eaas-expert-servers",
                           "local:1", "--eaas-kernel", "reference", name="eaas-half-local1")
        (tokens, log), expected = eaas.result(), expected.result()
    assert tokens == expected
    assert log.count("sglang-eaas expert server ready") == 1


def test_two_attention_ranks_share_remote_servers(tiny_qwen3, expected):
    """Servers started separately; --tp 2: each rank is a client with its own slots."""
    log_file = open_log("eaas-tp2-expert-servers")
    servers = start_local_servers(tiny_qwen3, [[0, 1, 2, 3], [4, 5, 6, 7]], "float32", 4,
                                  stdout=log_file)
    try:
        addresses = ",".join(s.address for s in servers)
        tokens, log = _run_eaas(tiny_qwen3, "--tp", "2", "--eaas-expert-servers", addresses,
                                "--enable-two-batch-overlap", name="eaas-tp2")
    finally:
        for s in servers:
            s.stop()
        log_file.close()
    _check(expected, tokens, log, ranks=2)
    assert "expert server ready" not in log  # nothing spawned: the given servers were used
    servers_log = open(log_file.name).read()
    joined = re.findall(r"client (\S+) joined slot", servers_log)
    # 2 ranks x 2 servers (again, after a start-up stall the monitor noticed: still 2 clients),
    # and every slot back when SGLang stopped.
    assert len(set(joined)) == 2 and len(joined) >= 4, joined
    assert len(joined) == servers_log.count(" left slot ")
    assert "serving without two-batch overlap: with --tp > 1" in log
