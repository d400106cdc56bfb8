"""The checkpoint generator: deterministic bytes, HF-loadable layout, clear errors on bad sizes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from safetensors import safe_open

from sglang_eaas.tools.make_tiny_model import PRESETS, ModelSpec, make_model, parse_args


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    spec = replace(PRESETS["tiny"], layers=1)
    a = _files(make_model(tmp_path / "a", spec, log=lambda _: None))
    b = _files(make_model(tmp_path / "b", spec, log=lambda _: None))
    c = _files(make_model(tmp_path / "c", replace(spec, seed=1), log=lambda _: None))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_layout_matches_spec(tmp_path, arch):
    spec = ModelSpec(arch=arch, layers=2, experts=6, top_k=3, hidden=32, moe_intermediate=16,
                     heads=2, kv_heads=1)
    out = make_model(tmp_path / arch, spec, log=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert config["num_local_experts"] == 6 and config["num_experts_per_tok"] == 3
    assert config["hidden_size"] == 32 and config["num_hidden_layers"] == 2
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    # Per-expert tensors, named as in real checkpoints: what expert servers load one by one.
    prefix = "mlp.experts" if arch == "qwen3_moe" else "block_sparse_moe.experts"
    proj = "down_proj" if arch == "qwen3_moe" else "w2"
    for layer in range(2):
        for expert in range(6):
            assert f"model.layers.{layer}.{prefix}.{expert}.{proj}.weight" in names
    assert (out / "tokenizer.json").exists()
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()


def test_tokenizer_round_trips_and_has_chat_template(tiny_qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    text = "Hello world! 123 ünïcödé"
    assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-k", "9"], "--top-k (9) cannot exceed --experts (8)"),
        (["--heads", "3"], "--heads (3) must divide --hidden (64)"),
        (["--kv-heads", "3"], "--kv-heads (3) must divide --heads (4)"),
        (["--experts", "0"], "--experts must be >= 1"),
        (["--vocab-size", "100"], "--vocab-size must be >= 259"),
        (["--hidden", "36", "--heads", "4"], "head dim) must be even"),
        (["--arch", "qwen2_moe"], "invalid choice"),
    ],
)
def test_invalid_sizes_give_clear_error(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        parse_args([str(tmp_path / "out"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_presets():
    bench = PRESETS["bench"]
    bench.validate()
    expert_macs = bench.top_k * 3 * bench.hidden * bench.moe_intermediate
    head_dim = bench.hidden // bench.heads
    attention_macs = bench.hidden * head_dim * (2 * bench.heads + 2 * bench.kv_heads)
    assert expert_macs > 1.5 * attention_macs  # routed experts dominate per-token compute
    parsed = parse_args(["out", "--preset", "bench", "--experts", "64"])[1]
    assert parsed == replace(bench, experts=64)
