"""sgl-kernel-ext (the expert server's kernels, the paper's §4.1): each kernel's Triton version
and CPU implementation against a plain reference. Integer metadata must match exactly, the
grouped GEMM within its dtype's tolerance.

The Triton kernels run on the GPU when there is one, else on the CPU under the Triton
interpreter: Triton decides when a kernel is defined whether it is interpreted, so the kernel
modules are imported by the fixture below with ``TRITON_INTERPRET=1`` set for this module only.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_kernel_ext.group_shrink import (
    Groups, group_shrink, group_shrink_reference, group_shrink_triton,
)
from sgl_kernel_ext.grouped_gemm import grouped_expert_reference, grouped_expert_triton
from sgl_kernel_ext.static_grid import (
    gather_varlen, gather_varlen_reference, gather_varlen_triton, varlen_rows, visit_reference,
    visit_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
# Batch lengths: empty batches are common (a client with nothing for this server).
LENGTHS = st.lists(st.one_of(st.just(0), st.integers(0, 20)), max_size=10)


@pytest.fixture(scope="module", autouse=True)
def triton_kernels():
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        from triton.runtime.interpreter import InterpretedFunction

        from sgl_kernel_ext import group_shrink_kernel, grouped_gemm_kernels, static_grid_kernels

        kernels = (group_shrink_kernel.group_shrink_kernel, static_grid_kernels.visit_kernel,
                   static_grid_kernels.gather_kernel, grouped_gemm_kernels.gate_up_kernel,
                   grouped_gemm_kernels.down_kernel)
        if DEVICE == "cpu":
            assert all(isinstance(k, InterpretedFunction) for k in kernels), (
                "sgl_kernel_ext's kernel modules were imported before TRITON_INTERPRET was set")
        yield


def _cpu(groups: Groups) -> tuple:
    return groups.active, *(f.cpu() for f in (groups.expert, groups.offset, groups.count))


def _assert_same_groups(got: Groups, want: Groups) -> None:
    (active, *fields), (want_active, *want_fields) = _cpu(got), _cpu(want)
    assert active == want_active
    for name, field, want_field in zip(("expert", "offset", "count"), fields, want_fields):
        assert field.dtype == torch.int32 and torch.equal(field, want_field), name


def _sparse_counts(num: int, active: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(num, dtype=torch.int64)
    counts[torch.randperm(num, generator=g)[:active]] = torch.randint(1, 50, (active,), generator=g)
    return counts


GROUP_CASES = {
    "all-zero": torch.zeros(16, dtype=torch.int32),
    "all-active": torch.arange(1, 17, dtype=torch.int32),
    "single-active": _sparse_counts(32, 1, 0),
    "E=1 idle": torch.zeros(1, dtype=torch.int32),
    "E=1 active": torch.tensor([7], dtype=torch.int32),
    "E=256, 8 active": _sparse_counts(256, 8, 1),
    "E=1000, 100 active": _sparse_counts(1000, 100, 2),
}


@pytest.mark.parametrize("counts", GROUP_CASES.values(), ids=GROUP_CASES.keys())
def test_group_shrink_cases(counts):
    want = group_shrink_reference(counts)
    _assert_same_groups(group_shrink(counts), want)
    _assert_same_groups(group_shrink_triton(counts.to(DEVICE)), want)


def test_group_shrink_layout():
    groups = group_shrink_reference(torch.tensor([0, 3, 0, 0, 2, 5]))
    assert groups.active == 3
    assert groups.expert.tolist() == [1, 4, 5, 0, 0, 0]
    assert groups.offset.tolist() == [0, 3, 5, 0, 0, 0]
    assert groups.count.tolist() == [3, 2, 5, 0, 0, 0]


@SETTINGS
@given(st.lists(st.one_of(st.just(0), st.integers(0, 9)), min_size=1, max_size=300))
def test_group_shrink_random(counts):
    counts = torch.tensor(counts, dtype=torch.int32)
    want = group_shrink_reference(counts)
    _assert_same_groups(group_shrink(counts), want)
    _assert_same_groups(group_shrink_triton(counts.to(DEVICE)), want)


def literal_visits(lengths: list[int], grid: int, stride: int) -> list[tuple[int, int, int]]:
    """Algorithm 1 as printed, with the token id advancing by ``stride``: the paper's
    ``blockDim.x`` (any block size), or the grid size (the correction)."""
    visits = []
    for program in range(grid):
        token = program
        for batch, n in enumerate(lengths):
            while token < n:
                visits.append((program, batch, token))
                token += stride
            token -= n
    return visits


def _pairs(lengths: list[int]) -> Counter:
    return Counter((b, t) for b, n in enumerate(lengths) for t in range(n))


def _check_visits(lengths: list[int], grid: int) -> torch.Tensor:
    """The reference visits every (batch, token) once, as the literal loop stepping by the grid
    does, program ``p`` taking the packed tokens ``p, p + grid, ...``; returns it."""
    visits = literal_visits(lengths, grid, stride=grid)
    assert Counter((b, t) for _, b, t in visits) == _pairs(lengths)
    got = visit_reference(torch.tensor(lengths, dtype=torch.int32), grid)
    total = sum(lengths)
    assert got.dtype == torch.int32 and got.shape == (total, 3)
    assert sorted(map(tuple, got.tolist())) == sorted(visits)
    batch, token = varlen_rows(torch.tensor(lengths, dtype=torch.int64))
    assert torch.equal(got[:, 1].long(), batch) and torch.equal(got[:, 2].long(), token)
    assert torch.equal(got[:, 0].long(), torch.arange(total) % grid)
    return got


STATIC_CASES = [([], 3), ([0, 0, 0], 2), ([5, 0, 3, 0], 1), ([5, 0, 3, 0], 100), ([1], 1),
                ([0, 17, 0, 0, 4, 9, 0], 4), ([33], 7), ([2, 2, 2, 2], 3)]


@pytest.mark.parametrize("lengths,grid", STATIC_CASES)
def test_static_grid_cases(lengths, grid):
    want = _check_visits(lengths, grid)
    assert torch.equal(visit_triton(torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
                                    grid).cpu(), want)


@SETTINGS
@given(LENGTHS, st.integers(1, 40))
def test_static_grid_reference_random(lengths, grid):
    _check_visits(lengths, grid)


@settings(SETTINGS, max_examples=30)
@given(LENGTHS, st.integers(1, 24))
def test_static_grid_triton_random(lengths, grid):
    num_tokens = torch.tensor(lengths, dtype=torch.int64)
    got = visit_triton(num_tokens.to(DEVICE), grid).cpu()
    assert torch.equal(got, visit_reference(num_tokens, grid))


def test_paper_literal_stride_is_wrong():
    """Stepping by the block size instead of the grid size misses tokens when the block is
    larger than the grid and visits some twice when it is smaller."""
    lengths = [5, 0, 3]
    larger = Counter((b, t) for _, b, t in literal_visits(lengths, grid=2, stride=4))
    assert _pairs(lengths) - larger == Counter({(0, 2): 1, (0, 3): 1, (2, 1): 1, (2, 2): 1})
    smaller = Counter((b, t) for _, b, t in literal_visits(lengths, grid=4, stride=2))
    assert set(smaller) == set(_pairs(lengths)) and max(smaller.values()) == 2
    assert sum(smaller.values()) > sum(lengths)
    for grid in (2, 4):
        _check_visits(lengths, grid)


@SETTINGS
@given(LENGTHS)
def test_varlen_rows(lengths):
    batch, token = varlen_rows(torch.tensor(lengths, dtype=torch.int32))
    assert batch.dtype == token.dtype == torch.int64
    assert list(zip(batch.tolist(), token.tolist())) == sorted(_pairs(lengths))


def _gather_inputs(lengths: list[int], hidden: int, dtype: torch.dtype, seed: int):
    """A buffer of client slots of ``max(lengths)`` rows plus random gaps, one batch per slot."""
    rng = random.Random(seed)
    starts, row = [], 0
    for n in lengths:
        row += rng.randint(0, 3)
        starts.append(row)
        row += max(n, rng.randint(n, n + 4))
    g = torch.Generator().manual_seed(seed)
    src = (torch.randn(row + rng.randint(0, 2), hidden, generator=g) * 100).to(dtype)
    return src, torch.tensor(starts, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int32)


@settings(SETTINGS, max_examples=30)
@given(LENGTHS, st.sampled_from([1, 8, 37]), st.sampled_from([torch.float32, torch.bfloat16,
                                                               torch.int32]),
       st.integers(1, 9), st.integers(0, 2**16))
def test_gather_varlen(lengths, hidden, dtype, grid, seed):
    src, starts, num_tokens = _gather_inputs(lengths, hidden, dtype, seed)
    want = gather_varlen_reference(src, starts, num_tokens)
    assert want.shape == (sum(lengths), hidden) and want.dtype == dtype
    assert torch.equal(gather_varlen(src, starts, num_tokens), want)
    got = gather_varlen_triton(src.to(DEVICE), starts.to(DEVICE), num_tokens.to(DEVICE), grid)
    assert torch.equal(got.cpu(), want)


def test_gather_varlen_wide_rows():
    """Rows wider than the kernel's column block (1024) take several blocks each."""
    src, starts, num_tokens = _gather_inputs([3, 0, 2], 1100, torch.float32, 0)
    got = gather_varlen_triton(src.to(DEVICE), starts.to(DEVICE), num_tokens.to(DEVICE), 2)
    assert torch.equal(got.cpu(), gather_varlen_reference(src, starts, num_tokens))


# (counts per expert, hidden, intermediate, grid): groups spanning several row tiles (16 rows),
# sizes not multiples of the column and K blocks (32), grids smaller and larger than the tiles.
GEMM_CASES = {
    "sparse": ([0, 5, 0, 0, 19, 1, 0, 3], 48, 40, 3),
    "one expert": ([33], 32, 64, 1),
    "grid > tiles": ([2, 0, 7, 1], 24, 20, 64),
    "idle": ([0, 0, 0], 16, 16, 4),
}
DTYPES = {"f32": (torch.float32, torch.float32), "bf16 weights": (torch.float32, torch.bfloat16),
          "bf16": (torch.bfloat16, torch.bfloat16)}


@pytest.mark.parametrize("dtypes", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", GEMM_CASES.values(), ids=GEMM_CASES.keys())
def test_grouped_expert(case, dtypes):
    counts, hidden, inter, grid = case
    x_dtype, w_dtype = dtypes
    g = torch.Generator().manual_seed(len(counts) * hidden + inter)
    num = len(counts)
    x = torch.randn(sum(counts), hidden, generator=g).to(x_dtype)
    w13 = (torch.randn(num, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(w_dtype)
    w2 = (torch.randn(num, hidden, inter, generator=g) / inter ** 0.5).to(w_dtype)
    counts = torch.tensor(counts, dtype=torch.int32)
    want = grouped_expert_reference(x, w13, w2, group_shrink(counts))
    groups = group_shrink_triton(counts.to(DEVICE))
    got = grouped_expert_triton(x.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), groups, grid).cpu()
    assert got.dtype == x_dtype and got.shape == x.shape
    if not counts.any():
        assert not got.any() and not want.any()
        return
    scale = want.float().abs().max().item()
    tol = 1e-5 if w_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)
