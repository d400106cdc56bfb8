"""Generate a small random MoE checkpoint in Hugging Face format, offline and deterministically.

    python -m sglang_eaas.tools.make_tiny_model OUT --arch qwen3_moe|mixtral
        [--preset tiny|tiny-top4|bench] [--layers N] [--experts N] [--top-k N] [--hidden N]
        [--moe-intermediate N] [--heads N] [--kv-heads N] [--vocab-size N]
        [--dtype float32|bfloat16] [--seed N]

OUT receives config.json, model.safetensors (per-expert tensor names, as real checkpoints),
generation_config.json and a byte-level BPE tokenizer with a ChatML chat template. The same
arguments give the same bytes. Presets: ``tiny`` builds in seconds, for tests; ``tiny-top4`` (top-4
of 16 experts) too, for tests of sums over more than two experts; ``bench`` makes the routed
experts dominate compute on a CPU, for benchmarks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sglang_eaas.tools.tiny_tokenizer import EOS, MIN_VOCAB, build_tokenizer

ARCHES = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a generated checkpoint."""

    arch: str = "qwen3_moe"
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    hidden: int = 64
    moe_intermediate: int = 32
    heads: int = 4
    kv_heads: int = 2
    vocab_size: int = 512
    dtype: str = "float32"
    seed: int = 0

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option to fix when the sizes cannot form a model."""
        if self.arch not in ARCHES:
            raise ValueError(f"--arch must be one of {', '.join(ARCHES)}, got {self.arch!r}")
        for name in ("layers", "experts", "top_k", "hidden", "moe_intermediate", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.kv_heads < 1:
            raise ValueError("--kv-heads must be >= 1")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k ({self.top_k}) cannot exceed --experts ({self.experts})")
        if self.hidden % self.heads:
            raise ValueError(f"--heads ({self.heads}) must divide --hidden ({self.hidden})")
        if self.heads % self.kv_heads:
            raise ValueError(f"--kv-heads ({self.kv_heads}) must divide --heads ({self.heads})")
        if (self.hidden // self.heads) % 2:
            raise ValueError("--hidden / --heads (the head dim) must be even for rotary embeddings")
        if self.vocab_size < MIN_VOCAB:
            raise ValueError(f"--vocab-size must be >= {MIN_VOCAB} (256 bytes + special tokens)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")


PRESETS = {
    "tiny": ModelSpec(),
    # Top-4 of 16 experts over 4 layers: a token's partial sums split across 3+ expert servers,
    # so the order of additions is exercised (with top-2, a + 0 = a makes it exact anyway).
    "tiny-top4": ModelSpec(layers=4, experts=16, top_k=4, hidden=128, moe_intermediate=64),
    # Experts dominate: per token and layer the routed experts do top_k * 3 * hidden *
    # moe_intermediate = 6.3M multiply-adds, attention projections about 3.1M.
    "bench": ModelSpec(
        layers=4, experts=32, top_k=4, hidden=1024, moe_intermediate=512, heads=8, kv_heads=4,
        dtype="bfloat16",
    ),
}


def hf_config(spec: ModelSpec, vocab_size: int, eos_id: int):
    """The transformers config object for ``spec``."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        num_experts_per_tok=spec.top_k,
    )
    if spec.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            head_dim=spec.hidden // spec.heads,
            intermediate_size=2 * spec.moe_intermediate,
            moe_intermediate_size=spec.moe_intermediate,
            num_experts=spec.experts,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    from transformers import MixtralConfig

    return MixtralConfig(
        **common, intermediate_size=spec.moe_intermediate, num_local_experts=spec.experts
    )


def randomize_(model, seed: int) -> None:
    """Fill every matrix with N(0, (0.64 / sqrt(fan_in))^2), one generator per parameter name.

    Seeding by name makes the values independent of module construction order; the scale keeps
    logits well separated (no near-ties that would make greedy decoding fragile).
    """
    import torch

    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() < 2:
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.copy_(values * (0.64 / param.shape[-1] ** 0.5))


def make_model(out: Path, spec: ModelSpec, log=print) -> Path:
    """Write the checkpoint for ``spec`` into ``out``; returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec.validate()
    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    log(f"[1/3] tokenizer (byte-level BPE, vocab <= {spec.vocab_size})")
    tokenizer = build_tokenizer(spec.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = hf_config(spec, len(tokenizer), eos_id)
    log(f"[2/3] {spec.arch} weights: {spec.layers} layers x {spec.experts} experts "
        f"(top-{spec.top_k})")
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    randomize_(model, spec.seed)
    log(f"[3/3] saving to {out}")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id).save_pretrained(
        out
    )
    (out / "eaas_model_spec.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    params = sum(p.numel() for p in model.parameters())
    log(f"done: {params / 1e6:.2f}M parameters ({spec.dtype}) in {time.monotonic() - start:.1f}s")
    return out


def cached_model(cache_dir: Path, spec: ModelSpec, log=print) -> Path:
    """Path of the checkpoint for ``spec`` under ``cache_dir``, generated on first use.

    The folder name carries a digest of the spec; generation goes to a temporary folder that is
    renamed at the end, so an interrupted run never leaves a half-written model behind, and
    under a lock on the folder's name, so processes asking at once (test workers) generate it
    once and a model in use is never replaced.
    """
    import fcntl

    digest = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir / f"{spec.arch}-{digest}"
    if not (path / "eaas_model_spec.json").exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(cache_dir / f".{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (path / "eaas_model_spec.json").exists():
                tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=cache_dir))
                make_model(tmp, spec, log=log)
                shutil.rmtree(path, ignore_errors=True)  # no marker: not a whole model
                tmp.rename(path)
    return path


def parse_args(argv: list[str] | None = None) -> tuple[Path, ModelSpec]:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_eaas.tools.make_tiny_model",
        description="Generate a small random MoE checkpoint (HF format, safetensors, offline "
        "tokenizer). Same arguments, same bytes.",
    )
    parser.add_argument("out", type=Path, help="output directory (created if missing)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                        help="starting sizes: 'tiny' (seconds, tests), 'tiny-top4' (top-4 of 16 "
                        "experts, tests) or 'bench' (experts dominate CPU compute); options "
                        "below override single values")
    parser.add_argument("--arch", choices=ARCHES, help="model family (default qwen3_moe)")
    parser.add_argument("--layers", type=int, help="number of decoder layers, all MoE")
    parser.add_argument("--experts", type=int, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, help="experts per token")
    parser.add_argument("--hidden", type=int, help="hidden size")
    parser.add_argument("--moe-intermediate", type=int, help="intermediate size of each expert")
    parser.add_argument("--heads", type=int, help="attention heads (must divide --hidden)")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (must divide --heads)")
    parser.add_argument("--vocab-size", type=int, help=f"tokenizer vocabulary (>= {MIN_VOCAB})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="stored weight dtype")
    parser.add_argument("--seed", type=int, help="random seed (default 0)")
    args = parser.parse_args(argv)
    overrides = {
        key: value
        for key, value in vars(args).items()
        if key not in ("out", "preset") and value is not None
    }
    spec = replace(PRESETS[args.preset], **overrides)
    try:
        spec.validate()
    except ValueError as exc:
        parser.error(str(exc))
    return args.out, spec


def main(argv: list[str] | None = None) -> int:
    out, spec = parse_args(argv)
    make_model(out, spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
