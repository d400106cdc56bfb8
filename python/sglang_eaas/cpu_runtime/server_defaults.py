"""Server-argument defaults applied for the user when the CPU runtime is active.

* ``--attention-backend torch_native`` unless given: SGLang's x86 default ``intel_amx`` needs ops
  that only the (unpublished) CPU build of sgl-kernel registers.
* ``--sleep-on-idle``: otherwise the idle scheduler busy-polls a whole core.
* ``SGLANG_CPU_OMP_THREADS_BIND``: with more ranks than NUMA nodes SGLang asserts unless each
  rank's cores are given; the usable cores are split evenly across ranks (shared if too few).
* ``--mem-fraction-static``: the ranks of one server share the host's memory instead of each
  sizing its KV pool to all of it (``size_kv_pools``; ``rank_mem_fraction`` has the arithmetic).
* ``--max-total-tokens``: a rank's KV pool holds what its requests can use, the context length
  times ``--max-running-requests`` (``RUNNING_REQUESTS`` if not given), not half the host
  (``kv_tokens_needed``); the fraction above still caps it.
* ``--disaggregation-decode-retraction-backup cpu_tensor`` on a PD decode instance (``pd``).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from sglang_eaas import cpu_runtime
from sglang_eaas.cpu_runtime import pd

SOURCE = "sglang_eaas.cpu_runtime"
# At most this share of the memory available when a server starts goes to the static memory
# (model weights + KV pools) of all its ranks together; see rank_mem_fraction.
HOST_STATIC_SHARE = 0.5
# Requests a rank's KV pool holds at full context when --max-running-requests is not given: a
# CPU decodes a few dozen at once before its throughput flattens (docs/cpu-runtime.md).
RUNNING_REQUESTS = 32


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
        num_ranks = server_ranks(cfg)
        if num_ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_binding(
                num_ranks, sorted(os.sched_getaffinity(0))
            )
        backup = pd.retraction_backup(cfg)
        if backup is not None:
            declare_resolution(server_args, SOURCE, disaggregation_decode_retraction_backup=backup)
    handle_cpu_backends(server_args)


def server_ranks(cfg: Any) -> int:
    """Scheduler processes (ranks) of one server: ``tp * pp * dp``, over all its nodes."""
    return cfg.tp_size * cfg.pp_size * max(cfg.dp_size, 1)


def rank_mem_fraction(sglang_fraction: float, ranks_on_host: int, numa_nodes: int) -> float:
    """``--mem-fraction-static`` for each rank of a server with ``ranks_on_host`` ranks here.

    How SGLang 0.5.23 sizes a rank's KV pool on a CPU: before loading the model the rank takes
    ``pre`` = the host's available memory / NUMA nodes (``get_available_gpu_memory``, minimum
    over the ranks); after loading, its pool gets ``now - pre * (1 - f)``
    (``KVCacheConfigurator._profile_available_bytes``), ``now`` being what is available then and
    ``f`` mem_fraction_static: ``f * pre`` less what the load took. The pool is zero-filled, so
    resident from start-up. SGLang assumes one rank per NUMA node; with ``r`` ranks on one node
    each takes ``f`` of the node, ``r * f`` in all. Its default ``f``
    (``handle_gpu_memory_settings``) is ``(capacity - reserve) / capacity`` (0.716 on a 24 GiB
    host: about 6.7 GiB kept for activations) but 0.95 once the ranks outnumber the NUMA nodes
    (core binding set: it cannot tell a rank's memory), so ``--tp 2`` on one node asks for 1.9
    times the available memory.

    Here each rank gets ``min(f, HOST_STATIC_SHARE) / k``, ``k = ceil(ranks_on_host /
    numa_nodes)`` the ranks sharing a node: the weights and KV pools of all ranks together take
    at most half the memory available at start, and never more than SGLang's own ``f`` for one
    rank. The other half stays for the server's processes (launcher about 0.6 GiB resident, a
    detokenizer and a rank 0.5-0.7 GiB each, much of it shared through ``forkserver``; and some
    57 bytes a KV token of bookkeeping SGLang does not count: next to a real model's tens of KB a
    token, nothing), activations and the rest of the host. E.g.
    about 19.5 GiB available: ``--tp 1`` 0.5 (9.9 GiB of KV, was 0.716: 14.2 GiB), ``--tp 2`` 0.25 a
    rank (4.8 GiB each, was 0.95 each: killed).

    The load is charged to every rank of the node (``now`` is the node's), so the weights count
    ``k`` times: safe, but weights above ``min(f, HOST_STATIC_SHARE) / k`` of the available
    memory leave no KV pool; SGLang then names the ``--mem-fraction-static`` that would do.
    """
    assert ranks_on_host >= 1 and numa_nodes >= 1, (ranks_on_host, numa_nodes)
    ranks_per_node = -(-ranks_on_host // numa_nodes)
    return round(min(sglang_fraction, HOST_STATIC_SHARE) / ranks_per_node, 3)


def size_kv_pools(handle_gpu_memory_settings: Callable[[Any], None], server_args: Any) -> None:
    """AROUND hook of SGLang's ``handle_gpu_memory_settings`` resolution step (where it picks
    mem_fraction_static): on the CPU runtime, the ranks' fraction from ``rank_mem_fraction``,
    and a pool of ``kv_tokens_needed`` tokens, unless the user gave ``--mem-fraction-static`` or
    ``--max-total-tokens`` (theirs win)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    # What the user typed: SGLang's own rules ask ``_raw_input`` too, the view also holds defaults.
    given = getattr(server_args, "_raw_input", None) or {}
    ours = (
        cpu_runtime.is_active()
        and cfg.device == "cpu"
        and given.get("mem_fraction_static") is None
        and given.get("max_total_tokens") is None
    )
    handle_gpu_memory_settings(server_args)
    if ours:
        from sglang.srt.utils.common import get_cpu_ids_by_node

        cfg = resolving_view(server_args)
        ranks_on_host = max(1, server_ranks(cfg) // max(cfg.nnodes, 1))
        fraction = rank_mem_fraction(
            cfg.mem_fraction_static, ranks_on_host, len(get_cpu_ids_by_node()) or 1
        )
        tokens = kv_tokens_needed(cfg)
        declare_resolution(server_args, SOURCE, mem_fraction_static=fraction,
                           **({} if tokens is None else {"max_total_tokens": tokens}))


def kv_tokens_needed(cfg: Any) -> int | None:
    """The KV tokens a rank needs: its context length (``--context-length``, else the model's,
    as SGLang derives it) times its running requests (``--max-running-requests``, else
    ``RUNNING_REQUESTS``); None where the model's config cannot be
    read here (SGLang then names the problem itself, as it loads it)."""
    context = cfg.context_length
    if context is None:
        from sglang.srt.utils.hf_transformers_utils import (
            get_config, get_context_length, get_hf_text_config,
        )

        try:
            hf = get_config(cfg.model_path, trust_remote_code=cfg.trust_remote_code,
                            revision=cfg.revision)
            context = get_context_length(get_hf_text_config(hf))
        except Exception:  # noqa: BLE001 - SGLang reports an unreadable model as it loads it
            return None
    return int(context) * (cfg.max_running_requests or RUNNING_REQUESTS)
