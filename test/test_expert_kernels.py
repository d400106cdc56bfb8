"""The expert server's fast CPU kernel (sgl_kernel_ext.cpu_ops, csrc/cpu/grouped_expert.cpp).

* The C++ grouped kernel against an independent PyTorch reference (a loop over the experts
  with ``F.linear`` in float64, written here) within the weights' dtype tolerance, on each of
  its paths this CPU can run (avx512bf16, avx512, avx2, scalar; the others are skipped), on
  odd shapes: H and I not multiples of 8, groups of 1 and of 9+ rows, empty groups, a single
  expert.
* A row's result is the same bits whatever its group's size and the thread count.
* ``weighted_expert_sum``: fast (shrink on and off: identical) against reference (SGLang's op
  order) within tolerance, top-k 4 with entries held elsewhere (-1).
* ``expert_sum`` (the fused C++ op the fast kernel is) gives the bits of the same steps done
  with torch ops around ``grouped_expert``, and refuses expert rows it does not have.
* An expert server started with ``--kernel fast --disable-shrink`` serves; the flags'
  refusals (expert server and SGLang side).
* The build: two processes building at once share one build; no compiler is one sentence.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import open_log
from hf_reference import assert_matches_hf, hf_routed_experts
from sgl_kernel_ext import cpu_ops
from sgl_kernel_ext.group_shrink import group_shrink
from sglang_eaas.checkpoint import ModelIdentity
from sglang_eaas.client.client import EaasClient
from sglang_eaas.expert_server.compute import local_experts, weighted_expert_sum
from sglang_eaas.expert_server.experts import LayerExperts
from sglang_eaas.launcher.local_servers import start_local_servers
from sglang_eaas.model_info import MoeModelInfo
from test_plugin import _parse, sglang_with_plugins  # noqa: F401 (a fixture)

# Relative to the result's scale: float32 sums in another order (bfloat16/float16 weights are
# exact in float32); the avx512bf16 path also rounds the SiLU * up intermediate to bfloat16 (the
# reference does too, but a value near a rounding boundary may round the other way).
TOLERANCE = 1e-5
BF16_PATH_TOLERANCE = 2**-8
PATHS = ["avx512bf16", "avx512", "avx2", "scalar"]


def _skip_unless_supported(path: str) -> None:
    if path not in cpu_ops.isas():
        pytest.skip(f"this CPU cannot run the {path} path (it runs {cpu_ops.isas()})")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    cpu_ops.build()  # built by scripts/setup.sh: loads at once


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    return w13, w2


def reference_rows(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: list[int],
                   round_h: bool = False) -> torch.Tensor:
    """Expert by expert with F.linear in float64: rows of x sorted by expert, counts[e] each
    (``round_h``: the SiLU * up intermediate rounded to bfloat16 on the way)."""
    out, start, inter = [], 0, w13.shape[1] // 2
    for e, n in enumerate(counts):
        xs = x[start : start + n].double()
        gate_up = F.linear(xs, w13[e].double())
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        if round_h:
            h = h.float().bfloat16().double()
        out.append(F.linear(h, w2[e].double()))
        start += n
    return torch.cat(out).float()


def _run(x, w13, w2, counts, shrink=True, path="auto"):
    """The kernel on rows sorted by expert (counts[e] each); shrink off hands it every
    expert as a group, empty ones included."""
    counts = torch.tensor(counts, dtype=torch.int32)
    if shrink:
        g = group_shrink(counts)
        expert, offset, count, groups = g.expert, g.offset, g.count, g.active
    else:
        expert = torch.arange(len(counts), dtype=torch.int32)
        offset, count, groups = torch.cumsum(counts, 0) - counts, counts, len(counts)
    return cpu_ops.grouped_expert(x, w13, w2, expert, offset, count, groups, isa=path)


def _assert_close(got, want, tolerance=TOLERANCE):
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance * scale)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden, inter, counts", [
    (37, 13, [1, 0, 9, 3]),          # H, I not multiples of 8; an empty group; 9 rows
    (64, 32, [17]),                  # E = 1, three row tiles (8 + 8 + 1)
    (130, 70, [0, 0, 2, 0, 1, 11]),  # empties first, blocks of 16/32 rows with remainders
    (8, 5, [1]),                     # one row, one 8-wide vector, I < a block
    (200, 100, [13, 25, 3, 12, 0]),  # tiles of 12 rows at most on avx512bf16 (7+6, 9+8+8)
])
def test_kernel_matches_pytorch(path, dtype, hidden, inter, counts):
    _skip_unless_supported(path)
    bf16_path = path == "avx512bf16"
    if bf16_path and dtype != torch.bfloat16:
        pytest.skip("the avx512bf16 path multiplies bfloat16 weights only")
    w13, w2 = _weights(len(counts), hidden, inter, dtype)
    x = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1))
    if bf16_path:
        x = x.bfloat16()  # what it multiplies (it would round float32 x to it)
    want = reference_rows(x, w13, w2, counts, round_h=bf16_path)
    got = _run(x, w13, w2, counts, path=path)
    assert got.dtype == torch.float32 and got.shape == want.shape
    _assert_close(got, want, BF16_PATH_TOLERANCE if bf16_path else TOLERANCE)
    # Shrink off: every expert is a group, the empty ones walked and skipped; same bits.
    assert torch.equal(_run(x, w13, w2, counts, shrink=False, path=path), got)


def test_auto_takes_the_best_path_for_the_dtypes():
    w13, w2 = _weights(2, 40, 24, torch.bfloat16)
    x = torch.randn(5, 40).bfloat16()
    best = cpu_ops.isa()
    assert torch.equal(_run(x, w13, w2, [2, 3]), _run(x, w13, w2, [2, 3], path=best))
    float_best = [p for p in cpu_ops.isas() if p != "avx512bf16"][0]
    assert torch.equal(_run(x.float(), w13, w2, [2, 3]),
                       _run(x.float(), w13, w2, [2, 3], path=float_best))
    with pytest.raises(RuntimeError, match="isa must be auto, avx512bf16, avx512, avx2 or scalar"):
        _run(x, w13, w2, [2, 3], path="sse")


def test_kernel_takes_x_in_the_weights_dtype():
    w13, w2 = _weights(2, 40, 24, torch.float16)
    x = torch.randn(5, 40).half()
    assert torch.equal(_run(x, w13, w2, [2, 3]), _run(x.float(), w13, w2, [2, 3]))


@pytest.mark.parametrize("path", PATHS)
def test_a_rows_result_does_not_depend_on_its_group_or_threads(path):
    """Each output element is summed in one order whatever the batch: the row alone, the row
    among 25 others (in tiles of 9, 9 and 8 rows on avx512bf16, of 7, 7, 6 and 6 elsewhere),
    1 or 2 threads give the same bits."""
    _skip_unless_supported(path)
    w13, w2 = _weights(3, 136, 72, torch.bfloat16, seed=3)
    x = torch.randn(26, 136, generator=torch.Generator().manual_seed(4)).bfloat16()
    grouped = _run(x, w13, w2, [0, 26, 0], path=path)
    alone = torch.cat([_run(x[i : i + 1], w13, w2, [0, 1, 0], path=path) for i in range(26)])
    assert torch.equal(grouped, alone)
    torch.set_num_threads(2)
    assert torch.equal(_run(x, w13, w2, [0, 26, 0], path=path), grouped)
    assert torch.equal(_run(x, w13, w2, [5, 4, 17], path=path)[5:9], grouped[5:9])


def test_kernel_refuses_bad_groups():
    w13, w2 = _weights(2, 16, 8, torch.float32)
    x = torch.randn(3, 16)
    one = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="expert 2 is not one of the 2"):
        cpu_ops.grouped_expert(x, w13, w2, one * 2, one * 0, one, 1)
    with pytest.raises(RuntimeError, match=r"rows \[3, 4\) are not within x's 3"):
        cpu_ops.grouped_expert(x, w13, w2, one * 0, one * 3, one, 1)
    with pytest.raises(RuntimeError, match="w2 must be"):
        cpu_ops.grouped_expert(x, w13, w2.transpose(1, 2), one * 0, one * 0, one, 1)


def test_paths_are_reported():
    assert cpu_ops.isas()[-1] == "scalar" and set(cpu_ops.isas()) <= set(PATHS)
    assert cpu_ops.isa() == cpu_ops.isas()[0]


def _layer(experts: int, held: list[int], hidden: int, inter: int, dtype) -> LayerExperts:
    w13, w2 = _weights(len(held), hidden, inter, dtype, seed=7)
    index = torch.full((experts,), -1, dtype=torch.long)
    index[torch.tensor(held)] = torch.arange(len(held))
    return LayerExperts(w13, w2, index)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_fast_sum_matches_reference(dtype, tokens, threads):
    """Top-4 of 16 experts, this server holding 10 of them (the rest arrive as -1)."""
    torch.set_num_threads(threads)
    layer = _layer(16, [0, 1, 2, 3, 5, 8, 9, 12, 14, 15], 72, 40, dtype)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(tokens)]).int()
    held = layer.local_index[ids.long()] >= 0
    local = local_experts(layer, torch.where(held, ids, -1))
    hidden = torch.randn(tokens, 72, generator=g).to(dtype)
    weights = torch.rand(tokens, 4, generator=g)
    reference = weighted_expert_sum(layer, hidden, local, weights, kernel="reference")
    fast = weighted_expert_sum(layer, hidden, local, weights, kernel="fast")
    assert fast.dtype == dtype and fast.shape == reference.shape
    truth = torch.zeros(tokens, 72, dtype=torch.float64)  # float64, entry by entry
    for entry, e in enumerate(local.tolist()):
        if e >= 0:
            t, k = divmod(entry, 4)
            row = reference_rows(hidden[t : t + 1], layer.w13[e : e + 1], layer.w2[e : e + 1], [1])
            truth[t] += weights[t, k].double() * row[0].double()
    scale = float(truth.abs().max())
    if dtype == torch.float32:
        torch.testing.assert_close(fast, reference, rtol=0, atol=1e-5 * scale)
        torch.testing.assert_close(fast.double(), truth, rtol=0, atol=1e-5 * scale)
    else:
        # The fast kernel rounds once, at the end (half a bfloat16 step of the largest value);
        # the reference rounds gate/up, SiLU * up and each expert's output to bfloat16 on the
        # way, as SGLang does, and lands a few steps further.
        torch.testing.assert_close(fast.double(), truth, rtol=0, atol=2 ** -8 * scale)
        torch.testing.assert_close(reference.double(), truth, rtol=0, atol=2 ** -5 * scale)
    assert torch.equal(weighted_expert_sum(layer, hidden, local, weights, shrink=False), fast)
    nothing = torch.full_like(local, -1)
    assert torch.equal(weighted_expert_sum(layer, hidden, nothing, weights),
                       torch.zeros_like(hidden))


def _torch_weighted_sum(hidden, w13, w2, flat_local, router_weights):
    """What expert_sum fuses, in plain torch ops around grouped_expert (tested on its own above
    against float64): entries sorted by expert, x's rows gathered, the rows scattered back to
    their entries (zeros where not held), multiplied by the router weights and summed over k in
    float32, then rounded to x's dtype."""
    tokens, top_k = router_weights.shape
    order = torch.argsort(flat_local, stable=True)
    entries = order[int((flat_local < 0).sum()):]
    counts = torch.bincount(flat_local[entries], minlength=w13.shape[0])
    g = group_shrink(counts)
    rows = cpu_ops.grouped_expert(hidden.index_select(0, entries // top_k), w13, w2, g.expert,
                                  g.offset, g.count, g.active)
    per_entry = rows.new_zeros(tokens * top_k, rows.shape[1]).index_copy_(0, entries, rows)
    return (per_entry.view(tokens, top_k, -1).mul_(router_weights.unsqueeze(-1).float())
            .sum(dim=1).type(hidden.dtype))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("experts, hidden, inter, tokens, top_k", [
    (16, 72, 40, 5, 4), (6, 130, 70, 40, 2), (3, 37, 13, 9, 3), (4, 64, 32, 30, 1)])
def test_expert_sum_is_the_torch_composition(threads, dtype, experts, hidden, inter, tokens,
                                             top_k):
    """expert_sum (sort, gather, kernel, weighted sum over k, one C++ call) gives the bits of
    the same steps in torch ops: products rounded to float32, then added in k order."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(experts * tokens)
    w13, w2 = _weights(experts, hidden, inter, dtype, seed=experts)
    flat = torch.randint(-1, experts, (tokens * top_k,), generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights = torch.rand(tokens, top_k, generator=g) * 2 - 0.5  # some negative
    got = cpu_ops.expert_sum(x, w13, w2, flat, weights)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, _torch_weighted_sum(x, w13, w2, flat, weights))
    assert torch.equal(cpu_ops.expert_sum(x, w13, w2, flat, weights, shrink=False), got)
    # int32 ids, as the server's requests carry them; a token with no entry held here is zero.
    flat[:top_k] = -1
    got = cpu_ops.expert_sum(x, w13, w2, flat.int(), weights)
    assert torch.equal(got, _torch_weighted_sum(x, w13, w2, flat, weights))
    assert not got[0].any()


def test_expert_sum_refuses_bad_entries():
    w13, w2 = _weights(2, 16, 8, torch.float32)
    x, weights = torch.randn(3, 16), torch.ones(3, 2)
    with pytest.raises(RuntimeError, match=r"flat_local\[4\] = 2 is not -1 or one of the 2"):
        cpu_ops.expert_sum(x, w13, w2, torch.tensor([0, 1, 1, 0, 2, -1]), weights)
    with pytest.raises(RuntimeError, match=r"flat_local\[0\] = -2"):
        cpu_ops.expert_sum(x, w13, w2, torch.tensor([-2, 1, 1, 0, 1, -1]), weights)
    with pytest.raises(RuntimeError, match=r"flat_local must be \[T \* K\] = \[6\]"):
        cpu_ops.expert_sum(x, w13, w2, torch.tensor([0, 1, 1, 0]), weights)
    with pytest.raises(RuntimeError, match="hidden must be"):
        cpu_ops.expert_sum(x, w13, w2, torch.tensor([0, 1, 1, 0, 1, 1]), torch.ones(2, 3))


def test_unknown_kernel_is_refused():
    layer = _layer(2, [0, 1], 8, 8, torch.float32)
    with pytest.raises(ValueError, match="kernel must be one of"):
        weighted_expert_sum(layer, torch.zeros(1, 8), torch.tensor([0]), torch.ones(1, 1),
                            kernel="quick")


def test_expert_server_with_fast_kernel_serves(tiny_qwen3):
    """A server started with --kernel fast --disable-shrink answers as transformers does."""
    info = MoeModelInfo.from_model_path(tiny_qwen3)
    log = open_log("expert-server-fast-kernel")
    (server,) = start_local_servers(tiny_qwen3, [list(range(info.num_experts))], "float32",
                                    max_clients=1, stdout=log,
                                    extra_args=("--kernel", "fast", "--disable-shrink"))
    try:
        client = EaasClient([server.address], info, ModelIdentity.of(tiny_qwen3), torch.float32,
                            "fast-kernel")
        try:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(9, info.hidden_size, generator=g)
            ids = torch.stack([torch.randperm(info.num_experts, generator=g)[:2]
                               for _ in range(9)])
            weights = torch.rand(9, 2, generator=g)
            out = client.forward(1, x, ids, weights)
        finally:
            client.close()
    finally:
        server.stop()
        log.close()
    assert_matches_hf(out, hf_routed_experts(tiny_qwen3), 1, x, ids, weights)


def test_expert_server_refuses_shrink_without_fast(tiny_qwen3):
    result = subprocess.run(
        [sys.executable, "-m", "sglang_eaas.expert_server", "--model-path", str(tiny_qwen3),
         "--experts", "all", "--token", "t", "--kernel", "reference", "--disable-shrink"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("error: --disable-shrink applies to --kernel fast only")


@pytest.mark.parametrize("args, message", [
    (["--eaas-kernel", "fast"], "--eaas-kernel only apply with --eaas"),
    (["--eaas", "--eaas-kernel", "quick"], "invalid choice: 'quick'"),
    (["--eaas", "--eaas-kernel", "reference", "--eaas-disable-shrink"],
     "--eaas-disable-shrink applies to --eaas-kernel fast only"),
    (["--eaas", "--eaas-expert-servers", "h:7000", "--eaas-disable-shrink"],
     "--eaas-kernel and --eaas-disable-shrink apply to the local expert servers this launcher "
     "starts; give servers started separately --kernel and --disable-shrink instead"),
])
def test_sglang_flags_are_refused(sglang_with_plugins, tiny_qwen3, capsys,  # noqa: F811
                                  args, message):
    with pytest.raises(SystemExit) as exc:
        _parse(tiny_qwen3, *args)
    assert exc.value.code not in (0, None)
    assert message in capsys.readouterr().err + str(exc.value.code)


def test_sglang_flags_parse(sglang_with_plugins, tiny_qwen3):  # noqa: F811
    cfg = _parse(tiny_qwen3, "--eaas", "--eaas-kernel", "reference")._eaas
    assert (cfg.kernel, cfg.shrink) == ("reference", True)
    cfg = _parse(tiny_qwen3, "--eaas", "--eaas-disable-shrink")._eaas
    assert (cfg.kernel, cfg.shrink) == (None, False)


def _build_in(cache, env_extra=None) -> subprocess.Popen:
    """``python -m sgl_kernel_ext.cpu_ops`` with its build folder under ``cache``."""
    env = {**os.environ, "SGLANG_EAAS_KERNEL_CACHE": str(cache), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "sgl_kernel_ext.cpu_ops"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_building_at_once_share_one_build(tmp_path):
    """Expert servers starting together: one compiles under the folder's lock, the other
    waits and loads its library."""
    first, second = _build_in(tmp_path), _build_in(tmp_path)
    outputs = [p.communicate(timeout=600) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    said = sorted(out.split(" in ")[0] for out, _ in outputs)
    assert said == ["CPU expert kernel already built", "CPU expert kernel built"]
    (folder,) = tmp_path.iterdir()
    assert (folder / "sgl_kernel_ext_cpu.so").exists() and not (folder / "lock").exists()


def test_a_missing_compiler_is_one_sentence(tmp_path):
    process = _build_in(tmp_path, {"CXX": "no-such-c++"})
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert err.strip() == (
        "error: building the CPU expert kernel needs a C++ compiler ('no-such-c++' is not on "
        "PATH): install g++ (Debian: apt-get install -y g++) or run the expert server with "
        "--kernel reference")
