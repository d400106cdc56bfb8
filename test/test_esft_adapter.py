"""ESFT adapters (python/sglang_eaas/esft, python -m sglang_eaas.tools.esft): the format and every
refusal of ``load_adapter``, the three adapters shipped with models/tiny-moe-stdlib, the random
and merge tools (merged tensors read back with safetensors, not through the code under test),
a short training run, and that adapters change what the model computes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang_eaas.esft.adapter import AdapterError, EsftAdapter, load_adapter
from sglang_eaas.esft.domains import DOMAINS, Domain, DomainError, domain_files
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.tools.esft import main

BASE = Path(__file__).resolve().parent.parent / "models" / "tiny-moe-stdlib"
ADAPTERS = BASE / "adapters"
SHIPPED = ("pytests", "manpages", "changelogs")
INFO = MoeModelInfo.from_model_path(BASE)
SMALL = '{"0": [1, 2], "2": [5]}'


def _names(layer: int, expert: int) -> tuple[str, str, str]:
    return INFO.expert_tensor_names(layer, expert)


def _raw(tensor: torch.Tensor) -> bytes:
    """A tensor's bytes as safetensors stores them (bfloat16 has no numpy type)."""
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _random(out: Path, *args: str) -> Path:
    assert main(["random", str(BASE), str(out), *args]) == 0
    return out


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A random adapter replacing experts 1, 2 of layer 0 and 5 of layer 2."""
    return _random(tmp_path_factory.mktemp("esft") / "small", "--experts", SMALL)


@pytest.fixture
def broken(small, tmp_path):
    """A copy of ``small`` to break, with helpers to rewrite its two files."""
    path = shutil.copytree(small, tmp_path / "broken")

    class Broken:
        dir = path

        @staticmethod
        def config(**changes):
            cfg = json.loads((path / "expert_config.json").read_text())
            cfg.update(changes)
            (path / "expert_config.json").write_text(json.dumps(cfg))

        @staticmethod
        def tensors(edit):
            tensors = load_file(path / "adapter.safetensors")
            edit(tensors)
            save_file(tensors, path / "adapter.safetensors")

    return Broken


def _refused(path: Path, problem: str, **kwargs) -> None:
    with pytest.raises(AdapterError) as info:
        load_adapter(path, INFO, **kwargs)
    message = str(info.value)
    assert message.startswith(f"ESFT adapter {path}: "), message
    assert problem in message, message
    assert "\n" not in message


# ------------------------------------------------------------------------------ the format


def test_small_adapter_layout_and_api(small):
    cfg = json.loads((small / "expert_config.json").read_text())
    assert cfg == {"experts": {"0": [1, 2], "2": [5]}, "shared_experts": False,
                   "non_expert_modules": False}
    with safe_open(small / "adapter.safetensors", "pt") as f:
        names = set(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    assert names == {n for layer, e in ((0, 1), (0, 2), (2, 5)) for n in _names(layer, e)}
    adapter = load_adapter(small, INFO, model_path=BASE)
    assert adapter == EsftAdapter(small, {0: (1, 2), 2: (5,)})
    assert (adapter.count, adapter.per_layer_max) == (3, 2)
    assert adapter.weight_bytes(INFO) == 3 * 3 * 256 * 64 * 2
    assert adapter.weight_bytes(INFO, "float32") == 3 * 3 * 256 * 64 * 4

    w13, w2 = adapter.load_weights(INFO, 0, [2, 1], torch.float32)
    assert w13.shape == (2, 128, 256) and w2.shape == (2, 256, 64) and w13.dtype == torch.float32
    raw = load_file(small / "adapter.safetensors")
    for row, expert in enumerate([2, 1]):
        gate, up, down = (raw[n] for n in _names(0, expert))
        assert torch.equal(w13[row], torch.cat([gate, up]).float())
        assert torch.equal(w2[row], down.float())
        digest = hashlib.sha256(b"".join(_raw(t) for t in (gate, up, down))).hexdigest()
        assert adapter.digest(INFO, 0, expert) == digest
    assert adapter.digest(INFO, 0, 1) != adapter.digest(INFO, 0, 2)
    every = adapter.digests(INFO, adapter.experts)  # all at once: the same as one by one
    assert every == {layer: {e: adapter.digest(INFO, layer, e) for e in experts}
                     for layer, experts in adapter.experts.items()}
    with pytest.raises(AdapterError, match="does not replace experts"):
        adapter.load_weights(INFO, 0, [3], torch.float32)
    with pytest.raises(AdapterError, match=r"does not replace experts \[3\] of layer 0"):
        adapter.digest(INFO, 0, 3)
    with pytest.raises(AdapterError, match=r"does not replace experts \[4\] of layer 2"):
        adapter.digests(INFO, {0: (1,), 2: (5, 4)})


# ------------------------------------------------------------------------------ refusals


def test_refuses_missing_and_unreadable_files(broken, tmp_path):
    _refused(tmp_path / "nowhere", "no such directory")
    data = (broken.dir / "adapter.safetensors").read_bytes()
    (broken.dir / "adapter.safetensors").write_bytes(data[:-10])
    _refused(broken.dir, "adapter.safetensors is not a valid safetensors file")
    (broken.dir / "adapter.safetensors").write_bytes(b"\x05\x00")
    _refused(broken.dir, "adapter.safetensors is missing or not a readable safetensors file")
    (broken.dir / "adapter.safetensors").unlink()
    _refused(broken.dir, "adapter.safetensors is missing or not a readable safetensors file")
    (broken.dir / "expert_config.json").write_text("{not json")
    _refused(broken.dir, "cannot read expert_config.json")
    (broken.dir / "expert_config.json").unlink()
    _refused(broken.dir, "cannot read expert_config.json")


def test_refuses_shared_experts_and_non_expert_modules(broken):
    broken.config(shared_experts=True)
    _refused(broken.dir, "touches shared experts")
    broken.config(shared_experts=False, non_expert_modules=True)
    _refused(broken.dir, "touches non-expert weights")


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.q_proj.weight",  # attention
    "model.layers.0.mlp.gate.weight",  # the router
    "model.layers.0.mlp.shared_expert.gate_proj.weight",  # a shared expert
    "model.embed_tokens.weight",
])
def test_refuses_tensors_that_are_not_routed_experts(broken, name):
    broken.tensors(lambda t: t.update({name: torch.zeros(4, 4, dtype=torch.bfloat16)}))
    _refused(broken.dir, f"holds {name}, which is not a routed expert's weight")


def test_refuses_an_unlisted_expert(broken):
    name = _names(0, 3)[0]
    broken.tensors(lambda t: t.update({name: torch.zeros(64, 256, dtype=torch.bfloat16)}))
    _refused(broken.dir, f"holds {name}, a routed expert's weight that expert_config.json "
                         "does not list")


@pytest.mark.parametrize("experts, problem", [
    ({"7": [1]}, "layer 7 is not a MoE layer of the model (its MoE layers are [0, 1, 2, 3])"),
    ({"x": [1]}, "layer key 'x' in expert_config.json is not a decoder layer id"),
    ({"0": [32]}, "expert 32 of layer 0 is out of range (the model has experts 0..31)"),
    ({"0": [-1]}, "expert -1 of layer 0 is out of range"),
    ({"0": [1, 2, 1]}, "expert 1 is listed twice in layer 0"),
    ({"0": "1"}, "layer 0's entry in expert_config.json is not a list of integer expert ids"),
    ({"0": [1.5]}, "is not a list of integer expert ids"),
])
def test_refuses_bad_expert_lists(broken, experts, problem):
    broken.config(experts=experts)
    _refused(broken.dir, problem)


def test_refuses_more_experts_than_the_slot_budget(small):
    assert load_adapter(small, INFO, slot_budget=2).per_layer_max == 2
    _refused(small, "layer 0 replaces 2 experts, more than the 1 adapter slots per layer",
             slot_budget=1)


def test_refuses_a_listed_expert_without_its_tensors(broken):
    broken.tensors(lambda t: t.pop(_names(2, 5)[2]))
    _refused(broken.dir, f"adapter.safetensors lacks {_names(2, 5)[2]} of expert 5 in layer 2")


def test_refuses_shapes_and_dtypes(broken):
    name = _names(0, 1)[2]  # down_proj [H, I] = [256, 64]
    broken.tensors(lambda t: t.update({name: t[name].t().contiguous()}))
    _refused(broken.dir, f"{name} has shape [64, 256] but the base checkpoint's is [256, 64]",
             model_path=BASE)
    _refused(broken.dir, f"{name} has shape [64, 256] but the base checkpoint's is [256, 64]")
    broken.tensors(lambda t: t.update({name: torch.zeros(256, 64, dtype=torch.int32)}))
    _refused(broken.dir, f"{name} has dtype I32, not a floating-point type")


def test_accepts_another_float_dtype_and_converts_it(broken, small):
    broken.tensors(lambda t: t.update({n: v.float() for n, v in t.items()}))
    adapter = load_adapter(broken.dir, INFO, model_path=BASE)
    w13, w2 = adapter.load_weights(INFO, 2, [5], torch.bfloat16)
    ref13, ref2 = load_adapter(small, INFO).load_weights(INFO, 2, [5], torch.bfloat16)
    assert w13.dtype == torch.bfloat16 and torch.equal(w13, ref13) and torch.equal(w2, ref2)


# ------------------------------------------------------------------------------ the tools


def test_random_is_deterministic(tmp_path):
    a = _random(tmp_path / "a", "--seed", "3")
    b = _random(tmp_path / "b", "--seed", "3")
    c = _random(tmp_path / "c", "--seed", "4")
    for name in ("expert_config.json", "adapter.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "adapter.safetensors").read_bytes() != (c / "adapter.safetensors").read_bytes()
    adapter = load_adapter(a, INFO, model_path=BASE)
    assert sorted(adapter.experts) == [0, 1, 2, 3] and adapter.per_layer_max == 4
    assert adapter.count == 16
    layers = _random(tmp_path / "d", "--layers", "1,3", "--experts-per-layer", "2")
    assert {k: len(v) for k, v in load_adapter(layers, INFO).experts.items()} == {1: 2, 3: 2}


def test_random_edge_cases(tmp_path):
    every = list(range(INFO.num_experts))
    full = _random(tmp_path / "full", "--experts", json.dumps({"0": [], "1": every}))
    assert json.loads((full / "expert_config.json").read_text())["experts"] == {"1": every}
    adapter = load_adapter(full, INFO, slot_budget=INFO.num_experts, model_path=BASE)
    assert adapter.experts == {1: tuple(every)} and adapter.per_layer_max == INFO.num_experts
    _refused(full, "more than the 31 adapter slots", slot_budget=INFO.num_experts - 1)

    # Two adapters replacing the same base expert, with different weights.
    one = load_adapter(_random(tmp_path / "one", "--seed", "1", "--experts", '{"2": [5]}'), INFO)
    two = load_adapter(_random(tmp_path / "two", "--seed", "2", "--experts", '{"2": [5]}'), INFO)
    assert one.experts == two.experts == {2: (5,)}
    assert one.digest(INFO, 2, 5) != two.digest(INFO, 2, 5)


@pytest.mark.parametrize("args, problem", [
    (["--experts", "{not json"], "--experts must be a JSON object of layer ids"),
    (["--experts", '{"9": [1]}'], "--experts: layer 9 is not a MoE layer of the model"),
    (["--experts", '{"0": [40]}'], "--experts: layer 0's ids must be distinct experts in 0..31"),
    (["--layers", "5"], "--layers: 5 is not a MoE layer of the model"),
    (["--experts-per-layer", "33"], "--experts-per-layer must be in 0..32"),
])
def test_random_refuses_bad_flags(tmp_path, capsys, args, problem):
    assert main(["random", str(BASE), str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and problem in err and "\n" not in err, err


def test_merge_replaces_exactly_the_adapters_experts(small, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["merge", str(BASE), str(small), str(out)]) == 0
    replaced = {n for layer, e in ((0, 1), (0, 2), (2, 5)) for n in _names(layer, e)}
    adapter_tensors = load_file(small / "adapter.safetensors")
    with safe_open(BASE / "model.safetensors", "pt") as fb, \
            safe_open(out / "model.safetensors", "pt") as fm:
        assert set(fb.keys()) == set(fm.keys()) and fb.metadata() == fm.metadata()
        for name in fb.keys():
            base, merged = fb.get_tensor(name), fm.get_tensor(name)
            assert merged.dtype == base.dtype and merged.shape == base.shape, name
            if name in replaced:
                assert _raw(merged) == _raw(adapter_tensors[name]), name
                assert not torch.equal(merged, base), name
            else:
                assert _raw(merged) == _raw(base), name
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (BASE / name).read_bytes(), name
    assert not (out / "metrics.json").exists() and not (out / "adapters").exists()

    # A broken adapter is refused before anything is written.
    (tmp_path / "bad").mkdir()
    assert main(["merge", str(BASE), str(tmp_path / "bad"), str(tmp_path / "m2")]) == 2
    assert "cannot read expert_config.json" in capsys.readouterr().err
    assert not (tmp_path / "m2").exists()


def test_check_command(small, capsys):
    assert main(["check", str(BASE), str(small)]) == 0
    assert "valid; 3 experts replaced (layer 0: [1, 2], layer 2: [5])" in capsys.readouterr().out
    assert main(["check", str(BASE), str(small), "--slot-budget", "1"]) == 2
    assert "more than the 1 adapter slots" in capsys.readouterr().err


# ------------------------------------------------------------------------------ domains, training


def test_domains_say_when_their_files_are_missing(tmp_path):
    empty = Domain("nothing", "no files", lambda: tmp_path, ("*.txt",))
    with pytest.raises(DomainError, match=r"^domain 'nothing' has no files on this machine "
                                          r"\(looked for .*\*\.txt\)$"):
        domain_files(empty)


def test_training_smoke(tmp_path):
    """Two steps on a sliver of a domain: the adapter, its metrics and card are written, the
    experts ESFT picked are the ones replaced, and a rerun gives the same bytes."""
    domain = "changelogs"
    try:
        domain_files(DOMAINS[domain])
    except DomainError as exc:
        pytest.skip(f"the {domain} domain is not on this machine: {exc}")
    args = ["train", str(BASE), "--domain", domain, "--steps", "2", "--max-train-mb", "0.1",
            "--score-tokens", "1024", "--eval-tokens", "1024", "--batch", "2", "--seq-len", "64"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    a, b = tmp_path / "a", tmp_path / "b"
    assert (a / "adapter.safetensors").read_bytes() == (b / "adapter.safetensors").read_bytes()
    adapter = load_adapter(a, INFO, model_path=BASE)
    metrics = json.loads((a / "metrics.json").read_text())
    assert metrics["experts"] == {str(k): list(v) for k, v in adapter.experts.items()}
    assert sorted(adapter.experts) == list(INFO.moe_layers)  # top-p keeps >= 1 per layer
    assert metrics["steps_run"] == 2 and metrics["domain"] == domain
    card = (a / "README.md").read_text()
    assert metrics["command"] in card and f"{metrics['held_out_loss_adapter']:.4f}" in card


# ------------------------------------------------------------------------------ shipped adapters


@pytest.mark.parametrize("domain", SHIPPED)
def test_shipped_adapter(domain):
    path = ADAPTERS / domain
    adapter = load_adapter(path, INFO, model_path=BASE)
    metrics = json.loads((path / "metrics.json").read_text())
    assert metrics["domain"] == domain and metrics["steps_run"] == metrics["spec"]["steps"]
    assert metrics["experts"] == {str(k): list(v) for k, v in adapter.experts.items()}
    assert metrics["experts_total"] == adapter.count
    assert metrics["adapter_bytes"] == (path / "adapter.safetensors").stat().st_size < 3e6
    # Noticeably better on its domain's held-out files than the base model.
    assert metrics["held_out_loss_adapter"] < metrics["held_out_loss_base"] - 0.25
    card = (path / "README.md").read_text()
    for value in (metrics["command"], f"{metrics['held_out_loss_base']:.4f}",
                  f"{metrics['held_out_loss_adapter']:.4f}"):
        assert value in card


@pytest.fixture(scope="module")
def base_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(BASE)


def _greedy(model, ids, tokens: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("domain, prompt", [
    ("pytests", "import unittest\n\n\nclass TestCase(unittest.TestCase):\n    def test_"),
    ("manpages", '.TH OPEN 2 2023-03-30 "Linux man-pages 6.03"\n.SH NAME\nopen \\- '),
    ("changelogs", "openssl (3.0.11-1~deb12u2) bookworm-security; urgency=medium\n\n  * "),
])
def test_adapters_change_the_model(base_model, tmp_path, domain, prompt):
    """The merged checkpoint (transformers' own loading) and the adapter put into the base model
    (``esft.hf.apply_adapter``) give the same logits, different from the base model's, and
    another greedy continuation of a prompt of the domain."""
    from transformers import AutoModelForCausalLM

    from sglang_eaas.esft.hf import apply_adapter

    model, tok = base_model
    assert main(["merge", str(BASE), str(ADAPTERS / domain), str(tmp_path / "m")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    patched = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    apply_adapter(patched, INFO, load_adapter(ADAPTERS / domain, INFO))
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        base_logits, merged_logits, patched_logits = (m(ids).logits for m in
                                                      (model, merged, patched))
    assert torch.equal(merged_logits, patched_logits)
    assert (merged_logits - base_logits).abs().max() > 1.0
    assert _greedy(merged, ids) != _greedy(model, ids)


def test_random_adapter_changes_greedy_tokens(base_model, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = base_model
    adapter = _random(tmp_path / "r", "--seed", "0")
    assert main(["merge", str(BASE), str(adapter), str(tmp_path / "m")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    changed = 0
    prompts = ("import os\nimport", "def main(argv):\n    ", "class Parser:\n    def",
               "    return self.", "if __name__ == ")
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        changed += _greedy(merged, ids, 12) != _greedy(model, ids, 12)
    assert changed >= 3
