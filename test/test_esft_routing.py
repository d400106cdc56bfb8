"""A rank's ESFT rerouting state (``esft/routing.py``) and how ``EsftManager`` fills it from
SGLang's batch: each token's adapter row, per layer the adapter's map; rows not of an adapter
and layers it does not touch keep the router's ids."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang_eaas.esft.manager import EsftManager
from sglang_eaas.esft.routing import AdapterRouting

E = 8


class _Mode:
    def __init__(self, extend: bool):
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


def _manager(routing: AdapterRouting, rows: dict[str, int]) -> EsftManager:
    manager = EsftManager.__new__(EsftManager)  # no registrar: only the batch side is tested
    manager.routing, manager.rows = routing, rows
    return manager


def _expected(ids: torch.Tensor, aid: list[int], maps: dict[int, dict[int, int]]):
    """The rewrite written out entry by entry."""
    out = ids.clone()
    for t, a in enumerate(aid):
        for k in range(ids.shape[1]):
            if a >= 0 and ids[t, k] >= 0:
                out[t, k] = maps.get(a, {}).get(int(ids[t, k]), int(ids[t, k]))
    return out


def test_prefill_and_decode_batches_reroute_by_request():
    routing = AdapterRouting([0, 1], E)
    routing.set_adapter(0, {0: {2: 8, 5: 9}})  # layer 1 untouched by this adapter
    routing.set_adapter(1, {0: {2: 10}, 1: {7: 8}})
    manager = _manager(routing, {"id-a": 0, "id-b": 1})
    g = torch.Generator().manual_seed(0)

    prefill = SimpleNamespace(lora_ids=["id-a", None, "id-b"], extend_seq_lens_cpu=[2, 3, 2],
                              forward_mode=_Mode(True))
    manager.prepare_lora_batch(prefill)
    aid = [0, 0, -1, -1, -1, 1, 1]
    ids = torch.randint(0, E, (7, 3), generator=g, dtype=torch.int32)
    ids[0, 0], ids[3, 1], ids[5, 2] = 2, 2, -1
    assert torch.equal(routing.reroute(0, ids), _expected(ids, aid, {0: {2: 8, 5: 9},
                                                                     1: {2: 10}}))
    assert torch.equal(routing.reroute(1, ids), _expected(ids, aid, {1: {7: 8}}))
    # a tensor-parallel rank's share starts at row_offset
    assert torch.equal(routing.reroute(0, ids[4:], row_offset=4),
                       _expected(ids[4:], aid[4:], {1: {2: 10}}))

    decode = SimpleNamespace(lora_ids=[None, "id-b"], extend_seq_lens_cpu=None,
                             forward_mode=_Mode(False))
    manager.prepare_lora_batch(decode)
    ids = torch.tensor([[2, 7], [2, 7]], dtype=torch.int32)
    assert routing.reroute(1, ids).tolist() == [[2, 7], [2, 8]]
    assert routing.reroute(0, ids).tolist() == [[2, 7], [10, 7]]


def test_a_batch_without_adapter_tokens_is_not_touched():
    routing = AdapterRouting([0], E)
    routing.set_adapter(0, {0: {1: 8}})
    manager = _manager(routing, {"id-a": 0})
    manager.prepare_lora_batch(SimpleNamespace(lora_ids=[None, None], extend_seq_lens_cpu=[3, 1],
                                               forward_mode=_Mode(True)))
    ids = torch.ones(4, 2, dtype=torch.int32)
    assert routing.reroute(0, ids) is ids
    manager.reset_lora_batch()
    assert routing.aid is None


def test_a_freed_row_is_identity_and_rows_are_reused():
    routing = AdapterRouting([0], E)
    routing.set_adapter(0, {0: {1: 8}})
    routing.set_adapter(2, {0: {1: 9}})  # rows grow as needed
    assert routing.rows == 3
    routing.clear_adapter(0)
    routing.set_batch(torch.tensor([0, 1, 2], dtype=torch.int32))
    ids = torch.tensor([[1], [1], [1]], dtype=torch.int32)
    assert routing.reroute(0, ids).tolist() == [[1], [1], [9]]
