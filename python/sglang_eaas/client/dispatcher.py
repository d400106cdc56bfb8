"""``EaasDispatcher``: the expert servers as SGLang's MoE token dispatcher.

SGLang's MoE layer runs ``dispatcher.dispatch`` -> ``run_moe_core`` -> ``dispatcher.combine``
(``FusedMoE.forward_impl``), and under two-batch overlap the model's operations call the split
halves, ``dispatch_a``/``dispatch_b`` and ``combine_a``/``combine_b``, with a yield to the
other micro-batch in between (``batch_overlap/operations_strategy.py``). With ``--eaas`` every
MoE layer gets this dispatcher (``client/sglang_moe.py`` hooks SGLang's
``create_moe_dispatcher``):

* ``dispatch_a`` sends the rank's rows to the expert servers (``EaasClient.dispatch``) and
  returns at once: the other micro-batch's attention runs while the servers compute;
* ``run_moe_core`` has nothing to run here (``sglang_moe.run_moe_core`` passes the handle on);
* ``combine_b`` waits for the answers and sums them (``EaasClient.combine``).

With attention TP every rank holds the same tokens: rank r sends the r-th contiguous share and
leaves zeros elsewhere, so the TP all-reduce SGLang does after the layer assembles the output.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from sglang.srt.layers.moe.token_dispatcher.base import (
    BaseDispatcher,
    CombineInputFormat,
    DispatchOutputFormat,
)

from sglang_eaas.client.client import EaasClient
from sglang_eaas.client.handles import Dispatched


class EaasDispatchOutput(NamedTuple):
    """``dispatch``'s output: the rows are at the expert servers; ``handle`` finds them."""

    hidden_states: torch.Tensor  # [T, H] the layer's input (SGLang's protocol field)
    hidden_states_scale: None  # no quantized activations
    handle: Dispatched  # this rank's share of the rows
    share: slice  # which rows of the T are this rank's

    @property
    def format(self) -> DispatchOutputFormat:
        return DispatchOutputFormat.STANDARD


class EaasCombineInput(NamedTuple):
    """``run_moe_core``'s output under --eaas: nothing computed here, the handle passed on."""

    hidden_states: torch.Tensor  # [T, H] the layer's input: the output's shape and dtype
    handle: Dispatched
    share: slice

    @property
    def format(self) -> CombineInputFormat:
        return CombineInputFormat.STANDARD


class EaasDispatcher(BaseDispatcher):
    """One MoE layer's dispatcher; at most one layer in flight per micro-batch."""

    def __init__(self, client: EaasClient, layer_id: int):
        super().__init__()
        from sglang.srt.runtime_context import get_parallel

        self.client, self.layer_id = client, layer_id
        self.tp_rank, self.tp_size = get_parallel().moe_tp_rank, get_parallel().moe_tp_size
        self._dispatched: dict[int, EaasDispatchOutput] = {}  # micro-batch -> awaiting b
        self._combining: dict[int, EaasCombineInput] = {}
        # rows of micro-batch 0 at this layer's last call: micro-batch 1's rows follow them in
        # the step (two-batch overlap splits a batch into two runs of consecutive rows, and
        # runs micro-batch 0 ahead, so its call of a layer comes first)
        self._first_rows = 0

    def dispatch(self, hidden_states: torch.Tensor, topk_output: Any) -> EaasDispatchOutput:
        self.dispatch_a(hidden_states, topk_output)
        return self.dispatch_b()

    def dispatch_a(self, hidden_states: torch.Tensor, topk_output: Any,
                   tbo_subbatch_index: int | None = None) -> None:
        micro_batch = tbo_subbatch_index or 0
        ids, weights = self.client.reroute(self.layer_id, topk_output.topk_ids), \
            topk_output.topk_weights
        tokens, rank, ranks = hidden_states.shape[0], self.tp_rank, self.tp_size
        if micro_batch == 0:
            self._first_rows = tokens
        start = 0 if micro_batch == 0 else self._first_rows  # where its rows start in the step
        share = slice(tokens * rank // ranks, tokens * (rank + 1) // ranks)
        if ranks > 1:  # every rank names every row that cannot be done
            self.client.note_orphans(self.layer_id, ids, start)
        handle = self.client.dispatch(self.layer_id, hidden_states[share], ids[share],
                                      weights[share], row_offset=start + share.start,
                                      micro_batch=micro_batch)
        self._dispatched[micro_batch] = EaasDispatchOutput(hidden_states, None, handle, share)

    def dispatch_b(self, tbo_subbatch_index: int | None = None) -> EaasDispatchOutput:
        return self._dispatched.pop(tbo_subbatch_index or 0)

    def combine(self, combine_input: EaasCombineInput) -> torch.Tensor:
        self.combine_a(combine_input)
        return self.combine_b()

    def combine_a(self, combine_input: EaasCombineInput,
                  tbo_subbatch_index: int | None = None) -> None:
        self._combining[tbo_subbatch_index or 0] = combine_input

    def combine_b(self, tbo_subbatch_index: int | None = None) -> torch.Tensor:
        combined = self._combining.pop(tbo_subbatch_index or 0)
        result = self.client.combine(combined.handle)
        if self.tp_size == 1:
            return result
        out = torch.zeros_like(combined.hidden_states)
        out[combined.share] = result
        return out

