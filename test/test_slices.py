"""Sliced experts (issue 22, docs/switching.md): part p of P of every expert, along the
intermediate dimension, loaded from the checkpoint and computed by the same kernels; the P
parts' weighted sums add up to the whole experts' (float32, top-4, so a token's sum has four
entries and the order of additions is exercised), and to transformers' own experts.

The reference slices are cut here from the safetensors tensors directly, not by the code under
test."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from conftest import model_path
from hf_reference import assert_matches_hf, hf_routed_experts
from sglang_eaas.checkpoint import tensor_files
from sglang_eaas.expert_server.compute import local_experts, weighted_expert_sum
from sglang_eaas.expert_server.experts import load_experts
from sglang_eaas.expert_server.slices import Part, part_rows
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.tools.make_tiny_model import PRESETS
from tier_steps import routed_batch


@pytest.fixture(scope="module")
def top4():
    path = model_path(PRESETS["tiny-top4"])
    return path, MoeModelInfo.from_model_path(path)


@pytest.mark.parametrize("parts", [2, 4])
def test_parts_are_the_checkpoints_rows_and_columns(top4, parts):
    path, info = top4
    layer, files = info.moe_layers[1], tensor_files(path)
    width = info.moe_intermediate_size // parts
    for index in range(parts):
        held = load_experts(path, info, {layer: [5, 2]}, torch.float32,
                            part=Part(index, parts))[layer]
        assert held.w13.shape == (2, 2 * width, info.hidden_size)
        assert held.w2.shape == (2, info.hidden_size, width)
        for row, expert in enumerate([5, 2]):
            gate, up, down = (safe_open(files[n], "pt").get_tensor(n)
                              for n in info.expert_tensor_names(layer, expert))
            cut = slice(index * width, (index + 1) * width)
            assert torch.equal(held.w13[row], torch.cat([gate[cut], up[cut]]))
            assert torch.equal(held.w2[row], down[:, cut])
        whole = load_experts(path, info, {layer: [5, 2]}, torch.float32)[layer]
        w13, w2 = part_rows(whole.w13, whole.w2, Part(index, parts))
        assert torch.equal(w13, held.w13) and torch.equal(w2, held.w2)


@pytest.mark.parametrize("kernel", ["fast", "reference"])
@pytest.mark.parametrize("parts", [2, 4])
def test_the_parts_sums_add_up_to_the_whole_experts(top4, kernel, parts):
    path, info = top4
    experts = list(range(info.num_experts))
    hf = hf_routed_experts(path)
    for layer in info.moe_layers[:2]:
        whole = load_experts(path, info, {layer: experts}, torch.float32)[layer]
        sliced = [load_experts(path, info, {layer: experts}, torch.float32,
                               part=Part(i, parts))[layer] for i in range(parts)]
        for tokens in (1, 7, 33):
            x, ids, w = routed_batch(info, tokens, seed=tokens + layer)
            out = weighted_expert_sum(whole, x, local_experts(whole, ids), w, kernel=kernel)
            total = sum(weighted_expert_sum(s, x, local_experts(s, ids), w, kernel=kernel)
                        for s in sliced)
            # the same products, the intermediate dimension summed in P pieces, then added
            torch.testing.assert_close(total, out, rtol=1e-6, atol=1e-6 * float(out.abs().max()))
            assert_matches_hf(total, hf, layer, x, ids, w)


def test_bad_parts_are_refused_in_one_sentence(top4):
    path, info = top4
    with pytest.raises(ValueError, match="does not split into 3 equal parts"):
        Part(0, 3).info(info)
    with pytest.raises(ValueError, match="part 4 of 4 does not exist"):
        Part(4, 4).check(info.moe_intermediate_size)
    with pytest.raises(ValueError, match="does not split"):
        load_experts(path, info, [0], torch.float32, part=Part(1, 5))
