"""Checks on incoming requests that SGLang 0.5.23 leaves to the scheduler, where they are fatal.

A prompt token id outside ``[0, vocab_size)`` makes the scheduler index past the embedding table
and the whole server dies with it. ``check_prompt_token_ids`` refuses such a prompt in the
tokenizer manager, in SGLang's own per-request validation step, so the ``ValueError`` takes the
path of SGLang's other input errors: HTTP 400 on ``/generate`` (single and batched ``input_ids``)
and on the OpenAI endpoints (``/v1/completions`` with a token-id prompt), and an exception from
``Engine.generate``. It applies with or without ``--eaas``.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Sequence


def out_of_vocab_message(input_ids: Sequence[Any], vocab_size: int) -> str | None:
    """One sentence naming the first id of ``input_ids`` outside ``[0, vocab_size)``, or None.

    Entries that are not integers are left to SGLang's own type checks.
    """
    for position, token_id in enumerate(input_ids):
        if isinstance(token_id, Integral) and not 0 <= token_id < vocab_size:
            return (
                f"Prompt token {position} has id {int(token_id)}, outside the model's "
                f"vocabulary of {vocab_size} ids (valid ids are 0 to {vocab_size - 1})."
            )
    return None


def check_prompt_token_ids(tokenizer_manager: Any, obj: Any, input_ids: Any, *args: Any,
                           **kwargs: Any) -> None:
    """BEFORE hook of ``TokenizerManager._validate_one_request(obj, input_ids)``.

    ``obj`` is one (sub-)request and ``input_ids`` its prompt ids: the caller's own ids, or the
    tokenizer's for a text prompt. A multimodal request is skipped: its processor, not the
    caller, wrote the ids, and some models use placeholder ids that the scheduler replaces.
    """
    if input_ids is None or obj.input_embeds is not None or obj.contains_mm_input():
        return
    message = out_of_vocab_message(input_ids, tokenizer_manager.model_config.vocab_size)
    if message is not None:
        raise ValueError(message)
