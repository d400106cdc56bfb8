"""Offline byte-level BPE tokenizer with a ChatML chat template, for generated checkpoints."""

from __future__ import annotations

EOS = "<|endoftext|>"
SPECIALS = (EOS, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A small fixed corpus: merges are learned from it, every other byte stays a single token.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny mixture of experts model used for tests.",
    "Expert parallelism routes tokens to experts; attention runs elsewhere.",
    "What is the capital of France? Tell me a story about a robot.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 ,.;:!?()[]{}<>+-*/=_'\"",
)
MIN_VOCAB = 256 + len(SPECIALS)


def build_tokenizer(vocab_size: int):
    """Train a deterministic byte-level BPE of ``vocab_size`` entries (at most) and wrap it."""
    return train_byte_level_bpe(list(_CORPUS) * 50, vocab_size)


def train_byte_level_bpe(texts: list[str], vocab_size: int, bos_token: str | None = None):
    """A byte-level BPE of ``vocab_size`` entries (at most) trained on ``texts``, as a
    transformers tokenizer: EOS = pad = ``<|endoftext|>``, ``bos_token`` (none by default),
    the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        additional_special_tokens=list(SPECIALS[1:]),
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
