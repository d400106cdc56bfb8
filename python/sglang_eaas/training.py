"""Pieces of a training run shared by the tiny-model trainer (``tools/train_tiny_moe.py``) and
ESFT's expert-only fine-tuning (``esft/finetune.py``): token streams, seeded window batches, the
learning-rate schedule, the time safety net, and a model's loss and routing over a stream.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def token_stream(tokenizer, texts: list[str]):
    """All texts encoded and joined, each followed by the tokenizer's EOS, as one int64
    tensor."""
    import torch

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


class WindowBatches:
    """Training batches: ``batch`` windows of ``seq_len + 1`` consecutive tokens of ``stream``
    each, in a seeded order drawn again whenever it runs out (the same seed, the same
    batches)."""

    def __init__(self, stream, seq_len: int, batch: int, seed: int):
        import torch

        self.stream, self.seq_len, self.batch = stream, seq_len, batch
        self.count = (stream.numel() - 1) // seq_len
        self._gen = torch.Generator().manual_seed(seed)
        self._order = torch.randperm(self.count, generator=self._gen)
        self._cursor = 0

    def next(self):
        """``[batch, seq_len + 1]`` token ids."""
        import torch

        if self._cursor + self.batch > self.count:
            self._order, self._cursor = torch.randperm(self.count, generator=self._gen), 0
        idx = self._order[self._cursor:self._cursor + self.batch]
        self._cursor += self.batch
        return torch.stack([self.stream[i * self.seq_len:(i + 1) * self.seq_len + 1]
                            for i in idx])


def out_of_time(t0: float, minutes: float, step: int, steps: int, log) -> bool:
    """Whether the ``--minutes`` safety net ends the run before ``step`` (said once)."""
    if minutes > 0 and time.monotonic() - t0 > minutes * 60:
        log(f"warning: --minutes {minutes} reached after {step} of {steps} steps; this run is "
            "not reproducible by --steps alone")
        return True
    return False


def cosine_lr(lr: float, warmup: int, steps: int, step: int) -> float:
    """The learning rate of ``step``: linear warmup to ``lr`` over ``warmup`` steps, then cosine
    decay to a tenth of it at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class WindowStats:
    """A model run over consecutive windows of a token stream (``run_windows``)."""

    loss: float  # mean next-token loss, nats per token
    tokens: int  # tokens predicted
    counts: torch.Tensor  # [MoE layers, experts] int64: tokens whose top-k held the expert
    gate_sums: torch.Tensor  # [MoE layers, experts] float64: sum of those tokens' router weights


def run_windows(model, stream, seq_len: int, batch: int, max_tokens: int,
                top_k: int) -> WindowStats:
    """Next-token loss and routing of ``model`` (eval mode, no grad) over the first
    ``max_tokens`` tokens of ``stream`` cut into windows of ``seq_len``, ``batch`` at a time.

    ``counts`` and ``gate_sums`` come from each MoE layer's router logits: the top-``top_k``
    experts of every token, and their softmax weights as the model uses them (renormalized over
    the top-k when the config says ``norm_topk_prob``)."""
    import torch

    n = min(max_tokens, stream.numel() - 1) // seq_len
    if n < 1:
        raise ValueError("the held-out split is shorter than one --seq-len window")
    windows = stream[: n * seq_len + 1]
    norm = getattr(model.config, "norm_topk_prob", False)
    counts = gate_sums = None
    loss_sum, tokens = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, n, batch):
            rows = range(start, min(n, start + batch))
            x = torch.stack([windows[r * seq_len: (r + 1) * seq_len] for r in rows])
            y = torch.stack([windows[r * seq_len + 1: (r + 1) * seq_len + 1] for r in rows])
            out = model(input_ids=x, output_router_logits=True)
            loss = torch.nn.functional.cross_entropy(
                out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1),
                reduction="sum")
            loss_sum += loss.item()
            tokens += y.numel()
            if counts is None:
                shape = (len(out.router_logits), out.router_logits[0].shape[-1])
                counts = torch.zeros(shape, dtype=torch.int64)
                gate_sums = torch.zeros(shape, dtype=torch.float64)
            for layer, logits in enumerate(out.router_logits):
                top = torch.topk(logits.float(), top_k, dim=-1).indices
                counts[layer] += torch.bincount(top.reshape(-1), minlength=counts.shape[1])
                weights = torch.softmax(logits.float(), dim=-1).gather(-1, top)
                if norm:
                    weights = weights / weights.sum(dim=-1, keepdim=True)
                gate_sums[layer].index_add_(0, top.reshape(-1), weights.reshape(-1).double())
    model.train(was_training)
    return WindowStats(loss_sum / tokens, tokens, counts, gate_sums)
