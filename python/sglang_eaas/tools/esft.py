"""ESFT adapters of a checkpoint: train one on a domain, make a random one, merge one in.

    python -m sglang_eaas.tools.esft train MODEL (--domain NAME | --data FILE.jsonl) --out DIR
        [--held-out SHARE] [--steps N] [--top-p P] [--score token|gate] [--seed N] [--threads N]
        [--lr LR] [--minutes M] ...
    python -m sglang_eaas.tools.esft random MODEL OUT [--seed N] [--experts-per-layer K]
        [--layers L,..] [--experts JSON] [--scale S]
    python -m sglang_eaas.tools.esft merge MODEL ADAPTER OUT
    python -m sglang_eaas.tools.esft check MODEL ADAPTER [--slot-budget N]

The adapter format and its checks are in ``esft/adapter.py`` (docs/esft.md, "Adapters").
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path

from sglang_eaas.esft.adapter import default_max_experts
from sglang_eaas.esft.data import DEFAULT_HELD_OUT
from sglang_eaas.esft.domains import DOMAINS, DomainError
from sglang_eaas.esft.edit import (
    DEFAULT_EXPERTS_PER_LAYER, DEFAULT_SCALE, choose_experts, merge, parse_experts,
    random_adapter,
)
from sglang_eaas.esft.finetune import EsftSpec
from sglang_eaas.esft.relevance import SCORES
from sglang_eaas.model_info import ModelError, MoeModelInfo

PROG = "python -m sglang_eaas.tools.esft"


def _train_parser(sub) -> None:
    d = EsftSpec()
    p = sub.add_parser(
        "train", help="ESFT: pick a domain's most relevant experts and fine-tune only them",
        description="Score every routed expert's relevance to a domain (a text domain of this "
        "machine, or a JSON-lines file in ESFT's data format) on the base model, keep "
        "per MoE layer the top experts whose normalized scores reach --top-p, fine-tune only "
        "their weights (routers and everything else frozen) and write the adapter, "
        "metrics.json (held-out loss with and without it, training loss) and README.md. "
        "Deterministic for the same arguments, torch version, --threads and domain or data "
        "files.")
    p.add_argument("model", type=Path, help="base checkpoint directory (Qwen3-MoE or Mixtral)")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--domain", choices=sorted(DOMAINS),
                      help="training text already on this machine: " + "; ".join(
                          f"{name}: {dom.description}" for name, dom in DOMAINS.items()))
    text.add_argument("--data", metavar="FILE.jsonl",
                      help="training text in ESFT's data format: one JSON object a line with "
                      "either \"text\" (a non-empty string) or \"messages\" (a list of "
                      "{\"role\", \"content\"} turns; other keys ignored). Messages are "
                      "rendered with the checkpoint's chat template when its tokenizer has one, "
                      "else joined plainly as ESFT's prompt format does (\"User: ...\" and "
                      "\"Assistant: ...\" turns separated by a blank line). A bad line is refused "
                      "naming it")
    p.add_argument("--held-out", type=float, default=DEFAULT_HELD_OUT, metavar="SHARE",
                   help="--data only: the share of records held out for the loss before and "
                   "after, chosen by a hash of each record (stable, independent of line order); "
                   f"each split needs at least one record (default {DEFAULT_HELD_OUT})")
    p.add_argument("--out", type=Path, required=True, help="adapter directory to write")
    p.add_argument("--steps", type=int, default=d.steps,
                   help=f"optimizer steps, the training budget (default {d.steps})")
    p.add_argument("--top-p", type=float, default=d.top_p,
                   help="per layer, keep the top experts until their normalized scores add up "
                   f"to this (ESFT's threshold; default {d.top_p})")
    p.add_argument("--score", choices=SCORES, default=d.score,
                   help="expert relevance: 'token' (ESFT's token selection ratio: share of "
                   "the tokens' top-k picks) or 'gate' (average gate score: share of the "
                   f"router weights); default {d.score}")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of the batch order (default {d.seed})")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads (default 2); bits are reproducible only for the same count")
    p.add_argument("--lr", type=float, default=d.lr,
                   help=f"peak AdamW learning rate, no weight decay (default {d.lr})")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help=f"linear warmup steps before the cosine decay (default {d.warmup})")
    p.add_argument("--batch", type=int, default=d.batch,
                   help=f"token windows per step (default {d.batch})")
    p.add_argument("--seq-len", type=int, default=d.seq_len,
                   help=f"tokens per window (default {d.seq_len})")
    p.add_argument("--max-train-mb", type=float, default=d.max_train_mb,
                   help="--domain only: read the domain's training files (in a fixed sampled "
                   "order) up to this many million characters, the held-out files up to a "
                   f"twentieth of it; 0 = all (default {d.max_train_mb}; --data reads every "
                   "record)")
    p.add_argument("--score-tokens", type=int, default=d.score_tokens,
                   help="training tokens the base model runs over to score the experts "
                   f"(default {d.score_tokens})")
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens,
                   help=f"held-out tokens evaluated at most (default {d.eval_tokens})")
    p.add_argument("--minutes", type=float, default=0.0,
                   help="safety stop: end training after this many minutes even if --steps are "
                   "not done (breaks reproducibility; 0 = no limit, the default)")


def _random_parser(sub) -> None:
    p = sub.add_parser(
        "random", help="a deterministic random adapter (noisy copies of base experts), for tests",
        description="Replace some routed experts by the base expert plus Gaussian noise of "
        "--scale times each tensor's standard deviation, stored in the base dtype. The same "
        "arguments give the same bytes.")
    p.add_argument("model", type=Path, help="base checkpoint directory")
    p.add_argument("out", type=Path, help="adapter directory to write")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the expert choice and the noise (default 0)")
    p.add_argument("--experts-per-layer", type=int, default=None,
                   help="experts replaced in each chosen layer, drawn by --seed (default "
                   f"{DEFAULT_EXPERTS_PER_LAYER}, or fewer where the model has under "
                   f"{4 * DEFAULT_EXPERTS_PER_LAYER} experts: at most a quarter of them, the most "
                   "SGLang's --eaas-esft-max-experts takes by default)")
    p.add_argument("--layers", help="comma-separated MoE layer ids to touch (default: all)")
    p.add_argument("--experts",
                   help="exactly which experts to replace, as JSON {\"<layer>\": [ids]}, e.g. "
                   "'{\"0\": [1, 2], \"2\": [5]}' (overrides --experts-per-layer and --layers; "
                   "a layer may be empty)")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                   help="noise standard deviation in units of each base tensor's (default "
                   f"{DEFAULT_SCALE}: large enough to change greedy continuations)")


def _merge_parser(sub) -> None:
    p = sub.add_parser(
        "merge", help="the base checkpoint with an adapter's experts merged in",
        description="Write a full checkpoint: the base's safetensors with the adapter's "
        "experts in place of the ones they replace (converted to the base dtype; every other "
        "tensor byte for byte) and its config, generation and tokenizer files. The adapter is "
        "checked first.")
    p.add_argument("model", type=Path, help="base checkpoint directory")
    p.add_argument("adapter", type=Path, help="adapter directory")
    p.add_argument("out", type=Path, help="directory for the merged checkpoint")


def _check_parser(sub) -> None:
    p = sub.add_parser("check", help="validate an adapter against its base checkpoint",
                       description="Run every check of load_adapter and print what the adapter "
                       "replaces, or the one problem found.")
    p.add_argument("model", type=Path, help="base checkpoint directory")
    p.add_argument("adapter", type=Path, help="adapter directory")
    p.add_argument("--slot-budget", type=int,
                   help="refuse layers replacing more experts than this (default: no limit)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="ESFT adapters (expert-specialized fine-tuning): a few routed "
        "experts per MoE layer replaced, in ESFT's format (expert_config.json + "
        "adapter.safetensors). See docs/esft.md.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_train_parser, _random_parser, _merge_parser, _check_parser):
        add(sub)
    return parser


def _run(args, argv: list[str]) -> None:
    if args.command == "train":
        from sglang_eaas.esft.finetune import train_adapter

        names = {f.name for f in fields(EsftSpec)}
        spec = EsftSpec(**{k: v for k, v in vars(args).items() if k in names})
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        if args.minutes < 0:
            raise ValueError("--minutes must be >= 0 (0 means no limit)")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
        train_adapter(args.model, args.out, spec, args.threads, args.minutes,
                      command=" ".join([PROG, *argv]))
    elif args.command == "random":
        info = MoeModelInfo.from_model_path(args.model)
        if args.seed < 0:
            raise ValueError("--seed must be >= 0")
        if args.experts is not None:
            experts = parse_experts(args.experts)
        else:
            layers = None if args.layers is None else _layers(args.layers)
            per_layer = (min(DEFAULT_EXPERTS_PER_LAYER, default_max_experts(info.num_experts))
                         if args.experts_per_layer is None else args.experts_per_layer)
            experts = choose_experts(info, args.seed, per_layer, layers)
        adapter = random_adapter(args.model, args.out, experts, args.seed, args.scale)
        print(f"wrote {adapter.path}: {_summary(adapter)}")
    elif args.command == "merge":
        adapter = merge(args.model, args.adapter, args.out)
        print(f"wrote {args.out}: {args.model} with {_summary(adapter)} of {adapter.path}")
    else:
        from sglang_eaas.esft.adapter import load_adapter

        info = MoeModelInfo.from_model_path(args.model)
        adapter = load_adapter(args.adapter, info, args.slot_budget, model_path=args.model)
        print(f"{adapter.path}: valid; {_summary(adapter)}, "
              f"{adapter.weight_bytes(info)} bytes in {info.dtype}")


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ValueError(f"--layers must be comma-separated layer ids, not {text!r}") from exc


def _summary(adapter) -> str:
    return f"{adapter.count} experts replaced (" + ", ".join(
        f"layer {layer}: {list(ids)}" for layer, ids in adapter.experts.items()) + ")"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        _run(args, argv)
    except (ValueError, ModelError, DomainError) as exc:  # AdapterError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
