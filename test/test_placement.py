"""Expert lists, even placement, placement files, and the replica split of a batch."""

from __future__ import annotations

import json

import pytest
import torch

from sglang_eaas.placement import (
    ExpertRouting, PlacementError, even_placement, load_placement_file, parse_expert_list,
)


def test_parse_expert_list():
    assert parse_expert_list("0-3, 6") == [0, 1, 2, 3, 6]
    assert parse_expert_list("all", 3) == [0, 1, 2]
    for bad in ("", "3-1", "a", "1,1", "2-"):
        with pytest.raises(PlacementError):
            parse_expert_list(bad, 8)


def test_even_placement():
    assert even_placement(8, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert even_placement(8, 1) == [list(range(8))]
    with pytest.raises(PlacementError):
        even_placement(2, 3)


def test_placement_file_json_and_yaml(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"servers": {"local:0": [3, 1], "local:1": [2]}}))
    (tmp_path / "p.yaml").write_text("servers:\n  '127.0.0.1:7000': [0, 1]\n")
    assert load_placement_file(tmp_path / "p.json").entries == {"local:0": [1, 3],
                                                                 "local:1": [2]}
    assert load_placement_file(tmp_path / "p.yaml").entries == {"127.0.0.1:7000": [0, 1]}
    (tmp_path / "bad.json").write_text('{"servers": {"local:0": "0-3"}}')
    with pytest.raises(PlacementError, match="list of expert ids"):
        load_placement_file(tmp_path / "bad.json")


def test_uncovered_or_unknown_experts_are_refused():
    with pytest.raises(PlacementError, match=r"experts \[2\] are on no expert server"):
        ExpertRouting([[0, 1], [3]], 4)
    with pytest.raises(PlacementError, match="holds expert 9"):
        ExpertRouting([[0, 1, 2, 3, 9]], 4)


def test_assignment_follows_the_placement_and_deals_replicas_to_the_least_loaded():
    routing = ExpertRouting([[0, 1], [1, 2], [1, 3]], 4)  # expert 1 on three servers
    ids = torch.tensor([[1, 0], [1, 0], [2, 0], [-1, 1]])
    servers = torch.from_numpy(routing.assign(ids.numpy()))
    assert servers[:, 1][:3].tolist() == [0, 0, 0]  # expert 0 lives on server 0 only
    assert servers[2, 0] == 1 and servers[3, 0] == -1
    # expert 1's three entries go to servers 1 and 2, which had one entry and none, not to
    # server 0, which has three
    assert sorted(servers[ids == 1].tolist()) == [1, 2, 2]
    assert torch.equal(torch.from_numpy(routing.assign(ids.numpy())), servers)  # deterministic
