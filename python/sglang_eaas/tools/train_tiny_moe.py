"""Train a small Qwen3-MoE checkpoint with real routing, offline and deterministically.

    python -m sglang_eaas.tools.train_tiny_moe --out DIR [--preset small|tiny] [--steps N]
        [--minutes M] [--seed N] [--threads N] [--layers N] [--experts N] [--top-k N] ...

The corpus is the running interpreter's own standard library sources (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, without tests, encodings tables, site-packages and the
machine-specific ``_sysconfigdata*``), which every CPython installation has. Files are taken in
sorted order; a fixed 1 in 20 of them (by a CRC of the relative path) is held out for evaluation.
A byte-level BPE tokenizer is trained on the training files with ``tokenizers``; the model is
transformers' ``Qwen3MoeForCausalLM`` trained with its own router load-balancing loss
(``output_router_logits=True``, ``router_aux_loss_coef``). DIR receives the checkpoint
(safetensors, config.json, tokenizer files), ``metrics.json`` (held-out loss, per-layer expert-load
skew) and a ``README.md`` model card written from those metrics.

Same arguments, same torch version, same thread count and same stdlib sources give the same bytes
(``--minutes`` ends a run early only as a safety net and says so; ``--steps`` is the budget).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from sglang_eaas.corpus import HELD_OUT_MOD, read_text, split_corpus, stdlib_root
from sglang_eaas.tools.tiny_tokenizer import EOS, MIN_VOCAB, train_byte_level_bpe
from sglang_eaas.training import WindowBatches, cosine_lr, out_of_time, run_windows, token_stream



@dataclass(frozen=True)
class TrainSpec:
    """Model sizes and training hyper-parameters."""

    layers: int = 4
    experts: int = 32
    top_k: int = 4
    hidden: int = 256
    moe_intermediate: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 4096
    seq_len: int = 256
    batch: int = 16
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 50
    aux_coef: float = 0.01
    seed: int = 0
    max_corpus_mb: float = 0.0  # 0: the whole corpus
    eval_tokens: int = 131072

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option to fix."""
        for name in ("layers", "experts", "top_k", "hidden", "moe_intermediate", "heads",
                     "kv_heads", "head_dim", "seq_len", "batch", "steps", "eval_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k ({self.top_k}) cannot exceed --experts ({self.experts})")
        if self.heads % self.kv_heads:
            raise ValueError(f"--kv-heads ({self.kv_heads}) must divide --heads ({self.heads})")
        if self.head_dim % 2:
            raise ValueError("--head-dim must be even for rotary embeddings")
        if self.vocab_size < MIN_VOCAB:
            raise ValueError(f"--vocab-size must be >= {MIN_VOCAB} "
                             "(256 bytes + special tokens)")
        if not self.lr > 0:
            raise ValueError("--lr must be > 0")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        if self.aux_coef < 0:
            raise ValueError("--aux-coef must be >= 0")
        if self.max_corpus_mb < 0:
            raise ValueError("--max-corpus-mb must be >= 0 (0 means the whole corpus)")


PRESETS = {
    # The committed checkpoint (models/tiny-moe-stdlib): about 9 M parameters, bfloat16 on disk.
    "small": TrainSpec(),
    # Seconds: for tests of the script itself (determinism, files written).
    "tiny": TrainSpec(layers=2, experts=4, top_k=2, hidden=32, moe_intermediate=16, heads=2,
                      kv_heads=1, head_dim=16, vocab_size=300, seq_len=32, batch=4, steps=3,
                      warmup=1, max_corpus_mb=0.05, eval_tokens=256),
}


# ------------------------------------------------------------------------------------ tokenizer

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE of ``vocab_size`` entries trained on ``texts``, as a transformers tokenizer
    (EOS = BOS = pad = ``<|endoftext|>``, ChatML template)."""
    return train_byte_level_bpe(texts, vocab_size, bos_token=EOS)


# ---------------------------------------------------------------------------------------- model

def hf_config(spec: TrainSpec, vocab_size: int, eos_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=4 * spec.moe_intermediate,
        moe_intermediate_size=spec.moe_intermediate,
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        output_router_logits=False,  # as saved; training passes it per call
        router_aux_loss_coef=spec.aux_coef,
    )


def lr_at(spec: TrainSpec, step: int) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    return cosine_lr(spec.lr, spec.warmup, spec.steps, step)


def evaluate(model, stream, spec: TrainSpec) -> dict:
    """Mean next-token loss over held-out windows and tokens routed to each (layer, expert)."""
    stats = run_windows(model, stream, spec.seq_len, spec.batch, spec.eval_tokens, spec.top_k)
    counts = stats.counts.float()
    mean = counts.mean(dim=1)
    skew = (counts.max(dim=1).values / mean).tolist()
    return {
        "held_out_loss": stats.loss,
        "held_out_tokens": stats.tokens,
        "expert_load_skew_max_over_mean": [round(s, 4) for s in skew],
        "expert_load_min_over_mean": [
            round(v, 4) for v in (counts.min(dim=1).values / mean).tolist()],
        "experts_without_tokens": (stats.counts == 0).sum(dim=1).tolist(),
        "expert_token_counts": stats.counts.tolist(),
    }


def _log(line: str) -> None:
    print(line, flush=True)


def train(out: Path, spec: TrainSpec, threads: int, minutes: float, log=_log,
          command: str | None = None) -> dict:
    """Train and write the checkpoint, metrics.json and README.md into ``out``; returns metrics."""
    import torch
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    spec.validate()
    start = time.monotonic()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(spec.seed)

    root = stdlib_root()
    train_files, held_files = split_corpus(root, spec.max_corpus_mb)
    train_texts = [read_text(root, f) for f in train_files]
    held_texts = [read_text(root, f) for f in held_files]
    train_bytes = sum(len(t.encode()) for t in train_texts)
    log(f"[1/4] corpus: {len(train_files)} train files ({train_bytes / 1e6:.1f} MB), "
        f"{len(held_files)} held-out files, from {root}")
    tokenizer = train_tokenizer(train_texts, spec.vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    train_ids = token_stream(tokenizer, train_texts)
    held_ids = token_stream(tokenizer, held_texts)
    log(f"[2/4] tokenizer: {len(tokenizer)} entries; {train_ids.numel()} train tokens, "
        f"{held_ids.numel()} held-out tokens")
    n_windows = (train_ids.numel() - 1) // spec.seq_len
    if n_windows < spec.batch:
        raise ValueError("the training split has fewer --seq-len windows than --batch")

    config = hf_config(spec, len(tokenizer), eos_id)
    model = Qwen3MoeForCausalLM(config).float()
    model.train()
    params = sum(p.numel() for p in model.parameters())
    log(f"[3/4] Qwen3-MoE: {spec.layers} layers x {spec.experts} experts (top-{spec.top_k}), "
        f"hidden {spec.hidden}, {params / 1e6:.2f}M parameters; {spec.steps} steps of "
        f"{spec.batch} x {spec.seq_len} tokens, {threads} threads")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    batches = WindowBatches(train_ids, spec.seq_len, spec.batch, spec.seed)
    t0 = time.monotonic()
    done_tokens = 0
    stopped_early = False
    steps_run = 0
    for step in range(spec.steps):
        if out_of_time(t0, minutes, step, spec.steps, log):
            stopped_early = True
            break
        x = batches.next()
        for group in opt.param_groups:
            group["lr"] = lr_at(spec, step)
        out_ = model(input_ids=x[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(
            out_.logits.reshape(-1, out_.logits.shape[-1]), x[:, 1:].reshape(-1))
        loss = ce + spec.aux_coef * out_.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_run = step + 1
        done_tokens += spec.batch * spec.seq_len
        if step % 25 == 0 or step == spec.steps - 1:
            elapsed = time.monotonic() - t0
            log(f"step {step + 1}/{spec.steps}  loss {ce.item():.4f}"
                f"  aux {out_.aux_loss.item():.4f}  lr {lr_at(spec, step):.2e}  "
                f"{done_tokens / max(elapsed, 1e-9):.0f} tok/s  {elapsed:.0f}s")
    train_seconds = time.monotonic() - t0

    # The checkpoint is stored in bfloat16; evaluate exactly those weights (in float32 math).
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    log("[4/4] evaluating on the held-out files")
    metrics = evaluate(model, held_ids, spec)
    metrics.update({
        "command": command,
        "spec": asdict(spec),
        "threads": threads,
        "steps_run": steps_run,
        "stopped_early_by_minutes": stopped_early,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.monotonic() - start, 1),
        "parameters": params,
        "log_vocab": round(math.log(len(tokenizer)), 4),
        "corpus": {
            "source": "CPython standard library *.py sources (sysconfig stdlib path)",
            "python": sys.version.split()[0],
            "train_files": len(train_files),
            "held_out_files": len(held_files),
            "train_tokens": int(train_ids.numel()),
            "held_out_tokens": int(held_ids.numel()),
            "held_out_rule": f"crc32(relative path) % {HELD_OUT_MOD} == 0",
        },
        "versions": {"torch": torch.__version__, "transformers": _version("transformers"),
                     "tokenizers": _version("tokenizers")},
    })
    log(f"held-out loss {metrics['held_out_loss']:.4f} (log vocab {metrics['log_vocab']:.2f}); "
        "expert-load max/mean per layer "
        + ", ".join(f"{s:.2f}" for s in metrics["expert_load_skew_max_over_mean"]))

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id).save_pretrained(
        out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "README.md").write_text(model_card(metrics))
    log(f"done: wrote {out} in {time.monotonic() - start:.0f}s")
    return metrics


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def model_card(m: dict) -> str:
    s = m["spec"]
    c = m["corpus"]
    skew = ", ".join(f"{v:.2f}" for v in m["expert_load_skew_max_over_mean"])
    low = ", ".join(f"{v:.2f}" for v in m["expert_load_min_over_mean"])
    idle = ", ".join(str(v) for v in m["experts_without_tokens"])
    cmd = m["command"]
    return f"""# tiny-moe-stdlib

A small Qwen3-MoE (`model_type` `qwen3_moe`) trained on the CPython {c['python']} standard
library sources, with learned (skewed) expert routing. Written by
`{cmd}` (python/sglang_eaas/tools/train_tiny_moe.py); every number here comes from its
`metrics.json`.

- Model: {s['layers']} layers, {s['experts']} experts per layer, top-{s['top_k']}, hidden \
{s['hidden']}, expert intermediate {s['moe_intermediate']}, {s['heads']}/{s['kv_heads']} heads \
of {s['head_dim']}, vocabulary {s['vocab_size']} (byte-level BPE trained on the same files), \
{m['parameters'] / 1e6:.2f} M parameters, stored in bfloat16.
- Corpus: {c['train_files']} training files ({c['train_tokens']} tokens) and \
{c['held_out_files']} held-out files ({c['held_out_tokens']} tokens); a file is held out when \
{c['held_out_rule']}.
- Training: {m['steps_run']} steps of {s['batch']} x {s['seq_len']} tokens, AdamW lr \
{s['lr']} (warmup {s['warmup']}, cosine to a tenth), router load-balancing loss coefficient \
{s['aux_coef']}, seed {s['seed']}, {m['threads']} threads: {m['train_seconds']:.0f} s.
- Held-out loss (bfloat16 weights, {m['held_out_tokens']} tokens): \
**{m['held_out_loss']:.4f}** nats/token (log vocab = {m['log_vocab']:.2f}).
- Expert load on the held-out tokens, layer 0..{s['layers'] - 1}: max/mean tokens per expert \
**{skew}**; min/mean {low}; experts given no token {idle}.

Versions: torch {m['versions']['torch']}, transformers {m['versions']['transformers']}, \
tokenizers {m['versions']['tokenizers']}. The same arguments, torch version, thread count and \
stdlib sources give the same bytes.
"""


# ------------------------------------------------------------------------------------------ CLI

def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        prog="python -m sglang_eaas.tools.train_tiny_moe",
        description="Train a small Qwen3-MoE checkpoint (HF format, safetensors, byte-level BPE "
        "tokenizer) on the Python standard library sources, with the router load-balancing "
        "loss. Deterministic for the same arguments, torch version and --threads.",
    )
    parser.add_argument("--out", type=Path, required=True,
                        help="output directory for the checkpoint, metrics.json and README.md")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small",
                        help="starting sizes: 'small' (the committed checkpoint, 12-19 min on "
                        "2 cores) or 'tiny' (seconds, for tests); options below override")
    parser.add_argument("--steps", type=int, help="optimizer steps (the training budget)")
    parser.add_argument("--minutes", type=float, default=0.0,
                        help="safety stop: end training after this many minutes even if --steps "
                        "are not done (breaks reproducibility; 0 = no limit, the default)")
    parser.add_argument("--seed", type=int, help="seed for initialization and batch order")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (default 2); bits are reproducible only for the same "
                        "count")
    parser.add_argument("--layers", type=int, help="decoder layers, all MoE")
    parser.add_argument("--experts", type=int, help="routed experts per layer")
    parser.add_argument("--top-k", type=int, help="experts per token")
    parser.add_argument("--hidden", type=int, help="hidden size")
    parser.add_argument("--moe-intermediate", type=int, help="intermediate size of each expert")
    parser.add_argument("--heads", type=int, help="attention heads")
    parser.add_argument("--kv-heads", type=int, help="key/value heads (must divide --heads)")
    parser.add_argument("--head-dim", type=int, help="size of one attention head (even)")
    parser.add_argument("--vocab-size", type=int,
                        help="BPE vocabulary size, special tokens included")
    parser.add_argument("--seq-len", type=int, help="tokens per training window")
    parser.add_argument("--batch", type=int, help="windows per step")
    parser.add_argument("--lr", type=float, help="peak AdamW learning rate")
    parser.add_argument("--warmup", type=int, help="linear warmup steps")
    parser.add_argument("--aux-coef", type=float,
                        help="router load-balancing loss coefficient (router_aux_loss_coef)")
    parser.add_argument("--max-corpus-mb", type=float,
                        help="use only the first N MB of training files in sorted order (and a "
                        "twentieth of that held out); 0 = the whole corpus")
    parser.add_argument("--eval-tokens", type=int, help="held-out tokens to evaluate at most")
    args = parser.parse_args(argv)
    names = {f.name for f in fields(TrainSpec)}
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    spec = replace(PRESETS[args.preset], **overrides)
    try:
        spec.validate()
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        if args.minutes < 0:
            raise ValueError("--minutes must be >= 0 (0 means no limit)")
    except ValueError as exc:
        parser.error(str(exc))
    return args, spec


def main(argv: list[str] | None = None) -> int:
    args, spec = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        argv = sys.argv[1:] if argv is None else argv
        train(args.out, spec, args.threads, args.minutes,
              command=" ".join(["python -m sglang_eaas.tools.train_tiny_moe", *argv]))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
