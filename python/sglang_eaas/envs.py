"""Every environment variable sglang-eaas reads, defined once (prefix ``SGLANG_EAAS_``)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    """A documented environment variable with a string default."""

    name: str
    default: str
    doc: str

    def get(self) -> str:
        return os.environ.get(self.name, self.default)


CPU_RUNTIME = EnvVar(
    "SGLANG_EAAS_CPU_RUNTIME",
    "auto",
    "CPU runtime for SGLang (docs/cpu-runtime.md). 'auto': on when the machine has no CUDA device "
    "and no real sgl_kernel is installed; 'on'/'off' force it.",
)

FORKSERVER = EnvVar(
    "SGLANG_EAAS_FORKSERVER",
    "on",
    "On the CPU runtime, SGLang's ranks and detokenizer are forked from a process that imported "
    "SGLang once, sharing its memory (docs/cpu-runtime.md, 'Memory of a server'); 'off' keeps "
    "SGLang's spawn.",
)

TOKEN = EnvVar(
    "SGLANG_EAAS_TOKEN",
    "",
    "Shared secret of expert servers' control endpoints: servers refuse clients without it. "
    "'--eaas-expert-servers local:N' generates one when unset.",
)

KERNEL_CACHE = EnvVar(
    "SGLANG_EAAS_KERNEL_CACHE",
    "",
    "Folder of the expert server's compiled CPU kernel (sgl_kernel_ext.cpu_ops); default: "
    "share/sglang-eaas/torch_extensions in the virtual environment, else "
    "~/.cache/sglang-eaas/torch_extensions.",
)

OPERATION_LEASE = EnvVar(
    "SGLANG_EAAS_OPERATION_LEASE",
    "",
    "Seconds the tier controller's operation lease lasts without a renewal (1-600; default 10): "
    "how long a driver that died holding it keeps other operations of the tier waiting "
    "(docs/elastic.md, 'The tier controller').",
)

ETCD_SUSPECT_TIMEOUT = EnvVar(
    "SGLANG_EAAS_ETCD_SUSPECT_TIMEOUT",
    "",
    "Over an etcd monitor (which has no process of its own to configure): seconds without a "
    "member's heartbeat before a watcher suspects it (default 1; at least two of its heartbeat "
    "periods). Set the same in every member and watcher (docs/fault-tolerance.md).",
)

ETCD_LOSS_TIMEOUT = EnvVar(
    "SGLANG_EAAS_ETCD_LOSS_TIMEOUT",
    "",
    "Over an etcd monitor: the TTL of a member's etcd lease, seconds without a heartbeat "
    "before it is lost (default 10; whole seconds, at least four heartbeat periods).",
)

BALANCE_KNOWN_FUTURES = EnvVar(
    "SGLANG_EAAS_BALANCE_KNOWN_FUTURES",
    "",
    "For a measured bound only (scripts/bench_balance_shift.py, policy hindsight-running): an "
    ".npz of each request's decode routing recorded beforehand, by the key its rid starts with; "
    "'--eaas-balance predictive' then forecasts the running requests' decode as it will be "
    "(balance/known_futures.py). Never set it when serving.",
)

ALL = (CPU_RUNTIME, FORKSERVER, TOKEN, KERNEL_CACHE, OPERATION_LEASE, ETCD_SUSPECT_TIMEOUT,
       ETCD_LOSS_TIMEOUT, BALANCE_KNOWN_FUTURES)
