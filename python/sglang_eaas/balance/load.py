"""``LoadWindow``: tokens routed to each (MoE layer, expert) over consecutive steps.

One record for every place load is seen or kept: a client's windows (published on SGLang's
``/metrics``, sent to the monitor with its heartbeats, appended to the dump file), the traces
the predictors learn from and the balance benchmark replays. A dump file is JSON lines, one
``LoadWindow.to_message()`` per line (``read_dump``/``append_dump``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from sglang_eaas.protocol.lines import ControlError, Message


@dataclass(frozen=True)
class LoadWindow(Message):
    """``counts[i][e]``: tokens (top-k entries) routed to expert ``e`` of MoE layer
    ``layers[i]`` during steps ``first_step .. first_step + steps - 1`` of ``source``."""

    source: str  # who counted: a client id (one attention rank), or a trace's name
    first_step: int
    steps: int
    start: float  # wall-clock (time.time()) when the window's first step began
    end: float  # ... and when its last step ended
    layers: list[int]  # MoE layer ids, in the order of ``counts``' rows
    counts: list[list[int]]  # [len(layers)][num_experts] entries

    def validate(self) -> None:
        if self.steps < 1 or self.first_step < 0 or self.end < self.start:
            raise ControlError("bad_field", f"a load window needs steps >= 1, first_step >= 0 "
                               f"and end >= start, got {self.steps}, {self.first_step}, "
                               f"{self.start}..{self.end}")
        widths = {len(row) for row in self.counts}
        if len(self.counts) != len(self.layers) or len(widths) > 1:
            raise ControlError("bad_field", f"counts must have one row per layer "
                               f"({len(self.layers)}), all of one width; got "
                               f"{len(self.counts)} rows of widths {sorted(widths)}")
        if any(c < 0 for row in self.counts for c in row):
            raise ControlError("bad_field", "counts must not be negative")

    @classmethod
    def of(cls, source: str, first_step: int, steps: int, start: float, end: float,
           layers: Iterable[int], counts: np.ndarray) -> "LoadWindow":
        """From a ``[L, E]`` integer array."""
        return cls(source, int(first_step), int(steps), float(start), float(end),
                   [int(x) for x in layers], np.asarray(counts, dtype=np.int64).tolist())

    @property
    def num_experts(self) -> int:
        return len(self.counts[0]) if self.counts else 0

    def array(self) -> np.ndarray:
        """``[L, E]`` int64."""
        return np.asarray(self.counts, dtype=np.int64).reshape(len(self.layers), -1)

    def to_message(self) -> dict[str, Any]:
        return {"source": self.source, "first_step": self.first_step, "steps": self.steps,
                "start": self.start, "end": self.end, "layers": list(self.layers),
                "counts": [list(row) for row in self.counts]}


def append_dump(path: str | Path, windows: Iterable[LoadWindow]) -> None:
    with open(path, "a") as f:
        for w in windows:
            f.write(json.dumps(w.to_message(), separators=(",", ":")) + "\n")


def read_dump(path: str | Path) -> Iterator[LoadWindow]:
    """The windows of a dump file; ``ValueError`` naming the line of a malformed one."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield LoadWindow.from_message(json.loads(line))
            except (ValueError, TypeError, ControlError) as exc:
                raise ValueError(f"{path}:{number}: not a load window: {exc}") from None


def latest_windows(members: Iterable[Any]) -> dict[str, LoadWindow]:
    """Each attention client's last window, by client id, from a monitor snapshot's members
    (``Snapshot.clients()``): a client's heartbeat carries ``LoadWindow.to_message()`` as its
    ``load`` (``{}`` before its first window, or where the monitor left it out; a load that
    is not a window, from a client without load recording, is skipped)."""
    found = {}
    for m in members:
        try:
            if m.load:
                found[m.id] = LoadWindow.from_message(m.load)
        except (ControlError, TypeError):
            continue
    return found


def total(windows: Iterable[LoadWindow]) -> np.ndarray:
    """The ``[L, E]`` sum of ``windows`` (which must share layers and width)."""
    arrays = [w.array() for w in windows]
    if not arrays:
        raise ValueError("no load windows")
    return np.sum(arrays, axis=0)
