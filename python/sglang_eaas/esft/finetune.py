"""ESFT training: fine-tune only a domain's most relevant routed experts of a checkpoint.

1. The training text is split: a domain's files (``domains.split_domain``) or the records of a
   JSON-lines file in ESFT's data format (``data.load_data``); both splits are encoded with the
   base model's own tokenizer (``training.token_stream``). From here on both sources take the
   same path.
2. The base model (transformers, float32) runs over the first ``score_tokens`` of the training
   split; ``relevance`` scores the experts and picks, per MoE layer, the top ones reaching
   ``top_p``. Its loss on the held-out split is measured on the same run of windows as later.
3. Only those experts' weights train (next-token loss, AdamW, warmup then cosine to a tenth);
   everything else is frozen, the routers too, so tokens are routed as by the base model. The
   fused expert parameters' gradients are masked to the chosen rows, and with no weight decay
   every other row stays bit for bit the base's (checked before writing).
4. The chosen experts are written as an adapter in the checkpoint's dtype (``write_adapter``),
   read back with ``load_adapter`` (checked against the base checkpoint), put into a freshly
   loaded base model (``hf.apply_adapter``) and evaluated on the held-out split:
   ``metrics.json`` and ``README.md`` record both losses, and both on the base model's own
   held-out split (the stdlib sources ``train_tiny_moe`` held out), where an adapter should
   cost little.

Same arguments, torch version, thread count and domain files (or data file) give the same bytes.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang_eaas.esft.adapter import load_adapter, write_adapter
from sglang_eaas.esft.data import DEFAULT_HELD_OUT, load_data
from sglang_eaas.esft.domains import get_domain, split_domain
from sglang_eaas.esft.hf import apply_adapter, routed_experts
from sglang_eaas.esft.relevance import SCORES, expert_scores, select_experts
from sglang_eaas.model_info import MoeModelInfo
from sglang_eaas.corpus import HELD_OUT_MOD, read_text, split_corpus, stdlib_root
from sglang_eaas.training import WindowBatches, cosine_lr, out_of_time, run_windows, token_stream

DEFAULT_TOP_P = 0.2  # ESFT's own default; 2-3 of 32 experts per layer on tiny-moe-stdlib


@dataclass(frozen=True)
class EsftSpec:
    """What to train and how (every field is a flag of ``tools.esft train``): the text is a
    ``domain`` or a ``data`` file, exactly one of them."""

    domain: str | None = None
    data: str | None = None
    held_out: float = DEFAULT_HELD_OUT
    steps: int = 300
    top_p: float = DEFAULT_TOP_P
    score: str = "token"
    seed: int = 0
    lr: float = 2e-3
    warmup: int = 20
    batch: int = 16
    seq_len: int = 256
    max_train_mb: float = 3.0
    score_tokens: int = 32768
    eval_tokens: int = 65536

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag to fix."""
        if (self.domain is None) == (self.data is None):
            raise ValueError("give exactly one of --domain and --data")
        if not 0 < self.held_out < 1:
            raise ValueError("--held-out must be in (0, 1)")
        for name in ("steps", "batch", "seq_len", "score_tokens", "eval_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.score not in SCORES:
            raise ValueError(f"--score must be one of {', '.join(SCORES)}")
        if not 0 < self.top_p <= 1:
            raise ValueError("--top-p must be in (0, 1]")
        if not self.lr > 0:
            raise ValueError("--lr must be > 0")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        if self.max_train_mb < 0:
            raise ValueError("--max-train-mb must be >= 0 (0 means the whole domain)")


def _log(line: str) -> None:
    print(line, flush=True)


def _load(model_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def _freeze_all_but(model, chosen: dict[int, tuple[int, ...]]) -> list:
    """Freeze every parameter, then let the chosen experts' rows of their layers' fused expert
    parameters train (gradients of the other rows zeroed); returns those parameters."""
    import torch

    for p in model.parameters():
        p.requires_grad_(False)
    trainable = []
    for layer, ids in chosen.items():
        experts = routed_experts(model, layer)
        mask = torch.zeros(experts.gate_up_proj.shape[0], 1, 1)
        mask[list(ids)] = 1.0
        for p in (experts.gate_up_proj, experts.down_proj):
            p.requires_grad_(True)
            p.register_hook(lambda grad, mask=mask: grad * mask)
            trainable.append(p)
    return trainable


@dataclass(frozen=True)
class Corpus:
    """The training text of either source, as the rest of ``train_adapter`` uses it: ``name``
    and ``description`` for the adapter's metadata and card, the two splits' texts, and
    ``facts`` for metrics.json's ``corpus`` (``unit``: what a text is, files or records)."""

    name: str
    description: str
    train: tuple[str, ...]
    held: tuple[str, ...]
    facts: dict


def load_corpus(spec: EsftSpec, tokenizer) -> Corpus:
    """``spec``'s training text, split; ``DomainError`` / ``DataError`` when it cannot be."""
    if spec.domain is not None:
        domain = get_domain(spec.domain)
        train, held = split_domain(domain, spec.max_train_mb)
        return Corpus(domain.name, domain.description, train.texts, held.texts, {
            "unit": "files", "train_files": len(train.files), "held_out_files": len(held.files),
            "train_characters": train.chars,
            "held_out_rule": f"crc32(relative path) % {HELD_OUT_MOD} == 0"})
    path = Path(spec.data)
    train, held, facts = load_data(path, spec.held_out, tokenizer)
    rendering = ("with the checkpoint's chat template" if facts["messages_rendering"]
                 == "chat template" else "joined plainly (the checkpoint has no chat template)")
    description = (f"the {facts['records']} records of {path} in ESFT's JSON-lines format "
                   f"({facts['text_records']} text, {facts['messages_records']} messages "
                   f"rendered {rendering})")
    return Corpus(path.stem, description, train.texts, held.texts, {
        "unit": "records", "data_file": str(path.resolve()), **facts,
        "train_records": len(train.lines), "held_out_records": len(held.lines),
        "train_characters": train.chars,
        "held_out_rule": f"the first 8 bytes of sha256(the record's canonical JSON) / 2**64 "
                         f"< {spec.held_out}"})


def _chosen_weights(model, info: MoeModelInfo, chosen, dtype) -> dict:
    """``{layer: {expert: (gate, up, down)}}`` of the trained experts, in ``dtype``."""
    inter = info.moe_intermediate_size
    out = {}
    for layer, ids in chosen.items():
        experts = routed_experts(model, layer)
        out[layer] = {}
        for e in ids:
            w13 = experts.gate_up_proj[e].detach()
            out[layer][e] = (w13[:inter].to(dtype), w13[inter:].to(dtype),
                             experts.down_proj[e].detach().to(dtype))
    return out


def train_adapter(model_path: Path, out: Path, spec: EsftSpec, threads: int = 2,
                  minutes: float = 0.0, log=_log, command: str | None = None) -> dict:
    """Train the adapter of ``spec.domain`` or ``spec.data`` and write it, with metrics.json and
    README.md, to ``out``; returns the metrics."""
    import torch

    spec.validate()
    start = time.monotonic()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(spec.seed)
    model_path = Path(model_path)
    info = MoeModelInfo.from_model_path(model_path)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    corpus = load_corpus(spec, tokenizer)
    unit = corpus.facts["unit"]
    train_ids = token_stream(tokenizer, list(corpus.train))
    held_ids = token_stream(tokenizer, list(corpus.held))
    log(f"[1/5] {'domain' if spec.domain else 'data'} {corpus.name}: {len(corpus.train)} "
        f"train {unit} ({corpus.facts['train_characters'] / 1e6:.2f} M characters, "
        f"{train_ids.numel()} tokens), {len(corpus.held)} held-out {unit} "
        f"({held_ids.numel()} tokens)")
    n_windows = (train_ids.numel() - 1) // spec.seq_len
    if n_windows < spec.batch:
        raise ValueError("the training split has fewer --seq-len windows than --batch")

    # What the adapter does to the base model's own domain: the stdlib's held-out sources.
    root = stdlib_root()
    stdlib_ids = token_stream(tokenizer, [read_text(root, f) for f in split_corpus(root, 0)[1]])

    model = _load(model_path)
    base_eval = run_windows(model, held_ids, spec.seq_len, spec.batch, spec.eval_tokens,
                            info.top_k)
    stdlib_base = run_windows(model, stdlib_ids, spec.seq_len, spec.batch, spec.eval_tokens,
                              info.top_k)
    sample = run_windows(model, train_ids, spec.seq_len, spec.batch, spec.score_tokens,
                         info.top_k)
    scores = expert_scores(sample, info.moe_layers, spec.score)
    chosen = select_experts(scores, spec.top_p)
    count = sum(len(ids) for ids in chosen.values())
    log(f"[2/5] base model: held-out loss {base_eval.loss:.4f}; {spec.score} scores over "
        f"{sample.tokens} tokens, top-p {spec.top_p}: {count} experts "
        + ", ".join(f"L{layer} {list(ids)}" for layer, ids in chosen.items()))

    base_rows = {layer: (routed_experts(model, layer).gate_up_proj.detach().clone(),
                         routed_experts(model, layer).down_proj.detach().clone())
                 for layer in chosen}
    trainable = _freeze_all_but(model, chosen)
    model.train()
    opt = torch.optim.AdamW(trainable, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    batches = WindowBatches(train_ids, spec.seq_len, spec.batch, spec.seed)
    steps_run, stopped_early, losses = 0, False, []
    params = count * 3 * info.hidden_size * info.moe_intermediate_size
    log(f"[3/5] training {count} experts ({params / 1e6:.2f}M parameters): {spec.steps} steps "
        f"of {spec.batch} x {spec.seq_len} tokens, {threads} threads")
    t0 = time.monotonic()
    for step in range(spec.steps):
        if out_of_time(t0, minutes, step, spec.steps, log):
            stopped_early = True
            break
        x = batches.next()
        lr = cosine_lr(spec.lr, spec.warmup, spec.steps, step)
        for group in opt.param_groups:
            group["lr"] = lr
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        steps_run = step + 1
        losses.append(loss.item())
        if step % 20 == 0 or step == spec.steps - 1:
            elapsed = time.monotonic() - t0
            log(f"step {step + 1}/{spec.steps}  loss {losses[-1]:.4f}  lr {lr:.2e}  "
                f"{steps_run * spec.batch * spec.seq_len / max(elapsed, 1e-9):.0f} tok/s  "
                f"{elapsed:.0f}s")
    train_seconds = time.monotonic() - t0

    for layer, (w13, w2) in base_rows.items():
        experts = routed_experts(model, layer)
        keep = [e for e in range(info.num_experts) if e not in chosen[layer]]
        assert torch.equal(experts.gate_up_proj.detach()[keep], w13[keep]), layer
        assert torch.equal(experts.down_proj.detach()[keep], w2[keep]), layer
    dtype = getattr(torch, info.dtype)
    write_adapter(out, info, _chosen_weights(model, info, chosen, dtype),
                  {"domain": corpus.name, "tool": "python -m sglang_eaas.tools.esft train"})
    adapter = load_adapter(out, info, model_path=model_path)
    log(f"[4/5] wrote {adapter.count} experts to {out}; evaluating the base model with them")
    tuned = _load(model_path)
    apply_adapter(tuned, info, adapter)
    tuned_eval = run_windows(tuned, held_ids, spec.seq_len, spec.batch, spec.eval_tokens,
                             info.top_k)
    stdlib_tuned = run_windows(tuned, stdlib_ids, spec.seq_len, spec.batch, spec.eval_tokens,
                               info.top_k)

    metrics = {
        "command": command,
        "domain": corpus.name,
        "domain_description": corpus.description,
        "base_model": str(model_path),
        "base_fingerprint": info.fingerprint(),
        "spec": asdict(spec),
        "threads": threads,
        "held_out_loss_base": round(base_eval.loss, 4),
        "held_out_loss_adapter": round(tuned_eval.loss, 4),
        "held_out_tokens": tuned_eval.tokens,
        "stdlib_held_out_loss_base": round(stdlib_base.loss, 4),
        "stdlib_held_out_loss_adapter": round(stdlib_tuned.loss, 4),
        "experts": {str(layer): list(ids) for layer, ids in adapter.experts.items()},
        "experts_per_layer": {str(layer): len(ids) for layer, ids in adapter.experts.items()},
        "experts_total": adapter.count,
        "experts_in_model": info.num_experts * len(info.moe_layers),
        "selected_scores": {str(layer): [round(scores.values[layer][e], 4) for e in ids]
                            for layer, ids in adapter.experts.items()},
        "score_sample_tokens": sample.tokens,
        "steps_run": steps_run,
        "stopped_early_by_minutes": stopped_early,
        "train_loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.monotonic() - start, 1),
        "adapter_bytes": (out / "adapter.safetensors").stat().st_size,
        "model_bytes": sum(p.stat().st_size for p in model_path.glob("*.safetensors")),
        "corpus": {
            **corpus.facts,
            "train_tokens": int(train_ids.numel()),
            "held_out_tokens": int(held_ids.numel()),
            "python": sys.version.split()[0],
        },
        "versions": {"torch": torch.__version__, "transformers": _version("transformers")},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    (out / "README.md").write_text(adapter_card(metrics))
    first, last = metrics["train_loss_first_last"]
    log(f"[5/5] held-out loss {metrics['held_out_loss_base']:.4f} (base) -> "
        f"{metrics['held_out_loss_adapter']:.4f} (adapter); training loss {first:.4f} (first "
        f"step) -> {last:.4f} (last); done in {time.monotonic() - start:.0f}s")
    return metrics


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def adapter_card(m: dict) -> str:
    """The adapter's README.md, every number from its metrics."""
    s, c = m["spec"], m["corpus"]
    unit = c.get("unit", "files")
    per_layer = ", ".join(f"layer {layer}: {ids}" for layer, ids in m["experts"].items())
    return f"""# ESFT adapter: {m['domain']}

An ESFT adapter (expert-specialized fine-tuning) of `{m['base_model']}` for the domain
**{m['domain']}**: {m['domain_description']}. Written by

    {m['command']}

(python/sglang_eaas/esft/finetune.py); every number here comes from its `metrics.json`.

- Experts replaced: {m['experts_total']} of {m['experts_in_model']} ({per_layer}), chosen by \
ESFT's {s['score']} score over {m['score_sample_tokens']} training tokens of the base model, \
top-p {s['top_p']}; nothing else was trained (routers frozen).
- Training: {m['steps_run']} steps of {s['batch']} x {s['seq_len']} tokens, AdamW lr {s['lr']} \
(warmup {s['warmup']}, cosine to a tenth), seed {s['seed']}, {m['threads']} threads: \
{m['train_seconds']:.0f} s. Corpus: {c['train_' + unit]} training {unit} \
({c['train_tokens']} tokens), {c['held_out_' + unit]} held-out {unit} ({c['held_out_tokens']} \
tokens); a {unit[:-1]} is held out when {c['held_out_rule']}.
- Held-out loss ({m['held_out_tokens']} tokens, weights as stored): base model \
**{m['held_out_loss_base']:.4f}**, with this adapter **{m['held_out_loss_adapter']:.4f}** \
nats/token. On the base model's own held-out stdlib sources: \
{m['stdlib_held_out_loss_base']:.4f} without, {m['stdlib_held_out_loss_adapter']:.4f} with it.
- Size: adapter.safetensors {m['adapter_bytes']} bytes, the base model's weights \
{m['model_bytes']} bytes.

Versions: torch {m['versions']['torch']}, transformers {m['versions']['transformers']}, \
Python {c['python']}. The same arguments, torch version, thread count and {unit} give the \
same bytes.
"""
