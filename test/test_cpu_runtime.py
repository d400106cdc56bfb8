"""The CPU runtime: activation rules, the sgl_kernel stand-in, core binding, KV pool sizing, the
EP>1 MoE fix."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

from sglang_eaas import cpu_runtime
from sglang_eaas.cpu_runtime.moe_native_ep import moe_forward_native_ep
from sglang_eaas.cpu_runtime.server_defaults import (
    RUNNING_REQUESTS, cpu_threads_binding, rank_mem_fraction,
)

PROBE = (
    "import os, sys; from sglang_eaas import cpu_runtime as c; "
    "print(c.is_active(), os.environ.get('SGLANG_USE_CPU_ENGINE'))"
)


def _probe(env: dict[str, str], pythonpath: str = "") -> str:
    """Run PROBE in a fresh interpreter of this environment (the .pth start-up hook runs)."""
    full_env = {**os.environ, **env, "PYTHONPATH": pythonpath}
    full_env.pop("SGLANG_USE_CPU_ENGINE", None)
    return subprocess.run([sys.executable, "-c", PROBE], env=full_env, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.cpu_only
def test_active_in_every_fresh_interpreter_of_this_cpu_machine():
    assert not cpu_runtime.has_cuda_device()
    assert _probe({}) == "True 1"


@pytest.mark.gpu
def test_inactive_in_every_fresh_interpreter_of_a_gpu_machine():
    """On a GPU host SGLang keeps its own kernels: the runtime stays out unless forced on."""
    assert cpu_runtime.has_cuda_device()
    assert _probe({}) == "False None"
    assert _probe({"SGLANG_EAAS_CPU_RUNTIME": "on"}) == "True 1"


def test_forced_off_leaves_sglang_alone():
    assert _probe({"SGLANG_EAAS_CPU_RUNTIME": "off"}) == "False None"


def test_a_real_sgl_kernel_wins(tmp_path):
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text("")
    assert _probe({}, pythonpath=str(tmp_path)) == "False None"
    assert _probe({"SGLANG_EAAS_CPU_RUNTIME": "on"}, pythonpath=str(tmp_path)) == "True 1"


def test_cuda_device_disables_auto(monkeypatch):
    monkeypatch.setattr(cpu_runtime, "has_cuda_device", lambda: True)
    monkeypatch.setenv("SGLANG_EAAS_CPU_RUNTIME", "auto")
    assert not cpu_runtime.should_activate()
    monkeypatch.setenv("SGLANG_EAAS_CPU_RUNTIME", "on")
    assert cpu_runtime.should_activate()


@pytest.mark.cpu_only  # the stand-in is on sys.path only where the runtime is active
def test_assign_req_to_token_pool_stand_in():
    from sgl_kernel import assign_req_to_token_pool_cpu

    req_to_token = torch.zeros(3, 6, dtype=torch.int32)
    assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]), torch.tensor([4, 2]),
        torch.tensor([10, 11, 12, 20, 21]), 6,
    )
    expected = torch.zeros(3, 6, dtype=torch.int32)
    expected[2, 1:4] = torch.tensor([10, 11, 12])
    expected[0, 0:2] = torch.tensor([20, 21])
    assert torch.equal(req_to_token, expected)


@pytest.mark.cpu_only
def test_unimplemented_names_raise_clearly():
    import sgl_kernel

    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        sgl_kernel.verify_tree_greedy_cpu()


@pytest.mark.parametrize(
    "ranks, cpus, expected",
    [(2, [0, 1], "0|1"), (2, [0, 1, 2, 3], "0-1|2-3"), (3, [0, 1], "0|1|0"),
     (1, [0, 1], "0-1"), (2, [0, 2, 4, 6], "0,2|4,6")],
)
def test_cpu_threads_binding(ranks, cpus, expected):
    assert cpu_threads_binding(ranks, cpus) == expected


@pytest.mark.parametrize(
    "sglang_fraction, ranks, numa_nodes, expected",
    [(0.716, 1, 1, 0.5),  # --tp 1 on a 24 GiB host: half the host, not SGLang's 0.716
     (0.95, 2, 1, 0.25),  # --tp 2 on one node: SGLang's 0.95 each was 1.9 hosts in all
     (0.95, 4, 1, 0.125),
     (0.3, 1, 1, 0.3), (0.3, 2, 1, 0.15),  # never above SGLang's own fraction (small hosts)
     (0.95, 2, 2, 0.5),  # one rank per NUMA node: each has its node's memory, as in SGLang
     (0.95, 3, 2, 0.25), (0.95, 4, 2, 0.25)],
)
def test_rank_mem_fraction(sglang_fraction, ranks, numa_nodes, expected):
    assert rank_mem_fraction(sglang_fraction, ranks, numa_nodes) == expected


@pytest.mark.cpu_only  # the sizing applies where the runtime is active
def test_ranks_share_the_host_memory_unless_the_user_sized_it(monkeypatch, tiny_qwen3):
    """SGLang's own resolution, with the plugin's hooks: each rank's mem_fraction_static is
    SGLang's own (what it resolves when the user gives --max-total-tokens) split per
    rank_mem_fraction, and its pool holds the model's context (4096 in the tiny config) times
    the running requests (32 by default); a user's --mem-fraction-static or --max-total-tokens
    is left alone."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.common import get_cpu_ids_by_node

    load_plugins()
    numa_nodes = len(get_cpu_ids_by_node()) or 1

    def resolved(*args: str):
        # The runtime binds each rank's cores in this process's environment; unset after the test.
        monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "")
        monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
        server_args = prepare_server_args(
            ["--model-path", str(tiny_qwen3), "--device", "cpu", *args])
        server_args.resolve_once()
        view = resolved_view(server_args)
        return view.mem_fraction_static, view.max_total_tokens

    for ranks, args in ((1, ()), (2, ("--tp", "2")), (4, ("--tp", "2", "--pp-size", "2"))):
        sglang_own, tokens = resolved(*args, "--max-total-tokens", "4096")
        assert tokens == 4096  # SGLang's own fraction: 0.716 on a 24 GiB host, 0.95 for > 1 rank
        assert resolved(*args) == (rank_mem_fraction(sglang_own, ranks, numa_nodes),
                                   4096 * RUNNING_REQUESTS)
    assert resolved("--tp", "2", "--mem-fraction-static", "0.6") == (0.6, None)
    assert resolved("--max-running-requests", "3")[1] == 4096 * 3
    assert resolved("--context-length", "1000", "--tp", "2")[1] == 1000 * RUNNING_REQUESTS


class _Experts(torch.nn.Module):
    """The attributes of SGLang's FusedMoE that ``moe_forward_native`` reads."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w13_weight, self.w2_weight, self.num_experts = w13, w2, w13.shape[0]


def _sglang_moe_forward_native():
    from sglang.srt.layers.moe import fused_moe_native

    return inspect.unwrap(fused_moe_native.moe_forward_native)  # stock, even if hooked here


def test_ep_split_sums_to_the_full_moe():
    """Two EP ranks with -1 for remote experts add up to one rank holding all experts."""
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    native, config = _sglang_moe_forward_native(), MoeRunnerConfig(activation="silu")
    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens, top_k = 8, 16, 8, 11, 2
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[0] = torch.tensor([0, 1])  # both on rank 0: rank 1 sees a token with two -1s
    weights = torch.rand(tokens, top_k, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    full = native(_Experts(w13, w2), x, StandardTopKOutput(weights, ids, logits), config)

    per_rank = experts // 2
    total = torch.zeros_like(full)
    for rank in range(2):
        lo = rank * per_rank
        local = torch.where((ids >= lo) & (ids < lo + per_rank), ids - lo, -1)
        layer = _Experts(w13[lo : lo + per_rank], w2[lo : lo + per_rank])
        out = moe_forward_native_ep(native, layer, x, StandardTopKOutput(weights, local, logits),
                                    config)
        if rank == 1:
            assert torch.equal(out[0], torch.zeros(hidden))
        total += out
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_ep_hook_is_the_stock_function_without_remote_experts():
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    native, config = _sglang_moe_forward_native(), MoeRunnerConfig(activation="silu")
    gen = torch.Generator().manual_seed(1)
    layer = _Experts(torch.randn(4, 8, 6, generator=gen), torch.randn(4, 6, 4, generator=gen))
    x = torch.randn(5, 6, generator=gen)
    topk = StandardTopKOutput(torch.rand(5, 2, generator=gen),
                              torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 0]]), None)
    assert torch.equal(moe_forward_native_ep(native, layer, x, topk, config),
                       native(layer, x, topk, config))


@pytest.mark.parametrize("mode, given, expected", [
    ("decode", None, "cpu_tensor"),  # SGLang's host_pool registers memory with CUDA
    ("decode", "cpu_tensor", None),
    ("decode", "none", None),
    ("prefill", None, None),
    ("null", None, None),
])
def test_pd_decode_retraction_backup_in_host_tensors(monkeypatch, mode, given, expected):
    from types import SimpleNamespace

    from sglang_eaas.cpu_runtime import pd

    monkeypatch.setattr(cpu_runtime, "is_active", lambda: True)
    cfg = SimpleNamespace(device="cpu", disaggregation_mode=mode,
                          disaggregation_decode_retraction_backup=given)
    assert pd.retraction_backup(cfg) == expected
    assert pd.retraction_backup(SimpleNamespace(**{**vars(cfg), "device": "cuda"})) is None


def test_pd_host_pool_without_a_gpu_is_one_sentence(monkeypatch):
    from types import SimpleNamespace

    from sglang_eaas.cpu_runtime import pd
    from sglang_eaas.refusal import Refusal

    monkeypatch.setattr(cpu_runtime, "is_active", lambda: True)
    cfg = SimpleNamespace(device="cpu", disaggregation_mode="decode",
                          disaggregation_decode_retraction_backup="host_pool")
    with pytest.raises(Refusal, match="^error: --disaggregation-decode-retraction-backup "
                       "host_pool registers a host KV pool with CUDA"):
        pd.retraction_backup(cfg)
