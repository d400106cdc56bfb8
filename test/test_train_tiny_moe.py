"""The trained checkpoint (models/tiny-moe-stdlib) and its training script: the committed model
loads and writes Python-like text, its routing is really skewed, and a tiny training run is
deterministic to the byte."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from sglang_eaas.tools.train_tiny_moe import PRESETS, main, parse_args

CKPT = Path(__file__).resolve().parent.parent / "models" / "tiny-moe-stdlib"
# Measured on the committed checkpoint (metrics.json, docs/tiny-models.md), with margin.
HELD_OUT_LOSS_BELOW = 4.0  # nats/token; log(4096) = 8.32 is chance
SKEW_AT_LEAST = 2.0  # max/mean tokens per expert, every layer


@pytest.fixture(scope="module")
def metrics():
    return json.loads((CKPT / "metrics.json").read_text())


@pytest.fixture(scope="module")
def model_and_tokenizer():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(CKPT)


def test_checkpoint_layout_and_size(metrics):
    config = json.loads((CKPT / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["num_experts_per_tok"] >= 3  # the project's equality tests want top-k >= 3
    assert config["dtype"] == "bfloat16"
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert (CKPT / name).is_file(), name
    size = sum(p.stat().st_size for p in CKPT.iterdir())
    assert size < 25e6
    # The committed run finished its --steps (not cut by the --minutes safety stop).
    assert metrics["steps_run"] == metrics["spec"]["steps"]
    assert not metrics["stopped_early_by_minutes"]
    # The model card states the numbers of metrics.json.
    card = (CKPT / "README.md").read_text()
    assert f"{metrics['held_out_loss']:.4f}" in card


def test_held_out_loss_is_far_below_chance(metrics):
    assert metrics["log_vocab"] == pytest.approx(math.log(4096), abs=1e-3)
    assert metrics["held_out_loss"] < HELD_OUT_LOSS_BELOW


def test_greedy_continuation_reads_like_python(model_and_tokenizer):
    import torch

    model, tok = model_and_tokenizer
    # Prompts end on a keyword: its name follows as " name" (one BPE token with the space).
    for prompt in ("import os\nimport", "import os\n\n\ndef", "\n\nclass"):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert text.isascii(), (prompt, text)
        # An identifier of 2+ characters right away, as in `import os` / `def _name(`.
        assert re.match(r" [A-Za-z_][A-Za-z_0-9]+", text), (prompt, text)


def test_routing_is_skewed_per_layer(metrics, model_and_tokenizer):
    import torch

    skew = metrics["expert_load_skew_max_over_mean"]
    spec = metrics["spec"]
    assert len(skew) == spec["layers"]
    assert min(skew) > SKEW_AT_LEAST
    assert max(skew) - min(skew) > 0.05  # layers differ
    counts = torch.tensor(metrics["expert_token_counts"])
    assert counts.sum().item() == metrics["held_out_tokens"] * spec["layers"] * spec["top_k"]
    # Live, on text the metrics did not see (this file): routing is far from uniform too.
    model, tok = model_and_tokenizer
    ids = tok(Path(__file__).read_text(), return_tensors="pt").input_ids[:, :512]
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    for logits in out.router_logits:
        top = torch.topk(logits, spec["top_k"], dim=-1).indices.reshape(-1)
        load = torch.bincount(top, minlength=spec["experts"]).float()
        assert load.max() / load.mean() > SKEW_AT_LEAST


def _run_tiny(out: Path) -> dict:
    assert main(["--out", str(out), "--preset", "tiny"]) == 0
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_tiny_training_run_is_deterministic(tmp_path):
    a = _run_tiny(tmp_path / "a")
    b = _run_tiny(tmp_path / "b")
    assert a["model.safetensors"] == b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]
    assert a["config.json"] == b["config.json"]
    m = json.loads(a["metrics.json"])
    assert m["steps_run"] == PRESETS["tiny"].steps
    assert len(m["expert_load_skew_max_over_mean"]) == PRESETS["tiny"].layers

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert tok.decode(tok("def f(x):\n    return x").input_ids) == "def f(x):\n    return x"
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    AutoModelForCausalLM.from_pretrained(tmp_path / "a")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--experts", "4", "--top-k", "5"], "--top-k (5) cannot exceed --experts (4)"),
        (["--heads", "3", "--kv-heads", "2"], "--kv-heads (2) must divide --heads (3)"),
        (["--vocab-size", "100"], "--vocab-size must be >="),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--minutes", "-1"], "--minutes must be >= 0"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--lr", "0"], "--lr must be > 0"),
    ],
)
def test_bad_values_are_refused_with_one_sentence(capsys, args, message):
    with pytest.raises(SystemExit):
        parse_args(["--out", "/nonexistent", *args])
    assert message in capsys.readouterr().err
