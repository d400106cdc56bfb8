"""The ibgda backends every transport-level test runs over, and how to get each on a CPU."""

from __future__ import annotations

import pytest
import torch

import ibgda

BACKENDS = list(ibgda.BACKENDS)  # shm, mooncake, device: all must work on this machine


def backend_transport(name: str, monkeypatch: pytest.MonkeyPatch) -> ibgda.Transport:
    """The backend ``name``; without a GPU ``device`` runs its kernels under the Triton
    interpreter (with one, its native kernels on device memory: scripts/gpu_check.sh).

    ``TRITON_INTERPRET`` is set for this test only, so servers that later tests start do not
    inherit it (the kernels stay interpreted once imported).
    """
    if name == "device" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return ibgda.create_transport(name)
