"""``tools.esft train --data FILE.jsonl`` (esft/data.py, esft/relevance.py, esft/finetune.py):
ESFT's JSON-lines format read and every bad line refused in one sentence naming it, the held-out
split by record hash, messages rendered with and without a chat template, ESFT's two expert
selections on a hand-made routing whose answer is known in closed form, and one short training
run on a file made here, whose adapter loads and lowers the held-out loss."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_eaas.esft.adapter import load_adapter
from sglang_eaas.esft.data import (
    DataError, Record, load_data, read_records, render, split_records,
)
from sglang_eaas.esft.relevance import expert_scores, select_experts
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.tools.esft import main
from sglang_eaas.training import run_windows

BASE = Path(__file__).resolve().parent.parent / "models" / "tiny-moe-stdlib"


def _write(path: Path, *lines) -> Path:
    """A data file: dicts written as JSON, strings as they are."""
    path.write_text("".join((json.dumps(x) if isinstance(x, dict) else x) + "\n"
                            for x in lines))
    return path


def _chat(question: str, answer: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": answer}], **extra}


class PlainTokenizer:
    """A tokenizer without a chat template."""

    chat_template = None


# ------------------------------------------------------------------------------ the format


def test_reads_text_and_messages_records(tmp_path):
    path = _write(tmp_path / "good.jsonl",
                  {"text": "one plain text"},
                  "",  # blank lines are skipped, and still counted
                  _chat("hello", "world", id="NLU1", dataset="intent", length=9),
                  "   ",
                  {"messages": [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": ""},
                                {"role": "assistant", "content": "ok"}]})
    records = read_records(path)
    assert [(r.line, r.kind) for r in records] == [(1, "text"), (3, "messages"), (5, "messages")]
    assert records[0].text == "one plain text" and records[0].messages is None
    assert records[1].messages == (("user", "hello"), ("assistant", "world"))
    # The split's key is the whole object, canonical: key order and spacing do not matter.
    again = _write(tmp_path / "again.jsonl",
                   '{ "dataset": "intent", "length": 9, "id": "NLU1", "messages": '
                   '[{"content": "hello", "role": "user"}, '
                   '{"content": "world", "role": "assistant"}] }')
    assert read_records(again)[0].key == records[1].key


BAD_LINES = [
    ("{not json", "is not JSON (Expecting property name enclosed in double quotes at column 2)"),
    ('["a", "list"]', 'is a JSON list, not an object with "text" or "messages"'),
    ('"a string"', 'is a JSON str, not an object with "text" or "messages"'),
    ({"id": 3, "prompt": "x"}, 'has neither "text" nor "messages" (keys: id, prompt)'),
    ({}, 'has neither "text" nor "messages" (keys: none)'),
    ({"text": ""}, '"text" is empty'),
    ({"text": " \n\t"}, '"text" is empty'),
    ({"text": 5}, '"text" is a int, not a string'),
    ({"text": "a", "messages": []}, 'has both "text" and "messages"; keep one'),
    ({"messages": []}, '"messages" is not a non-empty list of {"role", "content"} objects'),
    ({"messages": "hi"}, '"messages" is not a non-empty list of {"role", "content"} objects'),
    ({"messages": ["hi"]}, 'message 0 is not an object with "role" and "content"'),
    ({"messages": [{"role": "user", "content": "q"}, {"content": "a"}]},
     'message 1 has no "role"'),
    ({"messages": [{"role": "user"}]}, 'message 0 has no "content"'),
    ({"messages": [{"role": "", "content": "a"}]}, "message 0's \"role\" is not a non-empty "
     "string"),
    ({"messages": [{"role": "user", "content": None}]}, "message 0's \"content\" is not a "
     "string"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": ""}]},
     "every message's \"content\" is empty"),
]


@pytest.mark.parametrize("bad,problem", BAD_LINES)
def test_refuses_a_bad_line_naming_it(tmp_path, bad, problem):
    path = _write(tmp_path / "bad.jsonl", {"text": "fine"}, "", _chat("q", "a"), bad,
                  {"text": "never read"})
    with pytest.raises(DataError) as info:
        read_records(path)
    assert str(info.value) == f"{path}, line 4: {problem}"


def test_refuses_a_line_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"^.*latin1\.jsonl, line 2: is not UTF-8$"):
        read_records(path)


def test_refuses_missing_empty_and_unreadable_files(tmp_path):
    cases = {tmp_path / "nowhere.jsonl": "no such file",
             _write(tmp_path / "blank.jsonl", "", "  "): "no records (every line is blank)",
             tmp_path: "is a directory, not a JSON-lines file"}
    (tmp_path / "empty.jsonl").write_bytes(b"")
    cases[tmp_path / "empty.jsonl"] = "no records (every line is blank)"
    for path, problem in cases.items():
        with pytest.raises(DataError) as info:
            read_records(path)
        assert str(info.value) == f"{path}: {problem}"


def test_the_command_refuses_a_bad_file_in_one_sentence(tmp_path, capsys):
    path = _write(tmp_path / "bad.jsonl", {"text": "fine"}, {"messages": [{"role": "user"}]})
    assert main(["train", str(BASE), "--data", str(path), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f'error: {path}, line 2: message 0 has no "content"\n'
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit):  # argparse: --domain and --data exclude each other
        main(["train", str(BASE), "--data", str(path), "--domain", "pytests", "--out", "x"])
    assert "not allowed with argument" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the split


def _records(n: int) -> list[Record]:
    return [Record(i + 1, json.dumps({"text": f"record {i}"}), text=f"record {i}")
            for i in range(n)]


def test_split_is_deterministic_disjoint_and_order_free():
    records = _records(400)
    train, held = split_records(records, 0.1)
    assert {r.key for r in train}.isdisjoint({r.key for r in held})
    assert len(train) + len(held) == 400 and 20 <= len(held) <= 60  # about a tenth
    assert all(r.fraction() < 0.1 for r in held) and all(r.fraction() >= 0.1 for r in train)
    shuffled = records[:]
    random.Random(1).shuffle(shuffled)
    again_train, again_held = split_records(shuffled, 0.1)
    assert (again_train, again_held) == (train, held)  # same records, same order
    assert train == sorted(train, key=Record.fraction)
    # A record's side depends on its content only: more records never move it.
    more_train, more_held = split_records(_records(800), 0.1)
    assert set(held) <= set(more_held) and set(train) <= set(more_train)
    assert set(held) <= set(split_records(records, 0.3)[1])  # a larger share only adds


def test_split_refuses_an_empty_side_and_bad_shares():
    one = _records(1)
    with pytest.raises(DataError, match=r"^f\.jsonl: a held-out share of 0\.1 leaves the "
                       r"(held-out|training) split of its 1 records empty; give more records "
                       r"or another --held-out$"):
        split_records(one, 0.1, "f.jsonl")
    for share in (0, 1, -0.5, 1.5):
        with pytest.raises(DataError, match=r"^--held-out must be in \(0, 1\)"):
            split_records(_records(50), share)


# ------------------------------------------------------------------------------ rendering


def test_renders_messages_with_the_chat_template_or_plainly(tmp_path):
    from transformers import AutoTokenizer

    path = _write(tmp_path / "d.jsonl", _chat(" What is 2+2? ", "4"), {"text": "as is "})
    chat, text = read_records(path)
    assert render(text, PlainTokenizer()) == "as is "
    assert render(chat, PlainTokenizer()) == "User: What is 2+2?\n\nAssistant: 4"
    tokenizer = AutoTokenizer.from_pretrained(BASE)  # has a chat template (chat_template.jinja)
    assert render(chat, tokenizer) == ("<|im_start|>user\n What is 2+2? <|im_end|>\n"
                                       "<|im_start|>assistant\n4<|im_end|>\n")

    class Picky:
        chat_template = "x"

        @staticmethod
        def apply_chat_template(messages, **kwargs):
            raise ValueError("roles must alternate")

    with pytest.raises(DataError) as info:
        render(chat, Picky(), path)
    assert str(info.value) == (f"{path}, line 1: the checkpoint's chat template refused its "
                               "messages (ValueError: roles must alternate)")


def test_load_data_reports_the_rendering(tmp_path):
    lines = [{"text": f"text {i}"} for i in range(20)] + [_chat(f"q{i}", f"a{i}")
                                                           for i in range(20)]
    path = _write(tmp_path / "d.jsonl", *lines)
    train, held, facts = load_data(path, 0.25, PlainTokenizer())
    assert facts == {"records": 40, "text_records": 20, "messages_records": 20,
                     "messages_rendering": "plain"}
    assert sorted(train.lines + held.lines) == list(range(1, 41)) and held.lines
    assert all(t.startswith(("text ", "User: q")) for t in train.texts + held.texts)


# ------------------------------------------------------------------------------ selection


class Routing(torch.nn.Module):
    """A stand-in model whose router gives every token id a fixed distribution per layer:
    token 0 ("A") and 1 ("B"); logits are log-probabilities, so softmax returns them."""

    PROBS = {  # per MoE layer: token id -> router probabilities over 4 experts
        0: {0: [0.5, 0.3, 0.1, 0.1], 1: [0.1, 0.2, 0.6, 0.1]},
        1: {0: [0.1, 0.1, 0.4, 0.4], 1: [0.1, 0.1, 0.4, 0.4]},
    }

    def __init__(self, norm_topk_prob: bool):
        super().__init__()
        self.config = SimpleNamespace(norm_topk_prob=norm_topk_prob)

    def forward(self, input_ids, output_router_logits=True):
        flat = input_ids.reshape(-1).tolist()
        router = tuple(torch.tensor([self.PROBS[layer][t] for t in flat]).log()
                       for layer in sorted(self.PROBS))
        logits = torch.zeros(*input_ids.shape, 8)
        return SimpleNamespace(logits=logits, router_logits=router)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_selection_on_a_hand_made_routing(norm_topk_prob):
    """Three A tokens and one B, top-2 of 4 experts. Layer 0: A picks experts 0 (0.5) and
    1 (0.3), B picks 2 (0.6) and 1 (0.2).

    - token selection ratio: counts 3, 4, 1, 0 of 8 picks = 0.375, 0.5, 0.125, 0;
    - gate score: 3 x 0.5 = 1.5, 3 x 0.3 + 0.2 = 1.1, 0.6, 0 of 3.2 = 0.46875, 0.34375,
      0.1875, 0 (renormalizing the top-2 weights changes nothing: A's and B's both sum to 0.8,
      so every weight is scaled by the same 1.25).

    With top-p 0.5 the token ratio stops at expert 1 alone (0.5 reaches it), the gate score
    needs 0 and 1 (0.46875, then 0.8125); with top-p 0.9 both need 0, 1 and 2. Layer 1 sends
    every token to experts 2 and 3 equally: both scores are 0, 0, 0.5, 0.5 and top-p 0.5 keeps
    the lower id of the tie."""
    stream = torch.tensor([0, 0, 0, 1, 0])  # one window of 4 tokens (the last is a target)
    stats = run_windows(Routing(norm_topk_prob), stream, seq_len=4, batch=1, max_tokens=4,
                        top_k=2)
    assert stats.tokens == 4 and stats.counts.tolist() == [[3, 4, 1, 0], [0, 0, 4, 4]]
    token = expert_scores(stats, [0, 1], "token")
    gate = expert_scores(stats, [0, 1], "gate")
    assert token.values[0] == (0.375, 0.5, 0.125, 0.0)
    assert gate.values[0] == pytest.approx((1.5 / 3.2, 1.1 / 3.2, 0.6 / 3.2, 0.0))
    assert token.values[1] == (0.0, 0.0, 0.5, 0.5)
    assert gate.values[1] == pytest.approx((0.0, 0.0, 0.5, 0.5))
    for scores in (token, gate):
        assert all(math.isclose(sum(v), 1.0) for v in scores.values.values())
    assert select_experts(token, 0.5) == {0: (1,), 1: (2,)}
    assert select_experts(gate, 0.5) == {0: (0, 1), 1: (2,)}
    assert select_experts(token, 0.9) == select_experts(gate, 0.9) == {0: (0, 1, 2),
                                                                       1: (2, 3)}
    assert select_experts(token, 1.0)[0] == (0, 1, 2)  # an expert no token picked never is
    with pytest.raises(ValueError, match="--score must be one of token, gate"):
        expert_scores(stats, [0, 1], "ratio")
    with pytest.raises(ValueError, match=r"--top-p must be in \(0, 1\]"):
        select_experts(token, 0)


# ------------------------------------------------------------------------------ training


def _data_file(path: Path) -> Path:
    """48 short records of one made-up task, half plain text and half chat turns."""
    words = ["amber", "birch", "cedar", "delta", "ember", "fjord", "grove", "heron"]
    lines = []
    for i in range(48):
        a, b = words[i % 8], words[(i * 3 + 1) % 8]
        if i % 2:
            lines.append({"text": f"swap({a}, {b}) = ({b}, {a})\nswap({b}, {a}) = ({a}, {b})"})
        else:
            lines.append(_chat(f"swap({a}, {b})", f"({b}, {a})", id=f"S{i}"))
    return _write(path, *lines)


@pytest.mark.slow  # about 15 s of CPU on 2 cores
def test_train_on_a_data_file(tmp_path):
    data = _data_file(tmp_path / "swaps.jsonl")
    out = tmp_path / "adapter"
    assert main(["train", str(BASE), "--data", str(data), "--out", str(out),
                 "--held-out", "0.25", "--score", "gate", "--steps", "8", "--batch", "4",
                 "--seq-len", "32", "--lr", "0.01", "--warmup", "2", "--score-tokens", "512",
                 "--eval-tokens", "256"]) == 0
    info = MoeModelInfo.from_model_path(BASE)
    adapter = load_adapter(out, info, model_path=BASE)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["experts"] == {str(k): list(v) for k, v in adapter.experts.items()}
    assert sorted(adapter.experts) == list(info.moe_layers)  # top-p keeps >= 1 per layer
    assert metrics["domain"] == "swaps" and metrics["spec"]["data"] == str(data)
    assert metrics["spec"]["score"] == "gate" and metrics["steps_run"] == 8
    corpus = metrics["corpus"]
    assert corpus["unit"] == "records" and corpus["messages_rendering"] == "chat template"
    assert corpus["records"] == corpus["train_records"] + corpus["held_out_records"] == 48
    assert corpus["held_out_records"] >= 1 and corpus["text_records"] == 24
    assert metrics["held_out_loss_adapter"] < metrics["held_out_loss_base"]
    first, last = metrics["train_loss_first_last"]
    assert last < first
    card = (out / "README.md").read_text()
    assert f"{corpus['train_records']} training records" in card
    assert f"{metrics['held_out_loss_adapter']:.4f}" in card
