"""Build ``ibgda._device_cuda``, the device backend's native side, with nvcc.

    python -m ibgda.build_native [--arch sm_90 ...] [--nvshmem auto|on|off] [--out DIR]

Sources are ``ibgda/csrc/device``: the CUDA IPC regions and put_signal / wait_flag / read
kernels, plus (with NVSHMEM) the same three kernels across nodes over NVSHMEM/IBGDA. Needs nvcc
(``CUDA_HOME`` or ``PATH``), pybind11 and, for NVSHMEM, the ``nvidia-nvshmem-cu13`` wheel's
headers and libraries (``requirements/ibgda-cuda-build.txt``). No GPU is needed to build.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCES = Path(__file__).with_name("csrc") / "device"
CUDA_SOURCES = ["peer_memory.cu", "peer_kernels.cu"]
NVSHMEM_SOURCES = ["nvshmem_kernels.cu"]
BINDINGS = "bindings.cpp"
MODULE = "_device_cuda"
DEFAULT_ARCHS = ["sm_90"]  # Hopper, the class of GPU DeepSeek-V3 is served on


class BuildError(RuntimeError):
    """A missing tool or a failed compiler step, with what to do about it."""


def find_nvcc() -> str:
    home = os.environ.get("CUDA_HOME")
    nvcc = str(Path(home) / "bin" / "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not Path(nvcc).exists():
        raise BuildError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    return nvcc


def find_nvshmem() -> Path | None:
    """The NVSHMEM install (``NVSHMEM_HOME`` or the nvidia-nvshmem-cu13 wheel), if any."""
    if home := os.environ.get("NVSHMEM_HOME"):
        return Path(home)
    if importlib.util.find_spec("nvidia") is None:
        return None
    for root in importlib.util.find_spec("nvidia").submodule_search_locations or []:
        if (Path(root) / "nvshmem" / "include" / "nvshmem.h").exists():
            return Path(root) / "nvshmem"
    return None


def pybind11_include() -> str:
    try:
        import pybind11
    except ImportError as exc:
        raise BuildError("pybind11 is missing: pip install -r "
                         "requirements/ibgda-cuda-build.txt") from exc
    return pybind11.get_include()


def gencode(archs: list[str]) -> list[str]:
    flags = []
    for arch in archs:
        number = arch.removeprefix("sm_")
        if not number.isdigit():
            raise BuildError(f"--arch {arch!r} is not of the form sm_NN")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
    return flags


def build(out_dir: Path, archs: list[str], nvshmem: str = "auto", verbose: bool = False) -> Path:
    """Compile and link the module into ``out_dir``; returns its path."""
    nvcc = find_nvcc()
    nvshmem_home = find_nvshmem() if nvshmem != "off" else None
    if nvshmem == "on" and nvshmem_home is None:
        raise BuildError("--nvshmem on: NVSHMEM not found (pip install -r "
                         "requirements/ibgda-cuda-build.txt, or set NVSHMEM_HOME)")
    common = [nvcc, "-std=c++17", "-O3", "-Xcompiler", "-fPIC,-fvisibility=hidden",
              *gencode(archs), "-I", str(SOURCES)]
    sources = CUDA_SOURCES + [BINDINGS]
    link: list[str] = []
    if nvshmem_home is not None:
        lib = nvshmem_home / "lib"
        common += ["-rdc=true", "-DIBGDA_WITH_NVSHMEM", "-I", str(nvshmem_home / "include")]
        sources = CUDA_SOURCES + NVSHMEM_SOURCES + [BINDINGS]
        link = ["-L", str(lib), "-lnvshmem_device", f"-l:{host_library(lib).name}",
                f"-Xlinker=-rpath,{lib}"]
    includes = ["-I", pybind11_include(), "-I", sysconfig.get_paths()["include"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / (MODULE + sysconfig.get_config_var("EXT_SUFFIX"))
    steps = len(sources) + 1
    with tempfile.TemporaryDirectory(prefix="ibgda-build-") as objects_dir:
        objects = [str(Path(objects_dir) / (Path(source).stem + ".o")) for source in sources]
        for i, (source, obj) in enumerate(zip(sources, objects), 1):
            _run(f"[{i}/{steps}] nvcc {source}",
                 [*common, *includes, "-c", str(SOURCES / source), "-o", obj], verbose)
        _run(f"[{steps}/{steps}] link {target.name}",
             [*common, "-shared", "-cudart", "static", *objects, *link, "-o", str(target)],
             verbose)
    return target


def host_library(lib: Path) -> Path:
    found = sorted(lib.glob("libnvshmem_host.so*"))
    if not found:
        raise BuildError(f"libnvshmem_host.so not found in {lib}")
    return found[0]


def emit_ptx(source: str, arch: str, out: Path, nvshmem_home: Path | None = None) -> Path:
    """The PTX nvcc makes of one source, to check which instructions the kernels use."""
    cmd = [find_nvcc(), "-std=c++17", "-O3", f"-arch=compute_{arch.removeprefix('sm_')}",
           "-I", str(SOURCES), "-ptx", str(SOURCES / source), "-o", str(out)]
    if nvshmem_home is not None:
        cmd[1:1] = ["-rdc=true", "-I", str(nvshmem_home / "include")]
    _run(f"nvcc -ptx {source}", cmd, verbose=False)
    return out


def _run(step: str, cmd: list[str], verbose: bool) -> None:
    print(f"build_native: {step}", file=sys.stderr, flush=True)
    if verbose:
        print(" ".join(cmd), file=sys.stderr, flush=True)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"{step} failed (exit {result.returncode}):\n{result.stderr.strip()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibgda.build_native",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=DEFAULT_ARCHS,
                        help="GPU architectures to compile for, e.g. sm_80 sm_90 (default: "
                             "%(default)s)")
    parser.add_argument("--nvshmem", choices=["auto", "on", "off"], default="auto",
                        help="build the cross-node NVSHMEM/IBGDA kernels: auto = if NVSHMEM "
                             "is installed (default), on = fail without it, off = never")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent,
                        help="where the module goes (default: the ibgda package, so "
                             "'import ibgda._device_cuda' finds it)")
    parser.add_argument("--verbose", action="store_true", help="print every compiler command")
    args = parser.parse_args(argv)
    try:
        target = build(args.out, args.arch, args.nvshmem, args.verbose)
    except BuildError as exc:
        print(f"build_native: error: {exc}", file=sys.stderr)
        return 1
    print(f"build_native: built {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
