"""ESFT batched rerouting (sgl_kernel_ext.esft_reroute, ExpertWeave §4.3): the C++ op, the torch
fallback and the Triton kernel against the expression written here, exactly (torch.equal).

* A grid of T in {0, 1, 7, 128, 1000}, K in {1, 2, 4, 8}, A in {1, 3, 20}, E in {8, 32, 256};
  ids int32 and int64 with some entries -1; aid all -1, all adapters, or mixed; contiguous,
  sliced and transposed inputs.
* A worked example by hand: -1 stays -1 for an adapter token (plain indexing would read
  ``pi[a, E - 1]``), physical ids >= E.
* ``reroute`` takes the C++ op on CPU tensors and, when its build failed, torch ops (logged
  once); the Triton kernel reroutes in place.
* The refusals, one sentence each; ``check_aid=False`` skips the aid pass.

The Triton kernel runs on the GPU when there is one, else under the Triton interpreter (the
fixture below, as in ``test_kernel_ext``); whether it is fast there only a GPU shows.
"""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from sgl_kernel_ext import cpu_ops, esft_reroute
from sgl_kernel_ext.esft_reroute import reroute, reroute_torch, reroute_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOKENS, TOP_K, ADAPTERS, EXPERTS = [0, 1, 7, 128, 1000], [1, 2, 4, 8], [1, 3, 20], [8, 32, 256]
MODES, LAYOUTS = ["base", "adapters", "mixed"], ["contiguous", "sliced", "transposed"]


@pytest.fixture(scope="module", autouse=True)
def kernels():
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        from triton.runtime.interpreter import InterpretedFunction

        from sgl_kernel_ext import esft_reroute_kernel

        if DEVICE == "cpu":
            assert isinstance(esft_reroute_kernel.reroute_kernel, InterpretedFunction), (
                "sgl_kernel_ext.esft_reroute_kernel was imported before TRITON_INTERPRET was set")
        cpu_ops.build()  # built by scripts/setup.sh: loads at once
        yield


def expected(ids: torch.Tensor, aid: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """``where(aid[:, None] < 0, ids, pi[aid, ids])`` with ``aid`` broadcast over k and -1
    entries kept (plain indexing reads ``pi[a, -1]``, the last expert, for them)."""
    a, e = aid.long()[:, None], ids.long()
    return torch.where((a < 0) | (e < 0), ids, pi[a, e].to(ids.dtype))


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values, ``contiguous``, ``sliced`` (every other column of a wider tensor) or
    ``transposed`` (column-major; a 1-d tensor is sliced)."""
    if layout == "contiguous":
        return t
    if layout == "transposed" and t.dim() == 2:
        return t.t().contiguous().t()
    wide = t.new_full((*t.shape[:-1], 2 * t.shape[-1]), 12345)
    wide[..., ::2] = t
    return wide[..., ::2]


def _inputs(tokens: int, top_k: int, adapters: int, experts: int, mode: str, dtype: torch.dtype,
            seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router ids with about a fifth -1, adapter ids by ``mode``, and a map in which each adapter
    replaces about 30% of the experts by physical ids E, E + 1, ..."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    ids[torch.rand(tokens, top_k, generator=g) < 0.2] = -1
    low = {"base": -1, "adapters": 0, "mixed": -1}[mode]
    high = 0 if mode == "base" else adapters
    aid = torch.randint(low, high, (tokens,), generator=g, dtype=torch.int32)
    pi = torch.arange(experts, dtype=torch.int32).repeat(adapters, 1)
    replaced = torch.rand(adapters, experts, generator=g) < 0.3
    pi[replaced] = experts + torch.arange(int(replaced.sum()), dtype=torch.int32)
    return ids.to(dtype), aid, pi


@pytest.mark.parametrize("top_k", TOP_K)
@pytest.mark.parametrize("tokens", TOKENS)
def test_reroute_grid(tokens, top_k, monkeypatch):
    cases = itertools.product(ADAPTERS, EXPERTS, MODES, [torch.int32, torch.int64], LAYOUTS)
    for i, (adapters, experts, mode, dtype, layout) in enumerate(cases):
        ids, aid, pi = _inputs(tokens, top_k, adapters, experts, mode, dtype,
                               seed=tokens * 1000 + top_k * 100 + i)
        want = expected(ids, aid, pi)
        if mode == "base" and tokens:
            assert torch.equal(want, ids)
        ids, aid, pi = (_layout(t, layout) for t in (ids, aid, pi))
        case = f"{adapters=} {experts=} {mode} {dtype} {layout}"
        for name, got in (("C++ op", cpu_ops.esft_reroute(ids, aid, pi)),
                          ("reroute", reroute(ids, aid, pi, check_aid=False)),
                          ("torch", reroute_torch(ids, aid, pi)),
                          ("triton", reroute_triton(*(t.to(DEVICE) for t in (ids, aid, pi))))):
            assert got.dtype == dtype and torch.equal(got.cpu(), want), f"{name}: {case}"


def test_worked_example():
    """ExpertWeave's Figure 4 in small: E = 4, adapter 0 replaces expert 1 (physical 4), adapter
    1 experts 0 and 3 (physical 5, 6)."""
    pi = torch.tensor([[0, 4, 2, 3], [5, 1, 2, 6]], dtype=torch.int32)
    ids = torch.tensor([[1, 3], [1, 3], [0, 3], [3, -1], [-1, 1]], dtype=torch.int32)
    aid = torch.tensor([-1, 0, 1, 1, 0], dtype=torch.int32)
    want = [[1, 3], [4, 3], [5, 6], [6, -1], [-1, 4]]
    assert expected(ids, aid, pi).tolist() == want
    assert pi[aid.long()[:, None], ids.long()][3, 1] == 6  # what -1 would read unmasked
    for got in (reroute(ids, aid, pi), reroute_torch(ids, aid, pi),
                reroute_triton(ids.to(DEVICE), aid.to(DEVICE), pi.to(DEVICE))):
        assert got.tolist() == want


def test_reroute_takes_the_cpp_op_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_ops, "esft_reroute", lambda *args: calls.append(args) or args[0])
    ids, aid, pi = _inputs(5, 2, 2, 8, "mixed", torch.int32, 0)
    assert reroute(ids, aid, pi) is ids and len(calls) == 1


def test_failed_build_falls_back_to_torch_ops(monkeypatch, caplog):
    def unavailable():
        raise cpu_ops.KernelUnavailable("building the CPU expert kernel needs a C++ compiler")

    monkeypatch.setattr(esft_reroute, "_cpu_unavailable", None)
    monkeypatch.setattr(cpu_ops, "ops", unavailable)
    ids, aid, pi = _inputs(33, 4, 3, 32, "mixed", torch.int64, 1)
    with caplog.at_level(logging.WARNING, logger=esft_reroute.__name__):
        for _ in range(3):
            assert torch.equal(reroute(ids, aid, pi), expected(ids, aid, pi))
        with pytest.raises(ValueError, match=r"aid\[0\] = 3 is not -1"):
            reroute(ids, torch.full_like(aid, 3), pi)
    assert [r.getMessage() for r in caplog.records] == [
        "ESFT rerouting runs as torch ops in this process: building the CPU expert kernel "
        "needs a C++ compiler"]


def test_triton_reroutes_in_place():
    inputs = _inputs(130, 8, 20, 256, "mixed", torch.int32, 2)
    want = expected(*inputs)
    ids, aid, pi = (t.to(DEVICE) for t in inputs)
    out = torch.full((130, 16), 7, dtype=torch.int32, device=DEVICE)
    assert reroute_triton(ids, aid, pi, out=out[:, ::2]).data_ptr() == out.data_ptr()
    assert torch.equal(out[:, ::2].cpu(), want) and (out[:, 1::2] == 7).all()
    assert reroute_triton(ids, aid, pi, out=ids) is ids and torch.equal(ids.cpu(), want)


@pytest.mark.gpu
def test_reroute_takes_triton_on_cuda():
    ids, aid, pi = _inputs(1000, 8, 20, 256, "mixed", torch.int32, 3)
    got = reroute(ids.cuda(), aid.cuda(), pi.cuda())
    assert got.is_cuda and torch.equal(got.cpu(), expected(ids, aid, pi))


I32, I64 = torch.int32, torch.int64


def _zeros(*shape: int, dtype: torch.dtype = I32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


REFUSALS = {  # (ids, aid, pi) -> the message
    "ids 1-d": ((_zeros(4), _zeros(4), _zeros(2, 8)), "ids must be 2-d [T, K], got shape [4]"),
    "aid length": ((_zeros(4, 2), _zeros(3), _zeros(2, 8)),
                   "aid must be [T] = [4] (one adapter id per token), got shape [3]"),
    "aid 2-d": ((_zeros(4, 2), _zeros(4, 1), _zeros(2, 8)),
                "aid must be [T] = [4] (one adapter id per token), got shape [4, 1]"),
    "pi 1-d": ((_zeros(4, 2), _zeros(4), _zeros(8)), "pi must be 2-d [A, E], got shape [8]"),
    "ids float": ((_zeros(4, 2, dtype=torch.float32), _zeros(4), _zeros(2, 8)),
                  "ids must be int32 or int64, got float32"),
    "aid int64": ((_zeros(4, 2), _zeros(4, dtype=I64), _zeros(2, 8)),
                  "aid and pi must be int32, got int64 and int32"),
    "pi int64": ((_zeros(4, 2, dtype=I64), _zeros(4), _zeros(2, 8, dtype=I64)),
                 "aid and pi must be int32, got int32 and int64"),
    "aid = A": ((_zeros(4, 2), torch.tensor([0, -1, 2, 1], dtype=I32), _zeros(2, 8)),
                "aid[2] = 2 is not -1 (the base model) or an adapter index in [0, 2)"),
    "aid < -1": ((_zeros(4, 2), torch.tensor([0, -2, 2, 1], dtype=I32), _zeros(2, 8)),
                 "aid[1] = -2 is not -1 (the base model) or an adapter index in [0, 2)"),
}


@pytest.fixture(params=["reroute", "fallback", "triton", "C++ op"])
def backend(request, monkeypatch):
    """A rerouting entry point: ``reroute`` (the C++ op on CPU), ``reroute`` after a failed
    build (torch ops), ``reroute_triton``, and the C++ op itself."""
    if request.param == "fallback":
        monkeypatch.setattr(esft_reroute, "_cpu_unavailable", "no compiler")
    if request.param == "triton":
        return lambda ids, aid, pi, **kw: reroute_triton(
            *(t.to(DEVICE) for t in (ids, aid, pi)), **kw)
    if request.param == "C++ op":
        return lambda ids, aid, pi, check_aid=True: cpu_ops.esft_reroute(ids, aid, pi, check_aid)
    return reroute


@pytest.mark.parametrize("case", REFUSALS.values(), ids=REFUSALS.keys())
def test_refusals(case, backend):
    inputs, message = case
    with pytest.raises(ValueError) as info:
        backend(*inputs)
    assert str(info.value).splitlines()[0] == message  # C++ may add its stack on later lines


def test_unchecked_negative_aid_is_the_base_model(backend):
    ids, aid, pi = _inputs(9, 4, 3, 32, "mixed", torch.int32, 4)
    aid[::2] = -5
    got = backend(ids, aid, pi, check_aid=False)
    assert torch.equal(got.cpu(), expected(ids, aid.clamp(min=-1), pi))


def test_refusals_of_devices_and_out():
    ids, aid, pi = _inputs(4, 2, 2, 8, "mixed", torch.int32, 5)
    with pytest.raises(ValueError, match=r"^ids, aid and pi must be on one device, got meta, cpu "
                                         r"and cpu$"):
        reroute(ids.to("meta"), aid, pi)
    with pytest.raises(ValueError, match=r"^reroute runs on CUDA or CPU tensors, got meta$"):
        reroute(ids.to("meta"), aid.to("meta"), pi.to("meta"))
    ids, aid, pi = (t.to(DEVICE) for t in (ids, aid, pi))
    with pytest.raises(ValueError, match=r"^out must be torch.int32 \(4, 2\) on .* like ids, got "
                                         r"torch.int64 \(4, 2\) on "):
        reroute_triton(ids, aid, pi, out=ids.long())
    with pytest.raises(ValueError, match=r"^out must be .* got torch.int32 \(4, 1\) on "):
        reroute_triton(ids, aid, pi, out=ids[:, :1])


EMPTY = {  # (ids, aid, pi): nothing to reroute
    "no adapters": (torch.tensor([[3, -1], [0, 7]], dtype=I32), torch.tensor([-1, -1], dtype=I32),
                    _zeros(0, 8)),
    "no experts": (torch.full((2, 3), -1, dtype=I64), torch.tensor([0, 1], dtype=I32),
                   _zeros(2, 0)),
    "K = 0": (_zeros(3, 0), torch.tensor([0, -1, 1], dtype=I32), _zeros(2, 8)),
}


@pytest.mark.parametrize("case", EMPTY.values(), ids=EMPTY.keys())
def test_empty_map_or_top_k(case, backend):
    ids, aid, pi = case
    got = backend(ids, aid, pi)
    assert got.dtype == ids.dtype and torch.equal(got.cpu(), ids)
