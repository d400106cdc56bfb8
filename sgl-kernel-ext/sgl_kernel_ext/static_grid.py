"""A static grid over batches of different lengths: the paper's Algorithm 1 (§4.1).

An expert server gathers the tokens of several clients' batches, each of its own length (some
empty). Rather than sizing the grid to the batch (a new launch shape every step, which a CUDA
graph cannot replay), a fixed grid of ``grid`` programs walks the concatenated (batch, token)
pairs: program ``p`` takes global tokens ``p, p + grid, p + 2 * grid, ...``. It keeps a token id
relative to the current batch; when the id runs past the batch it carries into the next one:

    token = p
    for batch in range(num_batches):
        while token < num_tokens[batch]:
            visit(batch, token)
            token += grid            # the paper says blockDim.x: wrong unless it equals grid
        token -= num_tokens[batch]

Stepping by anything but the number of programs misses tokens (a larger step) or visits some
twice (a smaller one); ``test/test_kernel_ext.py`` shows both.

``varlen_rows`` / ``gather_varlen`` are the CPU implementations the expert server runs;
``*_reference`` are plain loops; ``*_triton`` the Triton kernels (``static_grid_kernels``).
"""

from __future__ import annotations

import torch


def batch_starts(num_tokens: torch.Tensor) -> torch.Tensor:
    """``num_tokens int [B]`` -> ``int64 [B]``: where each batch starts in the packed order."""
    n = num_tokens.to(torch.int64)
    return torch.cumsum(n, 0) - n


def varlen_rows(num_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_tokens int [B]`` (>= 0) -> ``(batch int64 [total], token int64 [total])``: every
    (batch, token) pair once, in packed order (batch by batch, tokens ascending)."""
    n = num_tokens.to(torch.int64)
    batch = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n)
    token = torch.arange(batch.numel(), device=n.device) - batch_starts(n)[batch]
    return batch, token


def visit_reference(num_tokens: torch.Tensor, grid: int) -> torch.Tensor:
    """Algorithm 1 (corrected) as a Python loop: ``num_tokens int [B]`` (>= 0), ``grid`` programs
    -> ``int32 [total, 3]``: row ``starts[batch] + token`` holds (program, batch, token) of the
    visit of that pair; a pair never visited keeps (-1, -1, -1)."""
    counts = num_tokens.tolist()
    starts = batch_starts(num_tokens).tolist()
    rows = [(-1, -1, -1)] * sum(counts)
    for program in range(grid):
        token = program
        for batch, n in enumerate(counts):
            while token < n:
                assert rows[starts[batch] + token][0] == -1, f"({batch}, {token}) visited twice"
                rows[starts[batch] + token] = (program, batch, token)
                token += grid
            token -= n
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(num_tokens.device)


def visit_triton(num_tokens: torch.Tensor, grid: int) -> torch.Tensor:
    """The Triton kernel of ``visit_reference`` (same arguments and result), with a static grid
    of ``grid`` programs; ``num_tokens`` on the kernel's device."""
    from .static_grid_kernels import launch_visit

    num_tokens = num_tokens.to(torch.int32).contiguous()
    starts = batch_starts(num_tokens).to(torch.int32)
    total = int(num_tokens.sum().item()) if num_tokens.numel() else 0
    out = torch.full((total, 3), -1, dtype=torch.int32, device=num_tokens.device)
    launch_visit(num_tokens, starts, out, grid)
    return out


def gather_varlen(src: torch.Tensor, starts: torch.Tensor,
                  num_tokens: torch.Tensor) -> torch.Tensor:
    """Pack the rows of B batches into one tensor (the CPU implementation the server runs).

    ``src [S, H]`` (any dtype), ``starts int [B]``, ``num_tokens int [B]`` (>= 0): batch ``b``'s
    rows are ``src[starts[b] : starts[b] + num_tokens[b]]`` (ranges may have gaps between them).
    Returns ``[total, H]`` in ``src``'s dtype, batch after batch.
    """
    batch, token = varlen_rows(num_tokens)
    return src.index_select(0, starts.to(torch.int64)[batch] + token)


def gather_varlen_reference(src: torch.Tensor, starts: torch.Tensor,
                            num_tokens: torch.Tensor) -> torch.Tensor:
    """``gather_varlen`` as a loop of slices (same arguments and result)."""
    parts = [src[s:s + n] for s, n in zip(starts.tolist(), num_tokens.tolist())]
    return torch.cat(parts) if parts else src.new_empty((0,) + tuple(src.shape[1:]))


def gather_varlen_triton(src: torch.Tensor, starts: torch.Tensor, num_tokens: torch.Tensor,
                         grid: int) -> torch.Tensor:
    """``gather_varlen`` as a Triton kernel over a static grid of ``grid`` programs, each
    copying the rows Algorithm 1 gives it (same arguments and result; tensors on the kernel's
    device; a ``src`` whose rows are not contiguous is copied first)."""
    from .static_grid_kernels import launch_gather

    assert src.dim() == 2, f"src must be [S, H], got {tuple(src.shape)}"
    if src.shape[1] > 1 and src.stride(1) != 1:
        src = src.contiguous()
    num_tokens = num_tokens.to(torch.int32).contiguous()
    total = int(num_tokens.sum().item()) if num_tokens.numel() else 0
    out = src.new_empty((total, src.shape[1]))
    launch_gather(src, starts.to(torch.int32).contiguous(), num_tokens,
                  batch_starts(num_tokens).to(torch.int32), out, grid)
    return out
