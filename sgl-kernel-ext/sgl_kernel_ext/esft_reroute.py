"""ESFT batched rerouting (ExpertWeave §4.3): each token's top-k expert ids, rewritten by its
request's adapter before dispatch.

An ESFT adapter replaces some routed experts of a MoE layer. The layer's map ``pi int32 [A, E]``
gives adapter ``a``'s version of expert ``e`` as a physical expert id: ``e`` itself where the
adapter keeps the base expert, else where its fine-tuned copy lives (physical ids may be >= E:
they index a larger id space holding base and adapter experts). With ``aid int32 [T]`` each
token's adapter (-1: a base-model token) and ``ids [T, K]`` the router's top-k (int32 as SGLang's
``topk_ids``, or int64; -1: an entry masked out, e.g. by expert parallelism)::

    out[t, k] = pi[aid[t], ids[t, k]]   if aid[t] >= 0 and ids[t, k] >= 0
    out[t, k] = ids[t, k]               otherwise: a base token's ids, and -1, are kept

Router weights are untouched. ``reroute`` picks the implementation by device: the Triton kernel
on CUDA tensors (``reroute_triton``, one launch, ``esft_reroute_kernel``), the C++ op on CPU
tensors (``cpu_ops.esft_reroute``, what the client runs on a machine without a GPU) or, when
that library cannot be built, ``reroute_torch`` (vectorised torch ops). On this project's
machines the Triton kernel runs under ``TRITON_INTERPRET=1`` only: that it is one launch with
coalesced loads, and its speed, only a GPU would show.

Every entry point checks shapes, dtypes and devices (``ValueError``, one sentence). With
``check_aid`` (the default) it also refuses an ``aid`` value that is not -1 or in ``[0, A)``:
one pass over ``aid``, and on CUDA a sync with the host, so the hot path passes
``check_aid=False``. An ``ids`` value >= E is never checked (that would be a pass over T * K
entries): keeping ids below E is the caller's contract, and the kernels read past ``pi``'s row
otherwise. A negative id other than -1 is kept as -1 is; without ``check_aid`` a negative
``aid`` is a base-model token.
"""

from __future__ import annotations

import logging

import torch

from . import cpu_ops

logger = logging.getLogger(__name__)

IDS_DTYPES = (torch.int32, torch.int64)

# Why the C++ op cannot be used in this process (its build failed), else None: the build is
# tried once, then every CPU call takes reroute_torch.
_cpu_unavailable: str | None = None


def check_inputs(ids: torch.Tensor, aid: torch.Tensor, pi: torch.Tensor) -> None:
    """Shapes, dtypes and devices (O(1)); raises ``ValueError`` in one sentence (the C++ op's
    words)."""
    if ids.dim() != 2:
        raise ValueError(f"ids must be 2-d [T, K], got shape {list(ids.shape)}")
    if aid.dim() != 1 or aid.shape[0] != ids.shape[0]:
        raise ValueError(f"aid must be [T] = [{ids.shape[0]}] (one adapter id per token), got "
                         f"shape {list(aid.shape)}")
    if pi.dim() != 2:
        raise ValueError(f"pi must be 2-d [A, E], got shape {list(pi.shape)}")
    if ids.dtype not in IDS_DTYPES:
        raise ValueError(f"ids must be int32 or int64, got {_name(ids.dtype)}")
    if aid.dtype != torch.int32 or pi.dtype != torch.int32:
        raise ValueError(f"aid and pi must be int32, got {_name(aid.dtype)} and {_name(pi.dtype)}")
    if not ids.device == aid.device == pi.device:
        raise ValueError(f"ids, aid and pi must be on one device, got {ids.device}, "
                         f"{aid.device} and {pi.device}")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_aid_range(aid: torch.Tensor, adapters: int) -> None:
    """Refuse an ``aid`` value that is not -1 or in ``[0, adapters)`` (``ValueError`` naming the
    first one). O(T); on CUDA one sync with the host."""
    bad = (aid < -1) | (aid >= adapters)
    if aid.numel() and bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(f"aid[{t}] = {int(aid[t])} is not -1 (the base model) or an adapter "
                         f"index in [0, {adapters})")


def reroute(ids: torch.Tensor, aid: torch.Tensor, pi: torch.Tensor, *,
            check_aid: bool = True) -> torch.Tensor:
    """``out [T, K]`` in ``ids``' dtype, a new tensor (see the module docstring): the Triton
    kernel on CUDA tensors, the C++ op on CPU tensors (``reroute_torch`` if it cannot be built:
    logged once). ``ids [T, K]`` int32/int64, ``aid int32 [T]``, ``pi int32 [A, E]``, on one
    device, any strides."""
    check_inputs(ids, aid, pi)
    if ids.is_cuda:
        return reroute_triton(ids, aid, pi, check_aid=check_aid)
    if ids.device.type != "cpu":
        raise ValueError(f"reroute runs on CUDA or CPU tensors, got {ids.device}")
    return _reroute_cpu(ids, aid, pi, check_aid)


def _reroute_cpu(ids: torch.Tensor, aid: torch.Tensor, pi: torch.Tensor,
                 check_aid: bool) -> torch.Tensor:
    global _cpu_unavailable
    if _cpu_unavailable is None:
        try:
            return cpu_ops.esft_reroute(ids, aid, pi, check_aid)
        except cpu_ops.KernelUnavailable as exc:  # as cpu_ops raises it: one sentence
            _cpu_unavailable = str(exc)
            logger.warning("ESFT rerouting runs as torch ops in this process: %s", exc)
    if check_aid:
        check_aid_range(aid, pi.shape[0])
    return reroute_torch(ids, aid, pi)


def reroute_torch(ids: torch.Tensor, aid: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """The vectorised torch implementation (the CPU fallback; same result as ``reroute``, any
    device): the adapter ids broadcast over k, one gather from ``pi`` (kept entries read row 0
    or column 0), a ``where``. Inputs are not checked (``check_inputs``, ``check_aid_range``)."""
    if pi.numel() == 0:  # no adapter or no expert: every entry must be kept
        return ids.clone()
    adapter, expert = aid.to(torch.int64)[:, None], ids.to(torch.int64)
    physical = pi[adapter.clamp(min=0), expert.clamp(min=0)]
    return torch.where((adapter < 0) | (expert < 0), ids, physical.to(ids.dtype))


def reroute_triton(ids: torch.Tensor, aid: torch.Tensor, pi: torch.Tensor,
                   out: torch.Tensor | None = None, *, check_aid: bool = True) -> torch.Tensor:
    """The Triton kernel (one launch; see ``esft_reroute_kernel``): same arguments and result as
    ``reroute``, on the kernel's device (CUDA, or CPU under ``TRITON_INTERPRET=1``). ``out``:
    ``[T, K]`` in ``ids``' dtype on its device, any strides, written and returned (``ids``
    itself reroutes in place); by default a new contiguous tensor."""
    from .esft_reroute_kernel import launch_reroute

    check_inputs(ids, aid, pi)
    if out is None:
        out = torch.empty(ids.shape, dtype=ids.dtype, device=ids.device)
    elif out.shape != ids.shape or out.dtype != ids.dtype or out.device != ids.device:
        raise ValueError(f"out must be {ids.dtype} {tuple(ids.shape)} on {ids.device} like ids, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if check_aid:
        check_aid_range(aid, pi.shape[0])
    launch_reroute(ids, aid, pi, out)
    return out
