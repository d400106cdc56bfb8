"""Dealing replicated experts' entries by load on the device: the Triton kernel of step 2 of
``sglang_eaas.dealing``'s rule (the client's device path, ``routing_table.DeviceRoutingTable``,
does steps 1 and 3 and the order of step 2 in torch ops around it), imported on first use
(Triton decides at import whether it runs interpreted; the CPU twin sets ``TRITON_INTERPRET``
only when it is used).

Step 2 is sequential (each entry goes where the entries dealt before it left the least load), so
it is one program: the servers' loads stay in registers, and each dealt entry is a few loads of
its expert's row and one store of where it went (written once, never read back here, so no
barrier is needed between the loop's iterations). Every bound is read on the device, so a CUDA
graph can hold it. On this project's machines it runs under ``TRITON_INTERPRET=1`` only: its cost
on a GPU (serial: a few dependent loads per dealt entry, so about a microsecond per entry of a
replicated expert if they miss the caches) has not been measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEVER = 1 << 62  # a key no holder column has: columns past an expert's replicas


# Only core ``tl`` builtins and jit functions of this module: ``tl.sum``, ``tl.argmin`` and
# friends are jit functions of triton.language, fixed at its import as compiled or interpreted,
# so under TRITON_INTERPRET=1 set after Triton was first imported (the tests, in a process that
# imported SGLang) they would refuse to run (as in group_shrink_kernel).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _least(a, b):
    return tl.minimum(a, b)


@triton.jit
def deal_kernel(order_ptr, dealing_ptr, first_ptr, replicas_ptr, holders_ptr, holders_s0,
                holders_s1, load_ptr, offset_ptr, dealt_ptr, rounds_ptr, num_servers,
                BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, NEVER: tl.constexpr):
    """Step 2: in round ``q < rounds`` the first ``dealing[q]`` experts of ``order`` each deal
    their ``q``-th entry; ``dealt[first[e] + q]`` is the server it went to. ``load [S]``: step
    1's counts."""
    servers = tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_W)
    load = tl.load(load_ptr + servers, mask=servers < num_servers, other=0)
    offset = tl.load(offset_ptr)
    for q in range(0, tl.load(rounds_ptr)):
        for i in range(0, tl.load(dealing_ptr + q)):
            e = tl.load(order_ptr + i)
            r = tl.load(replicas_ptr + e)
            in_row = cols < r
            row = tl.load(holders_ptr + e * holders_s0 + cols * holders_s1, mask=in_row,
                          other=-1)
            position = (cols + r - (offset + e) % r) % r  # place in the tie-break order
            held = tl.reduce(tl.where(row[:, None] == servers[None, :], load[None, :], 0), 1,
                             _add)
            key = tl.where(in_row, held * BLOCK_W + position, NEVER)  # unique per column
            best = tl.reduce(tl.where(key == tl.reduce(key, 0, _least), cols, BLOCK_W), 0,
                             _least)
            server = tl.reduce(tl.where(cols == best, row, 0), 0, _add)
            tl.store(dealt_ptr + tl.load(first_ptr + e) + q, server)
            load = tl.where(servers == server, load + 1, load)


def launch_deal(order: torch.Tensor, dealing: torch.Tensor, rounds: torch.Tensor,
                first: torch.Tensor, replicas: torch.Tensor, holders: torch.Tensor,
                load: torch.Tensor, offset: torch.Tensor, dealt: torch.Tensor) -> None:
    """int64 tensors on one device (checked by the caller): ``order [E]`` the experts in
    dealing order, ``dealing [Q]`` how many of them deal in each round, ``rounds [1]`` the
    rounds (the most entries an expert has, at most ``Q``), ``first [E]`` where an expert's
    dealt entries start in ``dealt``, ``replicas [E]``, ``holders [E, W]`` (any strides),
    ``load [S]``, ``offset [1]``; ``dealt [N]`` is written at the dealt entries' places
    only."""
    deal_kernel[(1,)](order, dealing, first, replicas, holders, holders.stride(0),
                      holders.stride(1), load, offset, dealt, rounds, load.shape[0],
                      BLOCK_S=triton.next_power_of_2(max(1, load.shape[0])),
                      BLOCK_W=triton.next_power_of_2(max(1, holders.shape[1])), NEVER=_NEVER,
                      num_warps=1)
