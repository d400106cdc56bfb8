"""sgl-kernel-ext: the expert server's kernels (the paper's §4.1).

Each kernel comes three ways, compared by the tests: a plain PyTorch reference (independent,
written for clarity), a Triton kernel (for GPUs; run here under ``TRITON_INTERPRET=1``), and the
CPU implementation the expert server really runs on machines without a GPU.

* ``group_shrink``: per-expert token counts -> the active experts' (id, offset, count) packed
  to the front, so a grouped GEMM walks only active groups and stops early.
* ``static_grid``: the paper's Algorithm 1, a fixed grid of programs iterating the (batch,
  token) pairs of batches of different lengths (stride = the grid size).
* ``grouped_gemm``: gate/up GEMM, SiLU * up, down GEMM over the packed groups.
"""
