"""Requests' decode routing known in advance: the estimate of a measured bound, never of serving.

``scripts/bench_balance_shift.py --policies hindsight-running`` records each prompt's routing
through the checkpoint beforehand (greedy: the tokens SGLang then generates), names each request
``KEY:anything`` (SGLang's ``rid``) and points ``SGLANG_EAAS_BALANCE_KNOWN_FUTURES`` at an
``.npz`` of ``KEY -> [L, O, K]`` expert ids, one row per generated token. The predictive
balancer then forecasts each running request's own decode to come as it will be, exactly, and
the requests still to come as the forecast spreads them (``RoutingBook.forecast_knowing``): what
it reaches bounds every forecast made from the requests already running (docs/balancing.md,
"What knowing the running requests is worth").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SEPARATOR = ":"  # a request's rid is KEY:anything


class KnownFutures:
    """Per request key, the expert ids ``[L, O, K]`` its generated tokens route to."""

    def __init__(self, ids: dict[str, np.ndarray], num_experts: int):
        self._ids, self.num_experts = ids, num_experts

    @classmethod
    def load(cls, path: str | Path, layers: int, num_experts: int) -> "KnownFutures":
        try:
            with np.load(path) as f:
                ids = {key: f[key] for key in f.files}
        except (OSError, ValueError) as exc:
            raise ValueError(f"known futures {path}: not a readable .npz ({exc})") from exc
        bad = [k for k, v in ids.items() if v.ndim != 3 or v.shape[0] != layers
               or (v.size and (v.min() < -1 or v.max() >= num_experts))]
        if bad:
            raise ValueError(f"known futures {path}: {len(bad)} entries (e.g. {bad[0]!r}) are "
                             f"not [{layers} MoE layers, tokens, top-k] ids below {num_experts}")
        return cls(ids, num_experts)

    def __len__(self) -> int:
        return len(self._ids)

    def entries(self, key: str, done: int, n: int) -> np.ndarray | None:
        """``[L, E]``: the entries of request ``key``'s decode rows ``done .. done + n`` (its
        generated tokens ``done ..``, each fed back as a decode step's row); None where its key
        is unknown."""
        ids = self._ids.get(key.split(SEPARATOR, 1)[0])
        if ids is None:
            return None
        rows = ids[:, done:done + max(0, n)].astype(np.int64)
        out = np.zeros((len(ids), self.num_experts))
        for layer, picks in enumerate(rows):
            picks = picks[picks >= 0]
            out[layer] = np.bincount(picks, minlength=self.num_experts)
        return out
