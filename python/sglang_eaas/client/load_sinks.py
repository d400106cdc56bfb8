"""Where a client's closed load windows go: off the serving thread (``Publisher``), to SGLang's
``/metrics`` (``TierMetrics.load_window``) and to the dump file (``DumpFile``).

Neither may block or stop serving: the scheduler thread only queues a window; a write that
fails is logged once and the dump stops; a sink that raises is logged once and dropped.
"""

from __future__ import annotations

import collections
import logging
import threading
from pathlib import Path
from typing import Callable, Sequence

from sglang_eaas.balance.load import LoadWindow, append_dump

logger = logging.getLogger(__name__)
QUEUED = 64  # windows waiting for the sinks at most; older ones are dropped (and counted)


def rank_path(path: str | Path, rank: int, ranks: int) -> Path:
    """Rank ``rank``'s dump file: ``path`` itself with one rank, else ``.rank{N}`` inserted
    before the extension (``load.jsonl`` -> ``load.rank1.jsonl``)."""
    path = Path(path)
    if ranks <= 1:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class DumpFile:
    """Appends each window to a JSON-lines file (``balance.load.append_dump``); the first
    write error is logged and ends the dump."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.failed: str | None = None

    def __call__(self, window: LoadWindow) -> None:
        if self.failed is not None:
            return
        try:
            append_dump(self.path, [window])
        except OSError as exc:
            self.failed = str(exc)
            logger.warning("sglang-eaas: writing load windows to %s failed (%s); no more are "
                           "dumped", self.path, exc)


class Publisher:
    """Hands windows to ``sinks`` on a thread of its own: calling it only queues the window."""

    def __init__(self, sinks: Sequence[Callable[[LoadWindow], None]]):
        self.sinks = list(sinks)
        self.dropped = 0  # windows dropped because QUEUED were waiting
        self._queue: collections.deque[LoadWindow] = collections.deque()
        self._unfinished = 0  # queued or in the sinks now
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="eaas-load-sinks", daemon=True)
        self._thread.start()

    def __call__(self, window: LoadWindow) -> None:
        with self._cond:
            if len(self._queue) >= QUEUED:
                self._queue.popleft()
                self._unfinished -= 1
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning("sglang-eaas: load window sinks fell %d windows behind; "
                                   "dropping the oldest", QUEUED)
            self._queue.append(window)
            self._unfinished += 1
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                window = self._queue.popleft()
            for sink in list(self.sinks):
                try:
                    sink(window)
                except Exception:  # a sink's bug must not stop the others, nor serving
                    logger.exception("sglang-eaas: load window sink %r failed; dropped", sink)
                    self.sinks.remove(sink)
            with self._cond:
                self._unfinished -= 1
                self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every window queued so far went through the sinks; whether it did."""
        with self._cond:
            return self._cond.wait_for(lambda: self._unfinished == 0, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Hand the queued windows on, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
