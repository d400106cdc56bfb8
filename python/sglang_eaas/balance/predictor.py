"""Layer-aware expert-load predictors (MoEless section 4.1), and how they are scored and tuned.

A ``LayerPredictor`` predicts MoE layer ``target``'s routing from MoE layer ``source``'s router
input (``target = source + d`` in MoE layers, ``d`` the prediction distance): a linear map
``[H] -> [E]`` initialised as an exact copy of ``target``'s router weight (no bias: the same
``F.linear`` as the router, so with ``source == target`` it *is* the router), whose top-k per
token, counted, is the predicted load. The first ``d`` MoE layers have no source and are not
predicted: a client uses their last measured step's load.

Accuracy of a predicted load ``p^`` against the actual ``p`` (both ``[E]`` counts of top-k picks
over the same step's tokens, so both sum to ``tokens * k``) is their overlap
``1 - 0.5 * || p^/sum(p^) - p/sum(p) ||_1 = sum_e min(p^_e, p_e) / (tokens * k)``: the share of
the step's picks that land on experts as often as predicted, 1 when the two loads are equal;
averaged over steps of one batch size (``traces.step_tokens``). ``topk_recall`` (the share of
actual (token, expert) picks that were predicted for that token) is the secondary number; it
never exceeds the overlap.

Layer-aware fine-tuning (``build``): a layer whose copy scores below the threshold on the
``valid`` split is fine-tuned on the ``train`` split (multi-label BCE of its logits against the
router's actual top-k, plus a bias, Adam, seeded minibatches) and kept only if it scores at
least the copy's on ``valid``; ``test`` is only reported. ``PredictorSet`` is what a client
loads: ``predict(source, gate_input) -> load``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from sglang_eaas.balance.traces import Trace, step_loads, step_tokens

FORMAT = "sglang-eaas-predictors/1"


class LayerPredictor:
    """``weight`` ``[E, H]`` float32, ``bias`` ``[E]`` float32 or None (a copy has none)."""

    def __init__(self, source: int, target: int, weight: torch.Tensor,
                 bias: Optional[torch.Tensor], top_k: int, fine_tuned: bool = False):
        assert weight.dim() == 2 and 1 <= top_k <= weight.shape[0], (weight.shape, top_k)
        assert bias is None or bias.shape == weight.shape[:1]
        self.source, self.target, self.top_k, self.fine_tuned = source, target, top_k, fine_tuned
        self.weight = weight.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def copy_of_gate(cls, source: int, target: int, gate_weight: torch.Tensor,
                     top_k: int) -> "LayerPredictor":
        return cls(source, target, gate_weight.detach().clone(), None, top_k)

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def logits(self, gate_input: torch.Tensor) -> torch.Tensor:
        """``gate_input`` ``[T, H]`` float32 (layer ``source``'s router input) -> ``[T, E]``."""
        return F.linear(gate_input, self.weight, self.bias)

    def topk_ids(self, gate_input: torch.Tensor) -> torch.Tensor:
        """``[T, K]`` int64: the predicted experts of each token at layer ``target``, ranked as
        the router ranks them (top-k of the float32 softmax: the same order at near-ties)."""
        probs = torch.softmax(self.logits(gate_input), dim=-1, dtype=torch.float32)
        return torch.topk(probs, self.top_k, dim=-1).indices

    def load(self, gate_input: torch.Tensor) -> torch.Tensor:
        """``[E]`` int64: predicted picks per expert of layer ``target`` over the ``T`` tokens."""
        return torch.bincount(self.topk_ids(gate_input).reshape(-1), minlength=self.num_experts)


# --------------------------------------------------------------------------------------- metric

def load_accuracy(predicted: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Per step, the overlap of two load vectors (``[steps, E]`` counts): ``[steps]`` float in
    [0, 1], ``1 - 0.5 * L1`` of the two normalised to sum 1."""
    p, a = predicted.double(), actual.double()
    ps, as_ = p.sum(-1, keepdim=True), a.sum(-1, keepdim=True)
    assert bool((ps > 0).all() and (as_ > 0).all()), "a step without tokens has no load"
    return 1.0 - 0.5 * (p / ps - a / as_).abs().sum(-1)


def topk_recall(predicted_ids: torch.Tensor, actual_ids: torch.Tensor) -> float:
    """Share of actual (token, expert) picks that the prediction has for that token
    (``[..., K]`` each, same tokens)."""
    hit = (actual_ids.unsqueeze(-1) == predicted_ids.unsqueeze(-2)).any(-1)
    return float(hit.double().mean())


@dataclass(frozen=True)
class Score:
    accuracy: float  # mean load overlap over the steps
    recall: float  # token-level top-k recall


def score(predictor: LayerPredictor, trace: Trace, steps: torch.Tensor) -> Score:
    """``predictor`` on ``trace``'s requests, steps from ``traces.step_tokens``."""
    x = trace.gate_inputs[trace.row(predictor.source)].reshape(-1, trace.gate_inputs.shape[-1])
    actual = trace.topk_ids[trace.row(predictor.target)].reshape(-1, trace.top_k)
    predicted = predictor.topk_ids(x)
    loads = step_loads(predicted, steps, trace.num_experts)
    accuracy = load_accuracy(loads, step_loads(actual, steps, trace.num_experts))
    return Score(float(accuracy.mean()), topk_recall(predicted, actual))


def last_step_score(trace: Trace, layer: int, steps: torch.Tensor, per_batch: int) -> float:
    """The no-predictor baseline: each decode step's load predicted by the previous step's of
    the same batch (``per_batch`` consecutive steps per batch; the first one has none)."""
    loads = step_loads(trace.topk_ids[trace.row(layer)], steps, trace.num_experts)
    loads = loads.reshape(-1, per_batch, trace.num_experts)
    return float(load_accuracy(loads[:, :-1].reshape(-1, trace.num_experts),
                               loads[:, 1:].reshape(-1, trace.num_experts)).mean())


# ---------------------------------------------------------------------------------- fine-tuning

@dataclass(frozen=True)
class TuneConfig:
    steps: int = 1000  # Adam steps
    lr: float = 1e-2
    batch: int = 4096  # tokens per minibatch, drawn with replacement
    seed: int = 0


def fine_tune(predictor: LayerPredictor, gate_input: torch.Tensor, actual_ids: torch.Tensor,
              cfg: TuneConfig) -> LayerPredictor:
    """A copy of ``predictor`` with a bias, fitted to ``actual_ids`` ``[N, K]`` (the target
    layer's router picks) from ``gate_input`` ``[N, H]`` (the source layer's router input):
    multi-label BCE of the logits against the picks as 0/1 targets. Deterministic for a given
    ``cfg``, data and torch thread count."""
    assert len(gate_input) == len(actual_ids) > 0
    gen = torch.Generator().manual_seed(cfg.seed)
    weight = predictor.weight.clone().requires_grad_(True)
    bias = (torch.zeros(predictor.num_experts) if predictor.bias is None
            else predictor.bias.clone()).requires_grad_(True)
    opt = torch.optim.Adam([weight, bias], lr=cfg.lr)
    targets = torch.zeros(len(actual_ids), predictor.num_experts)
    targets.scatter_(1, actual_ids, 1.0)
    with torch.enable_grad():
        for _ in range(cfg.steps):
            idx = torch.randint(len(gate_input), (cfg.batch,), generator=gen)
            loss = F.binary_cross_entropy_with_logits(
                F.linear(gate_input[idx], weight, bias), targets[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return LayerPredictor(predictor.source, predictor.target, weight, bias, predictor.top_k,
                          fine_tuned=True)


@dataclass(frozen=True)
class LayerResult:
    """One predicted layer: its scores (load overlap, top-k recall) per split, which was kept."""

    source: int
    target: int
    copy_valid: float
    copy_test: float
    copy_test_recall: float
    last_step_test: Optional[float]  # the previous step's load as prediction (decode only)
    tuned_valid: Optional[float] = None  # None: not fine-tuned (copy at or above threshold)
    tuned_test: Optional[float] = None
    tuned_test_recall: Optional[float] = None
    kept: str = "copy"  # "copy" | "fine-tuned"


@dataclass
class PredictorSet:
    """The predictors of one model at one distance, keyed by source MoE layer."""

    distance: int
    threshold: float
    batch_size: int  # requests per step of the scores (one token each when decoding)
    mode: str  # "decode" | "prefill" steps
    predictors: dict[int, LayerPredictor]
    results: dict[int, LayerResult] = field(default_factory=dict)  # by source layer

    @property
    def sources(self) -> list[int]:
        return sorted(self.predictors)

    def target_of(self, source: int) -> int:
        return self.predictors[source].target

    def predict(self, source: int, gate_input: torch.Tensor) -> torch.Tensor:
        """``gate_input`` ``[T, H]`` float32, MoE layer ``source``'s router input for a step's
        ``T`` tokens -> ``[E]`` int64 predicted picks per expert of ``target_of(source)``.
        ``KeyError`` for a layer that predicts nothing."""
        return self.predictors[source].load(gate_input)

    def metadata(self) -> dict:
        first = self.predictors[self.sources[0]]
        return {"format": FORMAT, "distance": self.distance, "threshold": self.threshold,
                "batch_size": self.batch_size, "mode": self.mode, "top_k": first.top_k,
                "layers": [{"source": s, "target": p.target, "fine_tuned": p.fine_tuned,
                            **({"scores": asdict(self.results[s])} if s in self.results else {})}
                           for s, p in sorted(self.predictors.items())]}

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for s, p in self.predictors.items():
            tensors[f"source.{s}.weight"] = p.weight
            if p.bias is not None:
                tensors[f"source.{s}.bias"] = p.bias
        save_file(tensors, str(path), metadata={"eaas_predictors": json.dumps(self.metadata())})

    @classmethod
    def load(cls, path: str | Path) -> "PredictorSet":
        """``ValueError`` (one sentence) for a file that is not a predictors file."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("eaas_predictors", "null"))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, SafetensorError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a readable predictors file ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a predictors file of format {FORMAT}")
        predictors, results = {}, {}
        for entry in meta["layers"]:
            s = entry["source"]
            predictors[s] = LayerPredictor(s, entry["target"], tensors[f"source.{s}.weight"],
                                           tensors.get(f"source.{s}.bias"), meta["top_k"],
                                           entry["fine_tuned"])
            if "scores" in entry:
                results[s] = LayerResult(**entry["scores"])
        return cls(meta["distance"], meta["threshold"], meta["batch_size"], meta["mode"],
                   predictors, results)


def copies(gate_weights: dict[int, torch.Tensor], layers: list[int], distance: int,
           top_k: int) -> dict[int, LayerPredictor]:
    """``{source: copy of target's gate}`` for ``target = layers[i]``, ``source = layers[i - d]``
    (``gate_weights`` by MoE layer id, ``[E, H]``)."""
    assert 0 <= distance < len(layers), f"distance {distance} with {len(layers)} MoE layers"
    return {layers[i - distance]: LayerPredictor.copy_of_gate(
        layers[i - distance], layers[i], gate_weights[layers[i]], top_k)
        for i in range(distance, len(layers))}


def build(trace: Trace, gate_weights: dict[int, torch.Tensor], distance: int, threshold: float,
          batch_size: int, mode: str, cfg: TuneConfig,
          log: Callable[[str], None] = lambda line: None) -> PredictorSet:
    """Copies for every predicted layer, fine-tuned where the copy's ``valid`` score is below
    ``threshold`` and kept where that is at least the copy's ``valid`` score; scores over steps
    of ``batch_size`` in ``mode`` (``traces.step_tokens``)."""
    splits = {name: trace.split(name) for name in ("train", "valid", "test")}
    steps = {name: step_tokens(len(t.request_ids), t.tokens_per_request, batch_size, mode)
             for name, t in splits.items()}
    for name in ("valid", "test"):
        if not len(steps[name]):
            raise ValueError(f"the {name} split has {len(splits[name].request_ids)} requests, "
                             f"fewer than one step of {batch_size}")
    chosen, results = {}, {}
    for source, copy in copies(gate_weights, trace.layers, distance, trace.top_k).items():
        cv, ct = (score(copy, splits[n], steps[n]) for n in ("valid", "test"))
        last = (last_step_score(splits["test"], copy.target, steps["test"],
                                trace.tokens_per_request) if mode == "decode" else None)
        result = LayerResult(source, copy.target, cv.accuracy, ct.accuracy, ct.recall, last)
        chosen[source] = copy
        line = (f"MoE layer {copy.target} from {source}: copy valid {cv.accuracy:.4f} test "
                f"{ct.accuracy:.4f}")
        if cv.accuracy < threshold:
            train = splits["train"]
            x = train.gate_inputs[train.row(source)].reshape(-1, train.gate_inputs.shape[-1])
            ids = train.topk_ids[train.row(copy.target)].reshape(-1, train.top_k)
            tuned = fine_tune(copy, x, ids, cfg)
            tv, tt = (score(tuned, splits[n], steps[n]) for n in ("valid", "test"))
            keep = tv.accuracy >= cv.accuracy
            result = LayerResult(source, copy.target, cv.accuracy, ct.accuracy, ct.recall, last,
                                 tv.accuracy, tt.accuracy, tt.recall,
                                 "fine-tuned" if keep else "copy")
            chosen[source] = tuned if keep else copy
            line += (f"; below {threshold}: fine-tuned valid {tv.accuracy:.4f} test "
                     f"{tt.accuracy:.4f}, kept {result.kept}")
        log(line)
        results[source] = result
    return PredictorSet(distance, threshold, batch_size, mode, chosen, results)
