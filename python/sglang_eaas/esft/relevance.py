"""ESFT's expert selection: score each routed expert's relevance to a domain, keep the top ones.

The base model runs over a sample of the domain's tokens; per MoE layer each expert gets a
score, normalized so that a layer's scores sum to 1 (ESFT, "Let the expert stick to his last"):

- ``token`` (token selection ratio): the share of the sample's top-k choices that picked the
  expert, i.e. the fraction of tokens routed to it divided by k;
- ``gate`` (average gate score): the expert's share of the router weights the tokens gave
  their top-k experts.

Per layer the experts are then taken by decreasing score (ties: lower id first) until their
scores add up to ``top_p``: the smallest such set, so at least one expert per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

SCORES = ("token", "gate")


@dataclass(frozen=True)
class ExpertScores:
    """Normalized relevance per MoE layer: ``values[layer][expert]``, each layer summing to 1."""

    score: str
    tokens: int
    values: Mapping[int, tuple[float, ...]]


def expert_scores(stats, moe_layers: Sequence[int], score: str) -> ExpertScores:
    """Scores from ``stats`` (a ``training.WindowStats`` of the base model over the
    sample), whose rows are the MoE layers ``moe_layers`` in order."""
    if score not in SCORES:
        raise ValueError(f"--score must be one of {', '.join(SCORES)}, not {score!r}")
    raw = stats.counts.double() if score == "token" else stats.gate_sums.double()
    if raw.shape[0] != len(moe_layers):
        raise ValueError(f"the model reported {raw.shape[0]} MoE layers' routing, its config "
                         f"has {len(moe_layers)}")
    values = {}
    for row, layer in enumerate(moe_layers):
        total = float(raw[row].sum())
        if total <= 0:
            raise ValueError(f"no token of the sample was routed in MoE layer {layer}")
        values[layer] = tuple(float(v) / total for v in raw[row])
    return ExpertScores(score, stats.tokens, values)


def select_experts(scores: ExpertScores, top_p: float) -> dict[int, tuple[int, ...]]:
    """``{layer: sorted expert ids}``: per layer the top experts whose scores reach ``top_p``."""
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], not {top_p}")
    chosen = {}
    for layer, values in scores.values.items():
        order = sorted(range(len(values)), key=lambda e: (-values[e], e))
        picked, total = [], 0.0
        for expert in order:
            if total >= top_p:
                break
            picked.append(expert)
            total += values[expert]
        chosen[layer] = tuple(sorted(picked))
    return chosen
