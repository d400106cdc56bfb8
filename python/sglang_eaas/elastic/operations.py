"""Resize operations as an orchestrator sees them: each has an id, runs in the background, and
asking again with the same id returns the same operation instead of starting another (so a
retried request is a no-op). One runs at a time."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

from sglang_eaas.elastic.resize import Resized

RUNNING, DONE, FAILED = "running", "done", "failed"
TOKEN_HEADER = "X-Eaas-Token"  # the admin API's header carrying the tier's token
KEPT = 64  # finished operations remembered


class OperationConflict(RuntimeError):
    """Another operation is in flight, or the id names one asking for something else."""


@dataclass
class Operation:
    id: str
    servers: int  # active servers asked for
    reason: str  # who asked and why ("admin API", "autoscaler: ...")
    state: str = RUNNING
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    result: str = ""  # Resized.summary(), or why it failed
    resized: Resized | None = None

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "resized"}
        if self.resized is not None:
            out["resized"] = asdict(self.resized)
        return out


class Operations:
    """Runs ``resize(servers)`` for each new operation, one at a time."""

    def __init__(self, resize: Callable[[int], Resized]):
        self._resize = resize
        self._lock = threading.Lock()
        self._all: dict[str, Operation] = {}
        self.current: Operation | None = None

    def start(self, servers: int, op_id: str = "", reason: str = "admin API") -> Operation:
        """The operation ``op_id`` (a new one, run in the background, unless that id is known:
        then the known one). Raises ``OperationConflict``."""
        with self._lock:
            known = self._all.get(op_id) if op_id else None
            if known is not None:
                if known.servers != servers:
                    raise OperationConflict(f"operation {op_id} asked for {known.servers} "
                                            f"servers, not {servers}")
                return known
            if self.current is not None and self.current.state == RUNNING:
                raise OperationConflict(f"operation {self.current.id} (to "
                                        f"{self.current.servers} servers) is still running")
            op = Operation(op_id or uuid.uuid4().hex[:12], servers, reason)
            self._all[op.id] = self.current = op
            for old in [k for k, v in self._all.items() if v.state != RUNNING][:-KEPT]:
                del self._all[old]
        threading.Thread(target=self._run, args=(op,), name="eaas-resize", daemon=True).start()
        return op

    def _run(self, op: Operation) -> None:
        try:
            op.resized = self._resize(op.servers)
            op.state, op.result = DONE, op.resized.summary()
        except Exception as exc:  # noqa: BLE001 - reported in the operation, never raised
            op.state, op.result = FAILED, str(exc) or type(exc).__name__
        op.finished_at = time.time()

    def get(self, op_id: str) -> Operation | None:
        return self._all.get(op_id)

    def wait(self, op_id: str, timeout: float) -> Operation | None:
        deadline = time.monotonic() + timeout
        while (op := self._all.get(op_id)) is not None and op.state == RUNNING:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return op
