"""Training text from a JSON-lines file in ESFT's data format (``tools.esft train --data``).

deepseek-ai/ESFT keeps its datasets as ``datasets/train/<name>.jsonl``: one JSON object a line,
its text in ``"messages"``, a list of chat turns ``{"role": ..., "content": ...}``; other keys
(``"id"``, ``"dataset"``, ``"length"``) are ignored. A record may instead hold one plain
``"text"`` string. So each non-blank line is a JSON object with exactly one of

- ``"text"``: a non-empty string, trained on as it is;
- ``"messages"``: a non-empty list of objects, each with a non-empty string ``"role"`` and a
  string ``"content"`` (not all of them blank), rendered with the checkpoint's chat template
  when its tokenizer has one (``apply_chat_template``, no generation prompt), else joined
  plainly as ESFT's own prompt format does: ``"Role: content"`` turns (the role capitalized)
  separated by a blank line.

Every record is then one text, followed by the tokenizer's EOS (``training.token_stream``); the
loss is on every token (ESFT masks the user turns; here both splits are measured the same way).

The held-out split is by record: a record is held out when the first 8 bytes of the SHA-256 of
its canonical JSON (sorted keys, no spaces), read as a fraction of 2**64, fall below the held-out
share, so the split depends neither on line order nor on the other records and duplicates fall
on the same side. Each split is then put in the order of that hash (a fixed sample of the file,
as ``domains.py`` orders files), of which the expert scoring reads the first tokens.

Anything else is refused with ``DataError`` (a ``ValueError``): one sentence naming the file and,
for a bad record, its line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HELD_OUT = 0.1


class DataError(ValueError):
    """A data file that cannot be trained on; the message names the file (and line)."""


@dataclass(frozen=True)
class Record:
    """One usable line of a data file: either ``text`` or ``messages`` (role, content pairs)."""

    line: int  # 1-based
    key: str  # the canonical JSON of the line's object, the split's hash input
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None

    @property
    def kind(self) -> str:
        return "text" if self.text is not None else "messages"

    def fraction(self) -> float:
        """The record's place in [0, 1): the held-out split and the sample order."""
        digest = hashlib.sha256(self.key.encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def _bad(path: Path, line: int, problem: str) -> DataError:
    return DataError(f"{path}, line {line}: {problem}")


def _record(path: Path, line: int, obj) -> Record:
    if not isinstance(obj, dict):
        raise _bad(path, line, f"is a JSON {type(obj).__name__}, not an object with \"text\" "
                   "or \"messages\"")
    key = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    has_text, has_messages = "text" in obj, "messages" in obj
    if has_text and has_messages:
        raise _bad(path, line, "has both \"text\" and \"messages\"; keep one")
    if has_text:
        text = obj["text"]
        if not isinstance(text, str):
            raise _bad(path, line, f"\"text\" is a {type(text).__name__}, not a string")
        if not text.strip():
            raise _bad(path, line, "\"text\" is empty")
        return Record(line, key, text=text)
    if not has_messages:
        raise _bad(path, line, "has neither \"text\" nor \"messages\" (keys: "
                   + (", ".join(sorted(obj)) or "none") + ")")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise _bad(path, line, "\"messages\" is not a non-empty list of {\"role\", "
                   "\"content\"} objects")
    turns = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(path, line, f"message {i} is not an object with \"role\" and "
                       "\"content\"")
        for field in ("role", "content"):
            if field not in message:
                raise _bad(path, line, f"message {i} has no \"{field}\"")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role.strip():
            raise _bad(path, line, f"message {i}'s \"role\" is not a non-empty string")
        if not isinstance(content, str):
            raise _bad(path, line, f"message {i}'s \"content\" is not a string")
        turns.append((role, content))
    if not any(content.strip() for _, content in turns):
        raise _bad(path, line, "every message's \"content\" is empty")
    return Record(line, key, messages=tuple(turns))


def read_records(path: str | Path) -> list[Record]:
    """The records of ``path`` in line order (blank lines skipped); ``DataError`` on the first
    bad line, a missing or unreadable file, or a file without a record."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a JSON-lines file") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    records = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad(path, number, "is not UTF-8") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise _bad(path, number, f"is not JSON ({exc.msg} at column {exc.colno})") from None
        records.append(_record(path, number, obj))
    if not records:
        raise DataError(f"{path}: no records (every line is blank)")
    return records


def split_records(records: list[Record], held_out: float, path: str | Path = "the data"
                  ) -> tuple[list[Record], list[Record]]:
    """(train, held-out), each in hash order (module docstring); ``DataError`` when either is
    empty."""
    if not 0 < held_out < 1:
        raise DataError(f"--held-out must be in (0, 1), not {held_out}")
    ordered = sorted(records, key=lambda r: (r.fraction(), r.line))
    train = [r for r in ordered if r.fraction() >= held_out]
    held = [r for r in ordered if r.fraction() < held_out]
    if not train or not held:
        side = "held-out" if not held else "training"
        raise DataError(f"{path}: a held-out share of {held_out} leaves the {side} split of its "
                        f"{len(records)} records empty; give more records or another "
                        "--held-out")
    return train, held


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(record: Record, tokenizer, path: str | Path = "the data") -> str:
    """The record's training text (module docstring); a chat template that fails on it is
    refused naming the line."""
    if record.text is not None:
        return record.text
    messages = [{"role": role, "content": content} for role, content in record.messages]
    if has_chat_template(tokenizer):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=False)
        except Exception as exc:  # jinja's errors (e.g. a role the template raises on)
            raise _bad(Path(path), record.line, "the checkpoint's chat template refused its "
                       f"messages ({type(exc).__name__}: {exc})") from None
        return text
    return "\n\n".join(f"{role.strip().capitalize()}: {content.strip()}"
                       for role, content in record.messages)


@dataclass(frozen=True)
class DataSplit:
    """One split of a data file as rendered: its records' line numbers and texts."""

    lines: tuple[int, ...]
    texts: tuple[str, ...]

    @property
    def chars(self) -> int:
        return sum(len(t) for t in self.texts)


def load_data(path: str | Path, held_out: float, tokenizer) -> tuple[DataSplit, DataSplit, dict]:
    """(train, held-out, facts for metrics.json) of the data file ``path``."""
    records = read_records(path)
    train, held = split_records(records, held_out, path)

    def rendered(split):
        return DataSplit(tuple(r.line for r in split),
                         tuple(render(r, tokenizer, path) for r in split))

    kinds = [r.kind for r in records]
    facts = {
        "records": len(records),
        "text_records": kinds.count("text"),
        "messages_records": kinds.count("messages"),
        "messages_rendering": "chat template" if has_chat_template(tokenizer) else "plain",
    }
    return rendered(train), rendered(held), facts
