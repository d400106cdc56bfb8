"""A rank's torch threads per step, on a CPU host where local expert servers share its cores
(docs/cpu-runtime.md, "Threads of the ranks").

A step whose MoE layers give the servers little to do (fewer entries than the model has
experts: under one per expert on average, so a server streams a fraction of its experts) is
the rank's own compute, and runs on the rank's full threads; any other step runs on the cores
the servers leave it (``cores.rank_threads``), since a second OpenMP worker busy-spins while a
layer is at the servers, on a core a server needed. ``torch.set_num_threads`` is called only
when the count changes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class StepThreads:
    """``wide`` threads for narrow steps (``tokens * top_k < num_experts``), ``narrow`` for the
    others."""

    def __init__(self, wide: int, narrow: int, top_k: int, num_experts: int):
        self.wide, self.narrow = wide, narrow
        self.top_k, self.num_experts = top_k, num_experts
        self.now = torch.get_num_threads()

    def threads_for(self, tokens: int) -> int:
        return self.wide if tokens * self.top_k < self.num_experts else self.narrow

    def step(self, tokens: int) -> None:
        want = self.threads_for(tokens)
        if want != self.now:
            torch.set_num_threads(want)
            self.now = want


def step_tokens(batch: Any) -> int:
    """The token rows of one SGLang ``ScheduleBatch`` step (its extend lengths, or one per
    request)."""
    mode = getattr(batch, "forward_mode", None)
    if mode is not None and mode.is_extend() and getattr(batch, "extend_lens", None):
        return int(sum(batch.extend_lens))
    return len(getattr(batch, "reqs", None) or ())
