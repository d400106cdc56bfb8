"""Routing traces of a Qwen3-MoE checkpoint: what each MoE layer's router saw and picked.

A *request* is one chunk of ``tokens`` consecutive tokens of one CPython stdlib source file
(``corpus.py``: the files the tiny checkpoint was trained on, by the same rule), encoded as a server
would encode the text (no BOS); its id is ``"<relative path>#<chunk>"``. ``record`` runs the
model (transformers, float32, eval, no grad) over the requests and keeps, per MoE layer and
token, the router's input (the output of ``post_attention_layernorm``) and its top-k expert
ids, both captured with forward hooks, so what is recorded is what the model computed.

Split (``split_of``): by the request's *file*, ``crc32(path) % 10``: 0-5 ``train`` (fitting
predictors), 6 ``valid`` (deciding whether a fine-tuned predictor is kept), 7-9 ``test`` (the
accuracies reported): the paper's 7:3 train/test, with a tenth of its train part set aside so
the test split decides nothing. All chunks of one file share a split.

Steps (``step_tokens``): requests are taken ``batch`` at a time in trace order (an incomplete
last batch is dropped, so every step has the same size). ``decode``: step ``j`` of a batch
holds one token per request, request ``i`` at position ``(j + i * tokens // batch) % tokens``
(staggered, as requests that joined at different times), so a batch gives ``tokens`` steps of
``batch`` tokens; ``prefill``: a batch is one step of all ``batch * tokens`` tokens.
``load_windows`` turns a trace's routing into ``LoadWindow``s of such steps.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from sglang_eaas.balance.load import LoadWindow
from sglang_eaas.corpus import corpus_files, read_text, stdlib_root

SPLIT_MOD = 10
SPLITS = {"train": range(0, 6), "valid": range(6, 7), "test": range(7, 10)}
MODES = ("decode", "prefill")


@dataclass(frozen=True)
class Request:
    id: str  # "<relative path>#<chunk>"
    token_ids: tuple[int, ...]

    @property
    def file(self) -> str:
        return self.id.rsplit("#", 1)[0]


def split_of(request_id: str) -> str:
    """``train``, ``valid`` or ``test``, from ``crc32`` of the request's file path."""
    bucket = zlib.crc32(request_id.rsplit("#", 1)[0].encode()) % SPLIT_MOD
    return next(name for name, r in SPLITS.items() if bucket in r)


def stdlib_requests(tokenizer, tokens: int = 256, chunks_per_file: int = 1,
                    max_requests: int = 0, root: Path | None = None) -> list[Request]:
    """Chunks of ``tokens`` tokens (at most ``chunks_per_file`` per file; a file shorter than one
    chunk gives none) of the stdlib sources, files in sorted order. With ``max_requests`` > 0,
    that many spread evenly over the list (request ``i * n // max_requests``)."""
    root = stdlib_root() if root is None else root
    files = corpus_files(root)
    encoded = tokenizer.backend_tokenizer.encode_batch(
        [read_text(root, f) for f in files], add_special_tokens=False)
    requests = []
    for rel, enc in zip(files, encoded):
        ids = enc.ids
        for k in range(min(chunks_per_file, len(ids) // tokens)):
            requests.append(Request(f"{rel}#{k}", tuple(ids[k * tokens: (k + 1) * tokens])))
    if 0 < max_requests < len(requests):
        n = len(requests)
        requests = [requests[i * n // max_requests] for i in range(max_requests)]
    return requests


@dataclass
class Trace:
    """Per MoE layer, every token's router input and router picks, for equal-length requests.

    ``gate_inputs``: ``[L, R, S, H]`` float32 (``layers[i]``'s ``post_attention_layernorm``
    output); ``topk_ids``: ``[L, R, S, K]`` int64 (that layer's router's top-k, in its order).
    """

    request_ids: list[str]
    layers: list[int]  # MoE layer ids (decoder layer indices)
    num_experts: int
    gate_inputs: torch.Tensor
    topk_ids: torch.Tensor

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[-1]

    @property
    def tokens_per_request(self) -> int:
        return self.topk_ids.shape[2]

    def subset(self, rows: Sequence[int]) -> "Trace":
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        return Trace([self.request_ids[i] for i in idx.tolist()], list(self.layers),
                     self.num_experts, self.gate_inputs[:, idx], self.topk_ids[:, idx])

    def split(self, name: str) -> "Trace":
        assert name in SPLITS, f"unknown split {name!r}"
        return self.subset([i for i, r in enumerate(self.request_ids) if split_of(r) == name])

    def row(self, layer: int) -> int:
        """The index of MoE layer ``layer`` in ``layers``."""
        return self.layers.index(layer)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        meta = {"request_ids": self.request_ids, "layers": self.layers,
                "num_experts": self.num_experts}
        save_file({"gate_inputs": self.gate_inputs.contiguous(),
                   "topk_ids": self.topk_ids.contiguous()}, str(path),
                  metadata={"eaas_trace": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["eaas_trace"])
            return cls(meta["request_ids"], meta["layers"], meta["num_experts"],
                       f.get_tensor("gate_inputs"), f.get_tensor("topk_ids"))


def load_model(path: str | Path):
    """The checkpoint as transformers loads it: float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def moe_layers(model) -> list[int]:
    """Decoder layer indices whose MLP is a routed MoE block (it has a ``gate`` router)."""
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]


def record(model, requests: Sequence[Request], batch: int = 16,
           log: Callable[[str], None] = lambda line: None) -> Trace:
    """Run ``model`` over ``requests`` (all of one length), ``batch`` at a time, and keep each
    MoE layer's router input and top-k picks (captured by forward hooks)."""
    assert requests, "no requests to record"
    lengths = {len(r.token_ids) for r in requests}
    assert len(lengths) == 1, f"requests must have one length, got {sorted(lengths)}"
    layers = moe_layers(model)
    num_experts, hidden = model.model.layers[layers[0]].mlp.gate.weight.shape
    n, seq = len(requests), lengths.pop()
    gate_inputs = torch.empty(len(layers), n, seq, hidden, dtype=torch.float32)
    topk_ids = torch.empty(len(layers), n, seq, model.config.num_experts_per_tok,
                           dtype=torch.int64)
    rows = slice(0, 0)

    def keep_input(i):
        def hook(module, args, output):
            gate_inputs[i, rows] = output.reshape(-1, seq, hidden)
        return hook

    def keep_topk(i):
        def hook(module, args, output):  # the TopKRouter's (logits, scores, indices)
            topk_ids[i, rows] = output[2].reshape(-1, seq, output[2].shape[-1])
        return hook

    handles = []
    for i, layer in enumerate(layers):
        block = model.model.layers[layer]
        handles.append(block.post_attention_layernorm.register_forward_hook(keep_input(i)))
        handles.append(block.mlp.gate.register_forward_hook(keep_topk(i)))
    try:
        starts = range(0, n, batch)
        every = max(1, len(starts) // 5)  # about five progress lines
        with torch.no_grad():
            for b, start in enumerate(starts):
                rows = slice(start, min(n, start + batch))
                ids = torch.tensor([requests[r].token_ids for r in range(rows.start, rows.stop)])
                model.model(input_ids=ids, use_cache=False)
                if (b + 1) % every == 0 or rows.stop == n:
                    log(f"recorded {rows.stop}/{n} requests")
    finally:
        for h in handles:
            h.remove()
    return Trace([r.id for r in requests], layers, num_experts, gate_inputs, topk_ids)


def step_tokens(num_requests: int, tokens: int, batch: int, mode: str = "decode") -> torch.Tensor:
    """``[steps, tokens per step]`` int64: flat token indices (``request * tokens + position``)
    of each step (module docstring, "Steps")."""
    assert mode in MODES, f"mode must be one of {MODES}, got {mode!r}"
    assert batch >= 1 and tokens >= 1
    groups = torch.arange(num_requests // batch * batch).reshape(-1, batch)  # [G, B]
    if mode == "prefill":
        flat = groups[:, :, None] * tokens + torch.arange(tokens)  # [G, B, S]
        return flat.reshape(len(groups), batch * tokens)
    offsets = torch.arange(batch) * tokens // batch  # [B]
    pos = (torch.arange(tokens)[:, None] + offsets[None, :]) % tokens  # [S, B]
    flat = groups[:, None, :] * tokens + pos[None]  # [G, S, B]
    return flat.reshape(len(groups) * tokens, batch)


def step_loads(topk_ids: torch.Tensor, steps: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[steps, E]`` int64 picks per expert in each step, from one layer's ``topk_ids``
    (``[N, K]`` over flat tokens, or ``[R, S, K]``) and ``steps`` from ``step_tokens``."""
    flat = topk_ids.reshape(-1, topk_ids.shape[-1])
    picks = flat[steps].reshape(len(steps), -1)  # [steps, T*K]
    loads = torch.zeros(len(steps), num_experts, dtype=torch.int64)
    return loads.scatter_add_(1, picks, torch.ones_like(picks))


def load_windows(trace: Trace, batch: int, mode: str = "decode", steps_per_window: int = 1,
                 source: str = "trace", step_seconds: float = 0.0) -> list[LoadWindow]:
    """The trace's routing as ``LoadWindow``s of ``steps_per_window`` steps of ``batch``
    requests each (requests in trace order: ``trace.subset`` chooses and orders them). Traces
    have no wall clock: a window's ``start``/``end`` are its step numbers times
    ``step_seconds``."""
    assert steps_per_window >= 1
    steps = step_tokens(len(trace.request_ids), trace.tokens_per_request, batch, mode)
    loads = torch.stack([step_loads(trace.topk_ids[i], steps, trace.num_experts)
                         for i in range(len(trace.layers))], dim=1)  # [steps, L, E]
    windows = []
    for first in range(0, len(steps), steps_per_window):
        chunk = loads[first: first + steps_per_window]
        windows.append(LoadWindow.of(source, first, len(chunk), first * step_seconds,
                                     (first + len(chunk)) * step_seconds, trace.layers,
                                     chunk.sum(dim=0).numpy()))
    return windows
