"""Layer-aware expert-load predictors (balance.predictor) and the routing traces they learn from
(balance.traces), on the trained checkpoint models/tiny-moe-stdlib: a copied router is the
router, the split is by request and fixed, the accuracy metric means what docs/balancing.md
says, the committed fine-tuned predictors beat their copied routers on held-out requests, and
the tool is deterministic and refuses bad flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from sglang_eaas.balance import predictor as P
from sglang_eaas.balance import traces as T
from sglang_eaas.tools import train_predictors

CKPT = Path(__file__).resolve().parent.parent / "models" / "tiny-moe-stdlib"
COMMITTED = CKPT / "predictors" / "d1.safetensors"


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return T.load_model(CKPT)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(CKPT)


def gates(model) -> dict[int, torch.Tensor]:
    return {i: model.model.layers[i].mlp.gate.weight.detach() for i in T.moe_layers(model)}


def test_copy_at_distance_zero_is_the_router(model, tokenizer):
    """With source == target the copied predictor computes the router's own logits, bit for
    bit, and picks its experts; checked against transformers' ``output_router_logits`` (its
    own recorder, not this module's hooks), which also checks what the hooks recorded."""
    text = Path(__file__).read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :192]
    requests = [T.Request(f"this#{i}", tuple(ids[0, i * 64: (i + 1) * 64].tolist()))
                for i in range(3)]
    trace = T.record(model, requests, batch=3)
    with torch.no_grad():
        out = model(input_ids=ids.reshape(3, 64), output_router_logits=True)
    k = model.config.num_experts_per_tok
    predictors = P.copies(gates(model), trace.layers, 0, k)
    for layer, router_logits in zip(T.moe_layers(model), out.router_logits):
        x = trace.gate_inputs[trace.row(layer)].reshape(-1, trace.gate_inputs.shape[-1])
        pred = predictors[layer]
        assert pred.target == layer
        assert torch.equal(pred.logits(x), router_logits)
        picks = torch.topk(torch.softmax(router_logits, -1), k, dim=-1).indices
        assert torch.equal(pred.topk_ids(x), picks)
        assert torch.equal(trace.topk_ids[trace.row(layer)].reshape(-1, k), picks)
        assert torch.equal(pred.load(x), torch.bincount(picks.reshape(-1), minlength=32))
        assert P.score(pred, trace, T.step_tokens(3, 64, 3)).accuracy == 1.0


def test_split_is_deterministic_and_by_file():
    from sglang_eaas.corpus import corpus_files, stdlib_root

    # Fixed values of crc32(path) % 10 (0-5 train, 6 valid, 7-9 test): never re-drawn.
    assert [T.split_of(f"{p}#0") for p in ("os.py", "email/parser.py", "asyncio/tasks.py")] \
        == ["train", "valid", "test"]
    files = corpus_files(stdlib_root())
    for f in files[:50]:  # every chunk of a file is in the file's split
        assert T.split_of(f"{f}#0") == T.split_of(f"{f}#1") == T.split_of(f"{f}#7")
    shares = {s: sum(T.split_of(f"{f}#0") == s for f in files) / len(files) for s in T.SPLITS}
    assert shares["train"] == pytest.approx(0.6, abs=0.07)
    assert shares["valid"] == pytest.approx(0.1, abs=0.05)
    assert shares["test"] == pytest.approx(0.3, abs=0.07)
    trace = T.Trace([f"{f}#0" for f in files[:40]], [0], 4, torch.zeros(1, 40, 2, 1),
                    torch.zeros(1, 40, 2, 1, dtype=torch.int64))
    parts = [trace.split(s).request_ids for s in T.SPLITS]
    assert sorted(sum(parts, [])) == sorted(trace.request_ids)


def test_accuracy_metric_on_hand_made_vectors():
    acc = P.load_accuracy(torch.tensor([[4, 0, 0, 0], [4, 0, 0, 0], [2, 2, 0, 0], [1, 1, 1, 1],
                                        [8, 0, 0, 0]]),
                          torch.tensor([[4, 0, 0, 0], [0, 4, 0, 0], [4, 0, 0, 0], [0, 0, 2, 2],
                                        [2, 2, 0, 0]]))
    # equal; disjoint; half of the picks on the right expert; half; normalised by the sums
    assert acc.tolist() == pytest.approx([1.0, 0.0, 0.5, 0.5, 0.5])
    # overlap = sum min / picks, the same number
    assert float(acc[2]) == pytest.approx(float(torch.minimum(
        torch.tensor([2, 2, 0, 0]), torch.tensor([4, 0, 0, 0])).sum()) / 4)
    # token-level recall: token 0 gets 1 of 2 picks, token 1 both: 3 of 4
    assert P.topk_recall(torch.tensor([[0, 1], [2, 3]]), torch.tensor([[1, 5], [3, 2]])) == 0.75
    # the same loads from other per-token picks: load accuracy 1, recall 0
    pred, actual = torch.tensor([[0], [1]]), torch.tensor([[1], [0]])
    steps = T.step_tokens(2, 1, 2, "decode")
    assert P.load_accuracy(T.step_loads(pred, steps, 2), T.step_loads(actual, steps, 2)) == 1.0
    assert P.topk_recall(pred, actual) == 0.0


def test_steps_and_load_windows():
    steps = T.step_tokens(num_requests=5, tokens=8, batch=2, mode="decode")
    assert steps.shape == (2 * 8, 2)  # two whole batches (request 4 dropped), 8 steps each
    assert sorted(steps.reshape(-1).tolist()) == list(range(32))  # every token once
    assert (steps // 8).tolist()[0] == [0, 1]  # a decode step holds one token per request
    assert (steps % 8).tolist()[:2] == [[0, 4], [1, 5]]  # staggered positions
    assert T.step_tokens(5, 8, 2, "prefill").shape == (2, 16)
    topk = torch.randint(0, 6, (1, 4, 8, 2), generator=torch.Generator().manual_seed(0))
    trace = T.Trace([f"f{i}#0" for i in range(4)], [3], 6, torch.zeros(1, 4, 8, 1), topk)
    windows = T.load_windows(trace, batch=2, steps_per_window=5, source="t")
    assert [w.steps for w in windows] == [5, 5, 5, 1] and windows[1].first_step == 5
    assert all(w.layers == [3] and w.source == "t" for w in windows)
    total = sum(w.array() for w in windows)
    assert total.tolist() == [torch.bincount(topk.reshape(-1), minlength=6).tolist()]
    for w in windows:
        w.validate()
        assert w.array().sum() == w.steps * 2 * 2  # batch tokens x top-k per step


def test_save_load_round_trip(tmp_path, model):
    g = gates(model)
    copies = P.copies(g, [0, 1, 2, 3], 1, 4)
    tuned = P.LayerPredictor(0, 1, g[1] * 1.5, torch.linspace(-1, 1, 32), 4, fine_tuned=True)
    result = P.LayerResult(0, 1, 0.7, 0.71, 0.6, 0.8, 0.9, 0.91, 0.8, "fine-tuned")
    made = P.PredictorSet(1, 0.9, 32, "decode", {**copies, 0: tuned}, {0: result})
    made.save(tmp_path / "p.safetensors")
    back = P.PredictorSet.load(tmp_path / "p.safetensors")
    assert back.metadata() == made.metadata()
    assert back.sources == [0, 1, 2] and back.target_of(2) == 3
    assert back.results == {0: result}
    for s in made.sources:
        a, b = made.predictors[s], back.predictors[s]
        assert torch.equal(a.weight, b.weight) and a.fine_tuned == b.fine_tuned
        assert (a.bias is None and b.bias is None) or torch.equal(a.bias, b.bias)
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    load = back.predict(0, x)
    assert load.dtype == torch.int64 and load.shape == (32,) and load.sum() == 16 * 4
    assert torch.equal(load, made.predict(0, x))
    with pytest.raises(KeyError):
        back.predict(3, x)  # the last MoE layer predicts nothing at distance 1
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="predictors file"):
        P.PredictorSet.load(tmp_path / "bad.safetensors")
    trace = T.Trace(["a#0"], [0, 1], 4, torch.randn(2, 1, 3, 5), torch.randint(0, 4, (2, 1, 3, 2)))
    trace.save(tmp_path / "t.safetensors")
    again = T.Trace.load(tmp_path / "t.safetensors")
    assert again.request_ids == ["a#0"] and again.layers == [0, 1]
    assert torch.equal(again.gate_inputs, trace.gate_inputs)
    assert torch.equal(again.topk_ids, trace.topk_ids)


def test_committed_fine_tuned_layers_beat_their_copies_on_held_out(model, tokenizer):
    """Measured again here, on the test split's requests (files the fine-tuning never saw):
    every fine-tuned layer of the committed predictors is at least as accurate as the copied
    router, and the numbers are the ones the tool reported."""
    committed = P.PredictorSet.load(COMMITTED)
    report = json.loads(COMMITTED.with_suffix(".json").read_text())
    assert committed.distance == 1 and committed.sources == [0, 1, 2]
    requests = [r for r in T.stdlib_requests(tokenizer, 256, 2) if T.split_of(r.id) == "test"]
    trace = T.record(model, requests, batch=16)
    steps = T.step_tokens(len(requests), 256, committed.batch_size, committed.mode)
    g = gates(model)
    tuned = [s for s in committed.sources if committed.predictors[s].fine_tuned]
    assert tuned  # the committed model has layers under the threshold
    same_stdlib = report["versions"]["python"] == sys.version.split()[0]
    for source in committed.sources:
        pred = committed.predictors[source]
        copy = P.LayerPredictor.copy_of_gate(source, pred.target, g[pred.target], 4)
        if not pred.fine_tuned:
            assert torch.equal(pred.weight, copy.weight) and pred.bias is None
            continue
        mine, theirs = P.score(pred, trace, steps), P.score(copy, trace, steps)
        assert mine.accuracy >= theirs.accuracy and mine.recall >= theirs.recall
        if same_stdlib:  # the report's numbers, reproduced
            result = committed.results[source]
            assert mine.accuracy == pytest.approx(result.tuned_test, abs=1e-9)
            assert theirs.accuracy == pytest.approx(result.copy_test, abs=1e-9)


def _tool(out: Path, *extra: str) -> int:
    return train_predictors.main([
        "--model", str(CKPT), "--out", str(out), "--max-requests", "100", "--request-tokens",
        "64", "--chunks-per-file", "1", "--batch-size", "8", "--steps", "20",
        "--threshold", "1.0", "--cost-tokens", "8", "--cost-repeat", "10", "--threads", "1",
        *extra])


def test_small_fresh_run_is_deterministic(tmp_path, capsys):
    assert _tool(tmp_path / "a.safetensors") == 0
    assert _tool(tmp_path / "b.safetensors") == 0
    a, b = ((tmp_path / n).read_bytes() for n in ("a.safetensors", "b.safetensors"))
    assert a == b
    report = json.loads((tmp_path / "a.json").read_text())
    assert [r["target"] for r in report["layers"]] == [1, 2, 3]
    assert report["unpredicted"][0]["layer"] == 0
    for r in report["layers"]:  # threshold 1.0: every layer was fine-tuned; kept by valid
        assert r["tuned_valid"] is not None
        assert (r["kept"] == "fine-tuned") == (r["tuned_valid"] >= r["copy_valid"])
    assert all(c["predictor_us"] > 0 and c["moe_block_us"] > 0 for c in report["cost"])
    assert "| MoE layer | from |" in capsys.readouterr().out


@pytest.mark.parametrize("flags, sentence", [
    (["--distance", "0"], "--distance must be >= 1"),
    (["--threshold", "1.5"], "--threshold must be in [0, 1]"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--cost-tokens", "999"], "--cost-tokens must be between 1 and --request-tokens"),
    (["--out", str(CKPT / "p.safetensors")], "--out must not be a .safetensors file directly"),
])
def test_tool_refuses_bad_flags(flags, sentence, capsys):
    with pytest.raises(SystemExit) as exc:
        train_predictors.parse_args(["--model", str(CKPT), *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert sentence in err and err.count(". ") == 0


def test_tool_refuses_missing_model_and_too_far_distance(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_predictors.parse_args(["--model", str(tmp_path)])
    assert "is not a checkpoint directory" in capsys.readouterr().err
    assert train_predictors.main(["--model", str(CKPT), "--out", str(tmp_path / "x.safetensors"),
                                  "--distance", "4"]) == 2
    assert "--distance 4 leaves nothing to predict with 4 MoE layers" in capsys.readouterr().err
