"""``python -m sglang_eaas.cpu_runtime {install,uninstall,status}``.

``install`` writes ``sglang_eaas_cpu_runtime.pth`` into this interpreter's site-packages so that
every Python process of the environment (SGLang's spawned workers included) activates the CPU
runtime when it applies. ``scripts/setup.sh`` runs it on machines without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from sglang_eaas import cpu_runtime, envs

PTH_NAME = "sglang_eaas_cpu_runtime.pth"
PTH_TEXT = "import sglang_eaas.cpu_runtime.boot\n"


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_eaas.cpu_runtime",
        description="Manage the start-up hook that runs stock SGLang on a CPU-only machine.",
    )
    parser.add_argument(
        "action",
        choices=["install", "uninstall", "status"],
        help="install/uninstall the .pth start-up hook in this environment, or show the state",
    )
    args = parser.parse_args(argv)
    path = pth_path()
    if args.action == "install":
        path.write_text(PTH_TEXT)
        print(f"installed {path}")
    elif args.action == "uninstall":
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    else:
        print(f"start-up hook: {path if path.exists() else 'not installed'}")
        print(f"{envs.CPU_RUNTIME.name}={envs.CPU_RUNTIME.get()}")
        print(f"CUDA device: {cpu_runtime.has_cuda_device()}")
        print(f"real sgl_kernel: {cpu_runtime.has_real_sgl_kernel()}")
        print(f"active in this process: {cpu_runtime.is_active()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
