"""bench_guard's bound (no server started): the folder ``--no-expert-compute`` puts on
PYTHONPATH makes an expert server's kernel return zeros, and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
NO_COMPUTE = ROOT / "scripts" / "bench_lib" / "no_expert_compute"
PROBE = "from sgl_kernel_ext import cpu_ops; print(cpu_ops.expert_sum.__name__)"


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(NO_COMPUTE), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                          timeout=120)


def test_only_an_expert_server_process_computes_nothing():
    """A process that is not an expert server keeps the kernel; the expert server's own
    process says it computes nothing."""
    other = run("-c", PROBE)
    assert other.returncode == 0, other.stderr
    assert other.stdout.split()[-1] == "expert_sum" and "computes nothing" not in other.stderr
    server = run("-m", "sglang_eaas.expert_server", "--help")
    assert server.returncode == 0, server.stderr
    assert "this expert server computes nothing" in server.stderr


def test_the_patched_kernel_returns_zeros_of_the_input_shape():
    sys.modules.pop("sitecustomize", None)
    from sgl_kernel_ext import cpu_ops

    kept = cpu_ops.expert_sum
    orig = list(sys.orig_argv)
    try:
        sys.orig_argv[:] = [sys.executable, "-m", "sglang_eaas.expert_server"]
        sys.path.insert(0, str(NO_COMPUTE))
        import sitecustomize  # noqa: F401 - patches cpu_ops.expert_sum

        out = cpu_ops.expert_sum(torch.ones(5, 16), None, None, None, None, True)
        assert out.shape == (5, 16) and not out.any()
    finally:
        cpu_ops.expert_sum = kept
        sys.orig_argv[:] = orig
        sys.path.remove(str(NO_COMPUTE))
        sys.modules.pop("sitecustomize", None)
