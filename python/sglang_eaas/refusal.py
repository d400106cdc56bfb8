"""``Refusal``: a launch refused in one sentence naming the flag, without a traceback."""

from __future__ import annotations


class Refusal(SystemExit):
    """A launch refused in one sentence naming the flag. A command exits with it (status 1,
    ``error: SENTENCE`` on stderr, no traceback: SGLang's launcher lets a ``SystemExit``
    through); the offline engine (``sglang_eaas.Engine``) raises the sentence as a
    ``ValueError`` (before the launch) or a ``RuntimeError`` (during it)."""

    def __init__(self, sentence: str):
        super().__init__(f"error: {sentence}")
        self.sentence = sentence
