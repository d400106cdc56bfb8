"""Server-argument defaults applied for the user when the CPU runtime is active.

* ``--attention-backend torch_native`` unless given: SGLang's x86 default ``intel_amx`` needs ops
  that only the (unpublished) CPU build of sgl-kernel registers.
* ``--sleep-on-idle``: otherwise the idle scheduler busy-polls a whole core.
* ``SGLANG_CPU_OMP_THREADS_BIND``: with more ranks than NUMA nodes SGLang asserts unless each
  rank's cores are given; the usable cores are split evenly across ranks (shared if too few).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from sglang_eaas import cpu_runtime

SOURCE = "sglang_eaas.cpu_runtime"


def cpu_threads_binding(num_ranks: int, cpus: list[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` value giving each of ``num_ranks`` ranks a core range."""
    assert num_ranks >= 1 and cpus, (num_ranks, cpus)
    cpus = sorted(cpus)
    if len(cpus) < num_ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(num_ranks))
    per_rank = len(cpus) // num_ranks
    groups = [cpus[r * per_rank : (r + 1) * per_rank] for r in range(num_ranks)]
    return "|".join(_cpu_list(g) for g in groups)


def _cpu_list(cpus: list[int]) -> str:
    """``"4-7"`` for a contiguous run, ``"4"`` for one core, else ``"1,3,5"``."""
    if len(cpus) > 1 and cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def apply(handle_cpu_backends: Callable[[Any], None], server_args: Any) -> None:
    """AROUND hook of SGLang's ``handle_cpu_backends`` resolution step."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if cpu_runtime.is_active() and cfg.device == "cpu":
        if cfg.attention_backend is None:
            declare_resolution(server_args, SOURCE, attention_backend="torch_native")
        if not cfg.sleep_on_idle:
            declare_resolution(server_args, SOURCE, sleep_on_idle=True)
        num_ranks = cfg.tp_size * cfg.pp_size * max(cfg.dp_size, 1)
        if num_ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_binding(
                num_ranks, sorted(os.sched_getaffinity(0))
            )
    handle_cpu_backends(server_args)
