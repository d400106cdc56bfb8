"""``Stepper``: a client stepping every MoE layer on one batch, without pause, on a thread of
its own (as SGLang's scheduler steps), until stopped: the load a benchmark measures something
under (``bench_faults --hog``'s detector table, ``bench_switch``'s switches under load)."""

from __future__ import annotations

import threading

import torch

from sglang_eaas.client.client import EaasClient
from sglang_eaas.model_info import MoeModelInfo


def random_batch(info: MoeModelInfo, tokens: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` rows of random hidden states, each routed to ``top_k`` distinct random
    experts with equal weights (float32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, info.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(info.num_experts, generator=g)[:info.top_k]
                       for _ in range(tokens)])
    return x, ids, torch.full((tokens, info.top_k), 1.0 / info.top_k)


class Stepper(threading.Thread):
    """Steps every MoE layer of ``client`` on ``batch`` (hidden, expert ids, weights) until
    ``stop`` is set; counts its steps and failed rows; ``error``: why it stopped early."""

    def __init__(self, client: EaasClient, info: MoeModelInfo,
                 batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        super().__init__(name="bench-stepper", daemon=True)
        self.client, self.info = client, info
        self.x, self.ids, self.w = batch
        self.stop = threading.Event()
        self.steps = self.failed = 0
        self.error = ""

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.client.begin_step()
                try:
                    for layer in self.info.moe_layers:
                        self.client.forward(layer, self.x, self.ids, self.w)
                finally:
                    self.failed += len(self.client.end_step())
                self.steps += 1
        except Exception as exc:  # noqa: BLE001 (reported with the numbers, not hidden)
            self.error = f"the stepping client failed: {type(exc).__name__}: {exc}"
