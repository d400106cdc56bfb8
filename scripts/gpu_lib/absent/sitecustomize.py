"""Start-up hook of every Python process scripts/gpu_check.sh runs (this folder is first on its
PYTHONPATH): the packages the lent GPU machine does not have are absent here too, even where this
machine has them, so a check that passes here proves that nothing the GPU run imports needs them
(SGLang above all: that machine has none).

Absent as Python knows it: ``sys.modules[name] = None`` makes ``import name`` (and of any
submodule) raise ``ModuleNotFoundError`` and ``importlib.util.find_spec(name)`` return None, as
for a package that is not installed.

``GPU_CHECK_ABSENT``: comma-separated top-level package names to hide (default ``ABSENT``); an
empty value hides nothing. Another ``sitecustomize`` further down ``sys.path`` still runs.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# Imported somewhere in this repository, installed here, and missing from the lent GPU machine's
# image (/work/.library/device/KINDS.md lists what it has).
ABSENT = ("sglang", "sgl_kernel", "sglang_router", "mooncake", "etcd3gw", "fastapi", "uvicorn",
          "zmq", "kubernetes_validate")


def _names() -> tuple[str, ...]:
    text = os.environ.get("GPU_CHECK_ABSENT")
    names = ABSENT if text is None else text.split(",")
    return tuple(n.strip() for n in names if n.strip())


def _run_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        candidate = os.path.join(folder, "sitecustomize.py")
        if folder != here and os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


# What is hidden (gpu_lib.imports names it in its failures); a package some start-up hook
# imported already cannot be hidden, and is left out.
HIDDEN = tuple(name for name in _names() if name not in sys.modules)
for _name in HIDDEN:
    sys.modules[_name] = None
_run_the_next_sitecustomize()
