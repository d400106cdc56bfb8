"""Polling without burning a core: spin briefly, then sleep with growing pauses.

A 2-core machine runs the attention client, several expert servers, SGLang's tokenizer and
detokenizer: a poller that never sleeps takes a core from someone doing work. Pauses double
from ``first_sleep`` up to ``max_sleep``; any progress resets to spinning (docs/protocol.md).
"""

from __future__ import annotations

import time


class Backoff:
    def __init__(self, spin_s: float = 50e-6, first_sleep: float = 20e-6, max_sleep: float = 1e-3):
        self.spin_s, self.first_sleep, self.max_sleep = spin_s, first_sleep, max_sleep
        self.reset()

    def reset(self) -> None:
        self._spin_until = time.perf_counter() + self.spin_s
        self._sleep = self.first_sleep

    def pause(self) -> None:
        """Call once per empty poll."""
        if time.perf_counter() < self._spin_until:
            return
        time.sleep(self._sleep)
        self._sleep = min(self._sleep * 2, self.max_sleep)
