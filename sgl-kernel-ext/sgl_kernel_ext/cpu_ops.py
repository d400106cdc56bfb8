"""The CPU grouped expert kernel (``csrc/cpu/grouped_expert.cpp``), built on first use:
``grouped_expert`` (rows sorted by expert, in groups) and ``expert_sum`` (one MoE layer's
weighted expert sum from the routing, what the expert server calls); and, in the same library
(``csrc/cpu/esft_reroute.cpp``), ``esft_reroute`` (ESFT adapters' batched rerouting of the
top-k expert ids, what the client runs before dispatch; ``esft_reroute.reroute`` wraps it) and
(``csrc/cpu/deal_entries.cpp``) ``deal_entries`` (one exchange's entries dealt to expert servers
by load, what the client's ``placement.ExpertRouting.assign`` runs).

Built with torch's extension tooling (``torch.utils.cpp_extension.load``: ninja and the C++
compiler) into a folder named after a digest of the source, torch and Python versions and flags,
so a change rebuilds and an unchanged source loads at once. ``scripts/setup.sh`` builds it once
at the end of setup, so an expert server's first start does not pay the compilation. The folder
is ``$SGLANG_EAAS_KERNEL_CACHE``, else ``share/sglang-eaas/torch_extensions`` in the virtual
environment, else ``~/.cache/sglang-eaas/torch_extensions``.

Several processes may load it at once (expert servers starting together): the first one builds
under an exclusive ``flock`` on the folder, which the kernel releases if that process dies, and
the others wait for it, then load the finished library.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from sglang_eaas import envs

logger = logging.getLogger(__name__)

NAME = "sgl_kernel_ext_cpu"
CSRC = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
SOURCES = (CSRC / "grouped_expert.cpp", CSRC / "esft_reroute.cpp", CSRC / "deal_entries.cpp")
# -fopenmp: at::parallel_for is inline and runs serially in code compiled without it. The
# library then needs libgomp.so.1, which is torch's own (loaded with torch, under that name).
# -ffp-contract=off: expert_sum's weighted sum multiplies, then adds (as torch's mul and sum
# do), never a fused multiply-add the compiler would make of the two.
# No -std: torch's extension tooling passes the standard its headers need (C++20 since 2.13;
# a later -std=c++17 here would override it, and torch 2.14's headers refuse C++17).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_loaded = False


class KernelUnavailable(RuntimeError):
    """The CPU kernel cannot be built or loaded here (the message says why, in one sentence)."""


def build_directory() -> Path:
    """Where this source's build lives (see the module docstring)."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(f"{torch.__version__} {sys.version} {CFLAGS} {LDFLAGS}".encode())
    configured = envs.KERNEL_CACHE.get()
    if configured:
        base = Path(configured)
    elif sys.prefix != sys.base_prefix:  # a virtual environment: the build lives with it
        base = Path(sys.prefix) / "share" / "sglang-eaas" / "torch_extensions"
    else:
        base = Path.home() / ".cache" / "sglang-eaas" / "torch_extensions"
    return base / f"{NAME}-{digest.hexdigest()[:16]}"


def ops():
    """``torch.ops.sgl_kernel_ext_cpu``, building and loading the library on first use.

    Raises ``KernelUnavailable`` when it cannot be built (no compiler, no ninja, a build error).
    """
    build()
    return torch.ops.sgl_kernel_ext_cpu


def build() -> bool:
    """Build (if needed) and load the library, once per process; returns whether this call
    compiled it."""
    global _loaded
    with _lock:
        if _loaded:
            return False
        built = _load()
        _loaded = True
        return built


def _load() -> bool:
    """Build if needed, then load; returns whether this call built it."""
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelUnavailable(f"cannot create the CPU kernel's build folder {directory} "
                                f"({exc.strerror}); set {envs.KERNEL_CACHE.name} to a writable "
                                "folder") from None
    library, done = directory / f"{NAME}.so", directory / "built"
    with open(directory / "flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if done.exists() and library.exists():
            torch.ops.load_library(str(library))
            return False
        _compile(directory)
        done.write_text(f"{NAME} {torch.__version__}\n")
        return True


def _compile(directory: Path) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"building the CPU expert kernel needs a C++ compiler "
                                f"({compiler!r} is not on PATH): install g++ (Debian: apt-get "
                                "install -y g++) or run the expert server with --kernel reference")
    if shutil.which("ninja") is None:
        try:
            import ninja  # the PyPI package: its binary sits beside the venv's python
        except ImportError:
            raise KernelUnavailable("building the CPU expert kernel needs ninja: pip install "
                                    "ninja (scripts/setup.sh does) or run the expert server "
                                    "with --kernel reference") from None
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    # torch's own build lock: we hold the flock, so a leftover one is from a killed build.
    (directory / "lock").unlink(missing_ok=True)
    try:
        cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           build_directory=str(directory),
                           is_python_module=False, verbose=False)
    except Exception as exc:  # torch's error carries the compiler's whole output
        logger.error("building the CPU expert kernel failed:\n%s", exc)
        raise KernelUnavailable(f"building the CPU expert kernel in {directory} failed (the "
                                "compiler's output is logged above); run the expert server with "
                                "--kernel reference meanwhile") from None


def isas() -> list[str]:
    """The kernel's paths this CPU can run, best first: ``avx512bf16`` (bfloat16 products,
    for bfloat16 weights and x), ``avx512``, ``avx2`` (AVX2 + FMA + F16C), ``scalar``."""
    return list(ops().cpu_isas())


def isa() -> str:
    """The best path on this CPU (what ``isa="auto"`` takes for bfloat16 weights and x)."""
    return isas()[0]


def grouped_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, expert: torch.Tensor,
                   offset: torch.Tensor, count: torch.Tensor, groups: int,
                   isa: str = "auto") -> torch.Tensor:
    """``out [N, H] float32``: for each group ``g < groups`` and row ``r`` of
    ``x[offset[g] : offset[g] + count[g]]``, ``w2[e] @ (silu(w13[e][:I] @ x[r]) * (w13[e][I:] @
    x[r]))`` with ``e = expert[g]`` (a group with count 0 is walked and skipped; rows in no
    group are undefined). ``w13 [E, 2I, H]``, ``w2 [E, H, I]``: float32, bfloat16 or float16,
    contiguous; sums in float32. ``isa``: ``auto`` (the best path for the dtypes) or one of
    ``isas()``. ``x`` any float dtype, read as float32, except on ``avx512bf16``, which rounds x
    and the SiLU * up intermediate to bfloat16 (as SGLang's bfloat16 MoE does) and is what
    ``auto`` takes for bfloat16 weights and x. Threads: ``torch.get_num_threads()``."""
    return ops().grouped_expert(x, w13, w2, expert, offset, count, groups, isa)


def expert_sum(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               flat_local: torch.Tensor, router_weights: torch.Tensor, shrink: bool = True,
               isa: str = "auto", expert_load: torch.Tensor | None = None) -> torch.Tensor:
    """``out [T, H]`` in ``hidden``'s dtype: ``out[t] = sum_k router_weights[t, k] *
    expert_e(hidden[t])`` with ``e = flat_local[t * K + k]`` (a row of ``w13 [E, 2I, H]`` and
    ``w2 [E, H, I]``; -1: skipped), the sum over k in k order in float32 (products rounded to
    float32, then added), then rounded to ``hidden``'s dtype (float32, bfloat16 or float16).
    One call does it all: the entries sorted by expert (stable), grouped (``shrink``: the active
    experts only, as ``group_shrink`` packs them; otherwise every expert, empty ones included),
    ``grouped_expert`` on the gathered rows, and the weighted sum. ``router_weights [T, K]``
    are read as float32; ``isa`` as for ``grouped_expert``.

    ``expert_load [2, E] int64`` (optional, CPU, contiguous), added to: row 0 the entries each
    expert computed, row 1 its time in the grouped products in nanoseconds of thread time
    (each thread reads a steady clock after its share of each active expert, per phase;
    summed over threads, so with several threads a layer's total exceeds its wall time).
    Experts with no entries get nothing. Without it no clock is read."""
    return ops().expert_sum(hidden, w13, w2, flat_local, router_weights, shrink, isa,
                            expert_load)


def esft_reroute(ids: torch.Tensor, aid: torch.Tensor, pi: torch.Tensor,
                 check_aid: bool = True) -> torch.Tensor:
    """``out [T, K]`` in ``ids``' dtype (new, contiguous): ``out[t, k] = pi[aid[t], ids[t, k]]``
    where ``aid[t] >= 0`` and ``ids[t, k] >= 0``, else ``ids[t, k]`` (-1 stays -1). ``ids [T, K]``
    int32 or int64, ``aid int32 [T]`` (-1: a base-model token), ``pi int32 [A, E]``: CPU
    tensors, any strides. ``check_aid``: first refuse (``ValueError``) an ``aid`` value that is
    not -1 or in ``[0, A)``, one pass over ``aid``; an ``ids`` value >= E is the caller's
    contract. One pass over the entries, on ``torch.get_num_threads()`` threads when there are
    enough of them (65536 or more)."""
    return ops().esft_reroute(ids, aid, pi, check_aid)


def deal_entries(ids: torch.Tensor, holders: torch.Tensor, replicas: torch.Tensor,
                 num_servers: int) -> torch.Tensor:
    """int64 in ``ids``' shape: the server index of each entry, dealt by load (the rule is in
    ``csrc/cpu/deal_entries.cpp`` and docs/balancing.md; -1 for an id < 0, -2 for an expert no
    server holds). ``ids`` int32/int64 of any shape, ``holders int64 [E, W]`` (row ``e``: its
    holders in the first ``replicas[e]`` columns), ``replicas int64 [E]``: CPU tensors. A bad
    table or an id >= E raises ``ValueError`` in one sentence."""
    return ops().deal_entries(ids, holders, replicas, num_servers)


if __name__ == "__main__":  # python -m sgl_kernel_ext.cpu_ops: build now (scripts/setup.sh)
    try:
        compiled = build()
    except KernelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    print(f"CPU expert kernel {'built' if compiled else 'already built'} in "
          f"{build_directory()} (paths on this CPU: {', '.join(isas())})")
