"""Whether the launcher's local expert servers share the cores of SGLang's ranks.

There, every core a waiting rank spins on and every extra pass over the experts' weights is
taken from the processes it waits for. Three defaults follow from it: the ranks do not
busy-poll for results (``launcher.prepare.client_poll_spin_us``), ``--eaas`` does not turn on
two-batch overlap, which makes the servers read each active expert's weights once per
micro-batch (``client.overlap.resolve``), and each rank runs only the torch threads the local
servers leave it (``rank_threads``).
"""

from __future__ import annotations

import os

from sglang_eaas.config import DEFAULT_LOCAL_SERVERS, EaasConfig, LocalServers, RemoteServers
from sglang_eaas.membership import EMBEDDED


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which SGLang's ranks inherit)."""
    return len(os.sched_getaffinity(0))


def shares_cores(local_servers: int, ranks: int) -> bool:
    """True when ``local_servers`` expert server processes and ``ranks`` SGLang ranks, one
    busy process each while a layer is computed, outnumber the usable cores."""
    return local_servers > 0 and local_servers + ranks > usable_cores()


def rank_threads(local_servers: int, ranks: int) -> int | None:
    """Torch intra-op threads for each SGLang rank on a CPU host where ``local_servers`` expert
    servers (one thread each) run beside ``ranks`` ranks: the cores the servers leave, split over
    the ranks, at least one; None without local servers (SGLang's choice stands). A rank's
    threads past that do not speed its own work up while a layer is at the servers: an OpenMP
    worker that waits for the next parallel region busy-spins, on a core a server needed
    (docs/cpu-runtime.md, "Threads of the ranks")."""
    if local_servers <= 0:
        return None
    return max(1, (usable_cores() - local_servers) // max(1, ranks))


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
