"""CPU runtime: what stock SGLang 0.5.23 needs to serve on a machine without a CUDA GPU.

It is *active* only when the machine has no CUDA device and no real ``sgl_kernel`` is installed
(or ``SGLANG_EAAS_CPU_RUNTIME=on``). Activation happens at interpreter start-up through a ``.pth``
file (``python -m sglang_eaas.cpu_runtime install``), because SGLang's spawned scheduler processes
import ``sgl_kernel`` while unpickling their arguments, before any plugin is loaded. Activation:

* appends ``shims/`` to ``sys.path``: a pure-torch ``sgl_kernel`` stand-in and a ``torchvision``
  stub; a real package of either name earlier on ``sys.path`` still wins;
* sets ``SGLANG_USE_CPU_ENGINE=1`` (unless the user set it), so SGLang picks its CPU platform.

The server-argument defaults and the EP>1 MoE fix are plugin hooks (``server_defaults``,
``moe_native_ep``); they check ``is_active()``. This module must stay import-light: no torch.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path

from sglang_eaas import envs

SHIMS_DIR = Path(__file__).resolve().parent / "shims"


def has_cuda_device() -> bool:
    """True when an NVIDIA driver exposes a device node (cheap: no torch, no CUDA init)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def has_real_sgl_kernel() -> bool:
    """True when an ``sgl_kernel`` other than our stand-in is importable."""
    spec = importlib.util.find_spec("sgl_kernel")
    return spec is not None and SHIMS_DIR not in Path(spec.origin or "").resolve().parents


def should_activate() -> bool:
    """Decide from ``SGLANG_EAAS_CPU_RUNTIME`` and the machine (see module docstring)."""
    mode = envs.CPU_RUNTIME.get().strip().lower()
    if mode == "on":
        return True
    if mode == "off":
        return False
    if mode != "auto":
        sys.stderr.write(
            f"sglang-eaas: {envs.CPU_RUNTIME.name}={mode!r} is not one of auto|on|off; using auto\n"
        )
    return not has_cuda_device() and not has_real_sgl_kernel()


def is_active() -> bool:
    """Whether ``activate()`` enabled the runtime in this process (or an ancestor's env)."""
    return str(SHIMS_DIR) in sys.path


def activate() -> bool:
    """Enable the CPU runtime in this process if it applies; idempotent. Returns ``is_active()``."""
    if not is_active() and should_activate():
        sys.path.append(str(SHIMS_DIR))
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    return is_active()
