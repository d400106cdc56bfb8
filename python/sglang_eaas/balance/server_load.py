"""What the expert servers computed per (MoE layer, expert) since the live balancer's last pass.

Every expert server counts the entries (tokens routed to an expert, one per top-k choice) it
computes per (MoE layer, expert) from its start: ``stats``' ``ServerStats.expert_load``. The
balancer remembers each server's counters at each pass (``Counters``, kept in a small JSON
state file by ``write_state``) and takes the difference at the next (``since``). A server
without remembered counters, or another process now (another incarnation at the monitor or
another pid, or a counter that went down), counts from its start.

Summed over the servers, the entries are each expert's load: in an EP layer one holder
computes each entry; in a TP layer of ``P`` parts each of the ``P`` servers holding a part
counts the entry for its expert, so the sum is divided by ``P`` (``expert_load``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ibgda import TransportError
from sglang_eaas.protocol.control import ServerStats, probe

Entries = Mapping[int, Mapping[int, int]]  # MoE layer -> expert -> entries


@dataclass(frozen=True)
class Counters:
    """One server's entries per (MoE layer, expert) since it started, when read."""

    server: str  # its control address (its id at the monitor)
    pid: int
    incarnation: str  # its registration at the monitor ("" before it registered)
    read_at: float  # time.time() of the read
    entries: Entries

    @classmethod
    def of(cls, server: str, stats: ServerStats, read_at: float) -> "Counters":
        return cls(server, stats.pid, stats.incarnation or "", read_at,
                   {layer: {e: tokens for e, (tokens, _ns) in experts.items()}
                    for layer, experts in stats.expert_load.items()})

    def same_process(self, earlier: "Counters") -> bool:
        """Whether ``earlier`` was read from the process read now: same incarnation and pid,
        and no counter went down."""
        return (self.server == earlier.server and self.pid == earlier.pid
                and self.incarnation == earlier.incarnation
                and all(self.entries.get(layer, {}).get(e, 0) >= n
                        for layer, experts in earlier.entries.items()
                        for e, n in experts.items()))

    def to_message(self) -> dict[str, Any]:
        return {"server": self.server, "pid": self.pid, "incarnation": self.incarnation,
                "read_at": self.read_at,
                "entries": {str(layer): {str(e): n for e, n in experts.items()}
                            for layer, experts in self.entries.items()}}

    @classmethod
    def from_message(cls, message: Any) -> "Counters":
        """``ValueError`` (or ``TypeError``/``KeyError``/``AttributeError``) if it is not one."""
        entries = {int(layer): {int(e): int(n) for e, n in experts.items()}
                   for layer, experts in message["entries"].items()}
        if any(n < 0 for experts in entries.values() for n in experts.values()):
            raise ValueError("a negative counter")
        return cls(str(message["server"]), int(message["pid"]), str(message["incarnation"]),
                   float(message["read_at"]), entries)


@dataclass(frozen=True)
class Since:
    """One server's entries since ``start`` (a remembered read's time), or since the server
    started (``start`` None: ``why`` says why)."""

    server: str
    entries: Entries
    start: float | None
    why: str = ""  # "not remembered" | "restarted" when start is None


def read_counters(servers: Sequence[str], token: str, timeout: float = 5.0
                  ) -> tuple[list[Counters], dict[str, str]]:
    """Each server's counters now (``stats``, all asked at once), and why each server that
    did not answer did not."""
    def one(server: str) -> Counters | str:
        try:
            return Counters.of(server, probe(server, token, timeout), time.time())
        except (TransportError, ValueError) as exc:  # Refused is a TransportError
            return str(exc) or type(exc).__name__

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(servers)))) as pool:
        answers = list(pool.map(one, servers))
    read = [a for a in answers if isinstance(a, Counters)]
    failed = {s: a for s, a in zip(servers, answers) if isinstance(a, str)}
    return read, failed


def since(now: Counters, earlier: Counters | None) -> Since:
    """``now``'s entries minus ``earlier``'s, when both are of one process."""
    if earlier is None:
        return Since(now.server, now.entries, None, "not remembered")
    if not now.same_process(earlier):
        return Since(now.server, now.entries, None, "restarted")
    out = {}
    for layer, experts in now.entries.items():
        before = earlier.entries.get(layer, {})
        diff = {e: n - before.get(e, 0) for e, n in experts.items() if n > before.get(e, 0)}
        if diff:
            out[layer] = diff
    return Since(now.server, out, earlier.read_at)


def expert_load(measured: Iterable[Since], layers: Sequence[int], num_experts: int,
                parts: Mapping[int, int]) -> np.ndarray:
    """``[len(layers), num_experts]`` int64: each expert's entries, summed over the servers,
    a TP layer's (``parts[layer]`` > 1) divided by its parts. ESFT adapter experts (ids past
    ``num_experts``) and layers not in ``layers`` are left out."""
    out = np.zeros((len(layers), num_experts), dtype=np.int64)
    row = {layer: i for i, layer in enumerate(layers)}
    for server in measured:
        for layer, experts in server.entries.items():
            for e, n in experts.items():
                if layer in row and 0 <= e < num_experts:
                    out[row[layer], e] += n
    for layer, i in row.items():
        p = parts.get(layer, 1)
        if p > 1:
            out[i] = np.rint(out[i] / p).astype(np.int64)
    return out


def server_entries(measured: Iterable[Since], layer: int, num_experts: int) -> dict[str, int]:
    """Each server's entries of the model's experts in ``layer`` (in a TP layer, of its
    parts)."""
    return {s.server: sum(n for e, n in s.entries.get(layer, {}).items() if e < num_experts)
            for s in measured}


def measured_ratio(measured: Iterable[Since], layer: int, num_experts: int) -> float | None:
    """The busiest server's entries in ``layer`` over the mean over ``measured``'s servers;
    None when they computed none there."""
    counts = list(server_entries(measured, layer, num_experts).values())
    total = sum(counts)
    return max(counts) * len(counts) / total if total else None


# -- the state file: each server's counters at the last pass ----------------------------------
def default_state_path(monitor: str) -> Path:
    """``$XDG_CACHE_HOME/sglang-eaas/rebalance/<digest of monitor>.json`` (else under
    ``~/.cache``): one file per tier."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    digest = hashlib.sha256(monitor.encode()).hexdigest()[:16]
    return Path(cache) / "sglang-eaas" / "rebalance" / f"{digest}.json"


def read_state(path: Path) -> tuple[dict[str, Counters], str]:
    """The remembered counters by server, and a warning sentence ("" if none): a missing file
    is no state (no warning); an unreadable or corrupt one is no state, said once."""
    try:
        message = json.loads(path.read_text())
        remembered = [Counters.from_message(c) for c in message["servers"]]
    except FileNotFoundError:
        return {}, ""
    except OSError as exc:
        return {}, f"cannot read the state file {path} ({exc.strerror or exc}); it is ignored"
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # not UTF-8 JSON too
        return {}, (f"the state file {path} is not one this tool wrote ({type(exc).__name__}: "
                    f"{exc}); it is ignored")
    return {c.server: c for c in remembered}, ""


def write_state(path: Path, monitor: str, counters: Iterable[Counters]) -> None:
    """Remember ``counters`` in ``path``, atomically (a temporary file renamed over it);
    ``OSError`` if it cannot be written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"monitor": monitor,
                       "servers": [c.to_message() for c in counters]}, indent=1)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
