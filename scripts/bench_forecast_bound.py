"""How far ahead the prompts can tell the decode load (issue 36's measured bound), offline.

On the trained checkpoint (transformers, float32, greedy, ``--output-len`` tokens per prompt,
the prompt mixes of ``bench_balance_shift``), each request's routing is recorded per MoE layer
for its prompt tokens and for its generated tokens (the router's top-k of one forward pass
over prompt + output, which is what a decode step with the KV cache computes). Then, per mix
and MoE layer, ``balance/forecast.load_overlap`` (the share of the actual entries on experts as
often as predicted; 1 is a perfect spread) of the decode entries of the mix's second half of
requests against:

* **same-mix decode** (the first half's decode entries): what counters of the same mix tell,
  the ceiling of any estimate that has only seen other requests;
* **same-mix prompts** (the first half's prompt entries): what a forecast that spreads decode
  as prompts spread theirs can know (``RoutingBook`` for requests to come);
* **own prompts** (each second-half request's own prompt, summed): the same for the requests
  already running;
* **other mix's decode** (every other mix's decode entries): what counters tell in the first
  seconds after a shift from that mix;
* and, for the servers' whole load, prefill and decode together, the same four.

Not a timed benchmark: it runs the model on this process's threads for a few minutes.

    python scripts/bench_forecast_bound.py [--requests 24] [--output-len 48]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lib.live_balance_prompts import MIXES, SHIFT_MIXES, halves  # noqa: E402
from bench_lib.report import ROOT, Report, default_out, say  # noqa: E402
from bench_lib.request_routing import record  # noqa: E402
from sglang_eaas.balance.forecast import load_overlap  # noqa: E402
from sglang_eaas.balance.traces import load_model, moe_layers  # noqa: E402

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-moe-stdlib",
                   help="the checkpoint; default models/tiny-moe-stdlib (the trained one)")
    p.add_argument("--mixes", default=",".join(SHIFT_MIXES),
                   help=f"comma-separated, of {', '.join(MIXES)}; default %(default)s")
    p.add_argument("--requests", type=int, default=24,
                   help="requests per half of each mix; default 24")
    p.add_argument("--output-len", type=int, default=48,
                   help="greedy tokens per request; default 48 (bench_balance_shift's)")
    p.add_argument("--out", type=Path, default=default_out("forecast-bound"),
                   help="markdown report; default %(default)s")
    args = p.parse_args()
    args.mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    if len(args.mixes) < 2 or any(m not in MIXES for m in args.mixes):
        p.error(f"--mixes: at least two of {', '.join(MIXES)}")
    if min(args.requests, args.output_len) < 1:
        p.error("--requests and --output-len must be >= 1")
    return args


def mean_overlap(predicted: np.ndarray, actual: np.ndarray) -> float:
    return float(np.nanmean(load_overlap(predicted, actual)))


def main() -> int:
    args = parse_args()
    report = Report(args.out)
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    model = load_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    num_experts = model.model.layers[moe_layers(model)[0]].mlp.gate.weight.shape[0]
    # per mix and half: a list of (prompt [L, E], decode [L, E]) per request
    recorded: dict[str, list[list[tuple[np.ndarray, np.ndarray]]]] = {}
    for mix in args.mixes:
        recorded[mix] = []
        for half in halves(mix, args.requests):
            recorded[mix].append([record(model, tokenizer, text, args.output_len)
                                  .counts(num_experts) for text in half])
        say(f"{mix}: {2 * args.requests} requests recorded")

    def total(mix: str, half: int, part: int) -> np.ndarray:
        return sum(r[part] for r in recorded[mix][half])

    rows = []
    for mix in args.mixes:
        actual_decode, actual_all = total(mix, 1, 1), total(mix, 1, 0) + total(mix, 1, 1)
        others = [m for m in args.mixes if m != mix]
        row = {
            "same-mix decode": mean_overlap(total(mix, 0, 1), actual_decode),
            "same-mix prompts": mean_overlap(total(mix, 0, 0), actual_decode),
            "own prompts": mean_overlap(total(mix, 1, 0), actual_decode),
            "other mix's decode": statistics.mean(
                mean_overlap(total(o, 0, 1), actual_decode) for o in others),
            "all, same mix": mean_overlap(total(mix, 0, 0) + total(mix, 0, 1), actual_all),
            "all, other mix": statistics.mean(
                mean_overlap(total(o, 0, 0) + total(o, 0, 1), actual_all) for o in others),
            "prompt share": float(total(mix, 1, 0).sum() / actual_all.sum()),
        }
        rows.append((mix, row))
    names = list(rows[0][1])
    lines = [f"Checkpoint `{args.model.name}`, transformers float32, greedy "
             f"{args.output_len} tokens; {args.requests} requests per half of each mix (first "
             "half: the estimate; second half: the load it is judged on). Cells: "
             "`load_overlap` with the second half's decode entries (the first four) or with "
             "its prefill and decode entries (the next two), mean over MoE layers; the last "
             "column is the share of the second half's entries that are prompt entries.", "",
             "| mix | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for mix, row in rows:
        lines.append(f"| {mix} | " + " | ".join(f"{row[n]:.3f}" for n in names) + " |")
    report.add("\n".join(lines))
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
