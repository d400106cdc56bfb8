"""bench_esft's adapters and prompts: the shipped trained adapters of the checkpoint plus random
ones made with ``python -m sglang_eaas.tools.esft random`` (called in-process), and prompts of
each adapter's domain, every prompt exactly the same number of tokens.

Prompts are cut from files the base model and the adapters did not train on: the openings (first
``tokens`` tokens) of held-out files (``crc32(path) % 20 == 0``) of each trained adapter's domain
(``esft/domains.py``); for the random adapters, successive ``tokens``-token pieces (up to
``STDLIB_PIECES`` per file) of the held-out stdlib sources of the base model's own corpus, a
different slice of them per adapter (the held-out stdlib has only a few dozen files). Files
shorter than ``tokens`` are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sglang_eaas.esft.domains import DOMAINS, domain_files, read_domain_text
from sglang_eaas.corpus import corpus_files, is_held_out, read_text, stdlib_root


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    domain: str  # a DOMAINS key, or "stdlib" (the base model's domain: random adapters)


def make_adapters(model: Path, out: Path, count: int, say) -> list[Adapter]:
    """The trained adapters (sorted by name), then random ones (seed 0, 1, ...: 2 experts per
    MoE layer for even seeds, 3 for odd ones, like the trained adapters' 1-3) up to ``count``.
    Random ones are written again each run (deterministic, a second each)."""
    from sglang_eaas.tools.esft import main as esft_tool

    trained = sorted(p for p in (model / "adapters").iterdir()
                     if (p / "expert_config.json").is_file())
    adapters = [Adapter(p.name, p, p.name) for p in trained][:count]
    seeds = range(count - len(adapters))
    if seeds:
        say(f"writing {len(seeds)} random adapters to {out} (python -m sglang_eaas.tools.esft "
            "random MODEL OUT --seed S --experts-per-layer 2|3)")
    for seed in seeds:
        path = out / f"random-{seed:02d}"
        argv = ["random", str(model), str(path), "--seed", str(seed), "--experts-per-layer",
                str(2 + seed % 2)]
        if esft_tool(argv) != 0:
            raise RuntimeError(f"python -m sglang_eaas.tools.esft {' '.join(argv)} failed")
        adapters.append(Adapter(path.name, path, "stdlib"))
    return adapters


STDLIB_PIECES = 8


def _pieces(texts, tokenizer, tokens: int, wanted: int, per_file: int = 1) -> list[list[int]]:
    """Up to ``wanted`` prompts: the first ``per_file`` whole ``tokens``-token pieces of each
    text, in order."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        out += [ids[i * tokens:(i + 1) * tokens] for i in range(min(per_file, len(ids) // tokens))]
        if len(out) >= wanted:
            break
    return out[:wanted]


def _domain_texts(name: str):
    domain = DOMAINS[name]
    for rel in (f for f in domain_files(domain) if is_held_out(f)):
        yield read_domain_text(domain, rel)


def prompts_per_adapter(adapters: list[Adapter], tokenizer, tokens: int,
                        per_adapter: int) -> dict[str, list[list[int]]]:
    """Adapter name -> ``per_adapter`` prompts of ``tokens`` token ids each."""
    root = stdlib_root()
    stdlib = [f for f in corpus_files(root) if is_held_out(f)]
    random_ones = [a for a in adapters if a.domain == "stdlib"]
    code = _pieces((read_text(root, f) for f in stdlib), tokenizer, tokens,
                   per_adapter * len(random_ones), STDLIB_PIECES)
    if len(code) < per_adapter * len(random_ones):
        raise RuntimeError(f"only {len(code)} pieces of {tokens} tokens in the held-out stdlib")
    out, used = {}, 0
    for a in adapters:
        if a.domain == "stdlib":
            out[a.name], used = code[used:used + per_adapter], used + per_adapter
        else:
            out[a.name] = _pieces(_domain_texts(a.domain), tokenizer, tokens, per_adapter)
            if len(out[a.name]) < per_adapter:
                raise RuntimeError(f"domain {a.domain}: fewer than {per_adapter} held-out files "
                                   f"of >= {tokens} tokens")
    return out
