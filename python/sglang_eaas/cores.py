"""Whether the launcher's local expert servers share the cores of SGLang's ranks.

There, every core a waiting rank spins on and every extra pass over the experts' weights is
taken from the processes it waits for. Three defaults follow from it: the ranks do not
busy-poll for results (``launcher.prepare.client_poll_spin_us``), ``--eaas`` does not turn on
two-batch overlap, which makes the servers read each active expert's weights once per
micro-batch (``client.overlap.resolve``), and each rank's OpenMP workers sleep after a short
spin, so that a rank waiting for a layer leaves its cores to the servers (``rank_threads``,
``omp_spin_env``).
"""

from __future__ import annotations

import os
from typing import Mapping

from sglang_eaas.config import DEFAULT_LOCAL_SERVERS, EaasConfig, LocalServers, RemoteServers
from sglang_eaas.membership import EMBEDDED


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which SGLang's ranks inherit)."""
    return len(os.sched_getaffinity(0))


def shares_cores(local_servers: int, ranks: int) -> bool:
    """True when ``local_servers`` expert server processes and ``ranks`` SGLang ranks, one
    busy process each while a layer is computed, outnumber the usable cores."""
    return local_servers > 0 and local_servers + ranks > usable_cores()


# libgomp's spins before an idle OpenMP worker sleeps (GOMP_SPINCOUNT), for ranks that share
# the cores with local expert servers: about 12 us of ``pause`` on this project's hosts (300,000
# pauses measured at 3.5 ms), enough to bridge the gaps between one layer's torch ops; libgomp's
# default, 300,000, spins for milliseconds, through most of a layer's wait for the servers.
RANK_SPINCOUNT = 1000


def rank_threads(local_servers: int, ranks: int) -> int | None:
    """Torch intra-op threads for each SGLang rank on a CPU host where ``local_servers`` expert
    servers (one thread each) run beside ``ranks`` ranks; None without local servers (SGLang's
    choice stands). Where they share the cores, each rank gets its share of every core, its
    OpenMP workers spinning only ``RANK_SPINCOUNT`` times before they sleep (``omp_spin_env``):
    a layer's attention runs on all of them, and while the layer is at the servers the
    workers sleep on the cores the servers need (docs/cpu-runtime.md, "Threads of the ranks").
    Else the cores the servers leave, split over the ranks, at least one."""
    if local_servers <= 0:
        return None
    if shares_cores(local_servers, ranks):
        return max(1, usable_cores() // max(1, ranks))
    return max(1, (usable_cores() - local_servers) // max(1, ranks))


def omp_spin_env(local_servers: int, ranks: int, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the ranks need beside ``rank_threads``: ``GOMP_SPINCOUNT`` where they
    share the cores with local expert servers, unless the user set it or
    ``OMP_WAIT_POLICY``. It must be in the environment a rank starts with (libgomp reads it
    once, when torch loads it)."""
    if not shares_cores(local_servers, ranks) or {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(
            environ):
        return {}
    return {"GOMP_SPINCOUNT": str(RANK_SPINCOUNT)}


def planned_local_servers(cfg: EaasConfig) -> int:
    """How many expert servers the launcher will start for ``cfg`` (0: all started
    separately), as ``launcher.prepare.prepare_expert_servers`` decides it."""
    if isinstance(cfg.expert_servers, RemoteServers):
        return 0
    if cfg.placement is not None:
        return len(cfg.placement.entries) if cfg.placement.local else 0
    if isinstance(cfg.expert_servers, LocalServers):
        return cfg.expert_servers.count
    return DEFAULT_LOCAL_SERVERS if cfg.monitor.kind == EMBEDDED else 0
