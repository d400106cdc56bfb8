"""Imported by Python at start where this folder is on ``PYTHONPATH`` (``bench_guard.py
--no-expert-compute``): in an expert server's process only (``python -m
sglang_eaas.expert_server``), the grouped expert kernel returns zeros without computing. A run then
costs everything the ``--eaas`` path costs except the experts' arithmetic: its speed is a bound no
expert kernel can beat. Its outputs are wrong; only its timings mean anything."""

import sys

if "sglang_eaas.expert_server" in getattr(sys, "orig_argv", ()):
    import torch
    from sgl_kernel_ext import cpu_ops

    def _computing_nothing(hidden, *args, **kwargs):
        return torch.zeros_like(hidden)

    cpu_ops.expert_sum = _computing_nothing
    print("bench_lib/no_expert_compute: this expert server computes nothing (a bound)",
          file=sys.stderr, flush=True)
