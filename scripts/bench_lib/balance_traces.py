"""bench_balance's traces: decode steps whose expert load shifts half-way.

* *Recorded*: the trained checkpoint's own routing (``balance.traces.record``, transformers
  hooks) over requests of one prompt mix, then of another. A mix is a group of stdlib packages
  (``MIXES``); its requests are 256-token chunks of those packages' files in the ``valid`` and
  ``test`` splits only (the predictors were fitted on ``train``). Steps are decode steps of
  ``batch`` requests (``traces.step_tokens``), the first half's groups from the first mix. The
  predictors' load is computed from the same router inputs: MoE layer ``t`` from layer ``t-1``'s
  inputs of the same step; layer 0, not predicted, from the previous step's measured load.
* *Zipf*: per MoE layer a Zipf(s) popularity over a random permutation of the experts; each
  token picks ``k`` distinct experts with those probabilities (multinomial without
  replacement); the permutations are drawn again half-way (the shift). Seeded. No router
  inputs, so no predictor load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from sglang_eaas.balance import traces as T

# Mixes: groups of stdlib packages (first path component), each a different kind of code.
MIXES = {
    "A": ("formats and the web",
          ("email", "html", "http", "json", "urllib", "wsgiref", "xml", "xmlrpc")),
    "B": ("concurrency and testing", ("asyncio", "concurrent", "multiprocessing", "unittest")),
    "C": ("GUI and tools", ("idlelib", "tkinter", "turtledemo")),
}
REQUEST_TOKENS = 256
CHUNKS_PER_FILE = 8


@dataclass
class StepTrace:
    """Decode steps of ``batch`` tokens; ``ids [S, L, T, K]`` int64: each token's top-k experts
    per MoE layer (rows in ``layers``' order); ``inputs [S, L, T, H]`` bfloat16: the tokens'
    router inputs, which are also the experts' inputs (Zipf: one random input, expanded: the
    kernel's time does not depend on the values); ``predicted [S, L, E]`` the predictors' load
    of each step, or None."""

    name: str
    kind: str  # "recorded" | "zipf"
    layers: list[int]
    num_experts: int
    ids: torch.Tensor
    inputs: torch.Tensor
    predicted: Optional[np.ndarray]
    shift: int  # the first step of the second half
    prompts: list[Sequence[int]]  # second half's requests (token ids), for the live load
    skew: float = 0.0  # mean over layers of the busiest expert's share over the mean

    def __post_init__(self):
        s, layers, t, k = self.ids.shape
        flat = self.ids.reshape(s * layers, t * k)
        loads = torch.zeros(s * layers, self.num_experts, dtype=torch.int64)
        loads.scatter_add_(1, flat, torch.ones_like(flat))
        self.loads = loads.reshape(s, layers, self.num_experts).numpy()  # [S, L, E]
        per_layer = self.loads.sum(axis=0).astype(np.float64)
        self.skew = float((per_layer.max(1) / per_layer.mean(1)).mean())

    @property
    def steps(self) -> int:
        return self.ids.shape[0]

    def windows(self, steps: int, predicted: bool = False) -> np.ndarray:
        """``[windows, L, E]``: the actual (or predicted) load summed over ``steps`` steps."""
        loads = self.predicted if predicted else self.loads
        assert loads is not None, f"{self.name} has no predicted load"
        n = len(loads) // steps
        return loads[:n * steps].reshape(n, steps, *loads.shape[1:]).sum(axis=1)


def pick(requests: list[T.Request], mix: str, count: int) -> list[T.Request]:
    """``count`` requests of ``mix``'s packages outside the ``train`` split, spread evenly."""
    packages = MIXES[mix][1]
    found = [r for r in requests
             if r.file.split("/")[0] in packages and T.split_of(r.id) != "train"]
    if len(found) < count:
        raise ValueError(f"mix {mix} has {len(found)} requests outside the train split, fewer "
                         f"than --requests-per-half {count}")
    return [found[i * len(found) // count] for i in range(count)]


def recorded(model, requests: list[T.Request], predictors, first: str, second: str,
             per_half: int, batch: int, log: Callable[[str], None]) -> StepTrace:
    """The checkpoint's routing over ``per_half`` requests of mix ``first``, then of ``second``."""
    halves = [pick(requests, mix, per_half) for mix in (first, second)]
    trace = T.record(model, halves[0] + halves[1], batch=16, log=log)
    steps = T.step_tokens(len(trace.request_ids), trace.tokens_per_request, batch)  # [S, B]
    rows, k = len(trace.layers), trace.top_k
    hidden = trace.gate_inputs.shape[-1]
    flat_inputs = trace.gate_inputs.reshape(rows, -1, hidden)  # [L, N, H]
    flat_ids = trace.topk_ids.reshape(rows, -1, k)  # [L, N, K]
    ids = torch.stack([flat_ids[i][steps] for i in range(rows)], dim=1)  # [S, L, B, K]
    predicted = np.zeros((len(steps), rows, trace.num_experts), dtype=np.int64)
    first_layer = T.step_loads(flat_ids[0], steps, trace.num_experts).numpy()
    predicted[1:, 0] = first_layer[:-1]  # layer 0: the previous step's measured load
    for i in range(1, rows):
        source = trace.layers[i - 1]
        assert predictors.target_of(source) == trace.layers[i], "predictors of distance 1"
        guess = predictors.predictors[source].topk_ids(flat_inputs[i - 1])
        predicted[:, i] = T.step_loads(guess, steps, trace.num_experts).numpy()
    inputs = torch.stack([flat_inputs[i][steps] for i in range(rows)], dim=1)
    return StepTrace(f"stdlib {first}->{second}", "recorded", list(trace.layers),
                     trace.num_experts, ids, inputs.to(torch.bfloat16), predicted,
                     len(steps) // 2, [r.token_ids for r in halves[1]])


def zipf(s: float, layers: list[int], num_experts: int, top_k: int, steps: int, batch: int,
         hidden: int, seed: int) -> StepTrace:
    """``steps`` decode steps of ``batch`` tokens, Zipf(``s``) popularity per layer, the
    permutation of experts drawn again at ``steps // 2``."""
    gen = torch.Generator().manual_seed(seed)
    weight = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    halves = []
    for length in (steps // 2, steps - steps // 2):
        per_layer = []
        for _ in layers:
            popularity = torch.empty(num_experts, dtype=torch.float64)
            popularity[torch.randperm(num_experts, generator=gen)] = weight
            picks = torch.multinomial(popularity.expand(length * batch, -1), top_k,
                                      replacement=False, generator=gen)
            per_layer.append(picks.reshape(length, batch, top_k))
        halves.append(torch.stack(per_layer, dim=1))
    inputs = torch.randn(1, 1, batch, hidden, generator=gen).to(torch.bfloat16)
    return StepTrace(f"Zipf s={s:g}", "zipf", list(layers), num_experts, torch.cat(halves),
                     inputs.expand(steps, len(layers), batch, hidden), None, steps // 2, [])
