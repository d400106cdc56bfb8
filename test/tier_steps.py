"""What tests of a client against real expert servers share: random routed batches, one
explicit step of one layer, and waiting for a condition while stepping."""

from __future__ import annotations

import time

import torch
from sglang_eaas.client.client import EaasClient
from sglang_eaas.model_info import MoeModelInfo


def routed_batch(info: MoeModelInfo, tokens: int, seed: int, experts: list[int] | None = None):
    """``(x [T, H], ids [T, K], weights [T, K])``: each token routed to ``top_k`` distinct
    experts drawn from ``experts`` (default: all), seeded."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else range(info.num_experts))
    x = torch.randn(tokens, info.hidden_size, generator=g)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:info.top_k]]
                       for _ in range(tokens)])
    return x, ids, torch.rand(tokens, info.top_k, generator=g)


def one_step(client: EaasClient, layer: int, x, ids, w):
    """One explicit step of one layer: (output, failed rows)."""
    client.begin_step()
    try:
        out = client.forward(layer, x, ids, w)
    finally:
        failed = client.end_step()
    return out, failed


def wait_until(condition, timeout: float, what: str, step=lambda: None) -> None:
    """Call ``step`` until ``condition()`` holds; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        step()
        time.sleep(0.02)
