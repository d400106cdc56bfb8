"""Record routing traces of a MoE checkpoint and build its layer-aware expert-load predictors.

    python -m sglang_eaas.tools.train_predictors --model DIR [--out FILE] [--distance D]
        [--threshold H] [--batch-size B] [--mode decode|prefill] [--steps N] [--lr LR] ...

Runs the model (transformers, float32) over chunks of the CPython stdlib sources
(``balance.traces``), copies the router of MoE layer ``l + D`` as the predictor from layer
``l``, fine-tunes the copies whose accuracy on the ``valid`` split is below ``H`` and keeps a
fine-tuned one only if it is at least as accurate there (``balance.predictor``), reports every
predicted layer's accuracy on the ``test`` split and what a predictor costs per step against
that layer's MoE block, and writes the predictors (safetensors) and the report (JSON).
Deterministic for the same arguments, torch version, ``--threads`` and stdlib sources.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from sglang_eaas.balance.predictor import TuneConfig

DEFAULT_THRESHOLD = 0.9


def _log(line: str) -> None:
    print(line, flush=True)


def median_seconds(fn, repeat: int = 200, blocks: int = 5, warmup: int | None = None) -> float:
    """Median over ``blocks`` of the mean time of ``repeat`` calls (after ``warmup`` calls:
    by default 20, or ``repeat`` if fewer)."""
    if warmup is None:
        warmup = min(20, repeat)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - t0) / repeat)
    return statistics.median(times)


def measure_cost(model, predictors, trace, tokens: int, repeat: int = 200) -> list[dict]:
    """Per predicted layer: the predictor's whole ``predict`` (matmul, softmax, top-k, count)
    on ``tokens`` router inputs, against the target layer's MoE block forward (router and
    routed experts) on the same tokens; each the median of 5 means of ``repeat`` calls."""
    import torch

    rows = []
    x = trace.gate_inputs[:, 0, :tokens]  # [L, tokens, H]: one request's first tokens
    with torch.no_grad():
        for source in predictors.sources:
            target = predictors.target_of(source)
            xs, xt = x[trace.row(source)].contiguous(), x[trace.row(target)][None].contiguous()
            block = model.model.layers[target].mlp
            p = median_seconds(lambda: predictors.predict(source, xs), repeat)
            m = median_seconds(lambda: block(xt), repeat)
            rows.append({"source": source, "target": target, "tokens": tokens,
                         "predictor_us": round(p * 1e6, 1), "moe_block_us": round(m * 1e6, 1),
                         "ratio": round(p / m, 4)})
    return rows


def table(report: dict) -> str:
    """The per-layer results and costs as markdown (pasted into docs/balancing.md)."""
    def f(v):
        return "-" if v is None else f"{v:.3f}"

    lines = ["| MoE layer | from | accuracy, copy: valid / test | fine-tuned: valid / test | "
             "kept | test recall: copy / kept | last step: test |",
             "|---|---|---|---|---|---|---|"]
    for r in report["layers"]:
        tuned = r["kept"] == "fine-tuned"
        recall = f"{f(r['copy_test_recall'])} / " + f(
            r["tuned_test_recall"] if tuned else r["copy_test_recall"])
        fine = "-" if r["tuned_valid"] is None else f"{f(r['tuned_valid'])} / {f(r['tuned_test'])}"
        lines.append(f"| {r['target']} | {r['source']} | {f(r['copy_valid'])} / "
                     f"{f(r['copy_test'])} | {fine} | {r['kept']} | {recall} | "
                     f"{f(r['last_step_test'])} |")
    for u in report["unpredicted"]:
        lines.append(f"| {u['layer']} | - | - | - | (last step) | - | "
                     f"{f(u['last_step_test'])} |")
    lines += ["", "| MoE layer | tokens | predictor | MoE block | ratio |", "|---|---|---|---|---|"]
    for c in report["cost"]:
        lines.append(f"| {c['target']} | {c['tokens']} | {c['predictor_us']:.0f} us | "
                     f"{c['moe_block_us']:.0f} us | {100 * c['ratio']:.1f}% |")
    return "\n".join(lines)


def last_step(trace, layer: int, args) -> float | None:
    """The test split's last-step baseline of a layer no predictor covers (decode only)."""
    from sglang_eaas.balance.predictor import last_step_score
    from sglang_eaas.balance.traces import step_tokens

    if args.mode != "decode":
        return None
    test = trace.split("test")
    steps = step_tokens(len(test.request_ids), test.tokens_per_request, args.batch_size)
    return last_step_score(test, layer, steps, test.tokens_per_request)


def run(args, log=_log) -> dict:
    """Everything, at ``--threads`` with deterministic algorithms (restored afterwards, for
    callers in a test process)."""
    import torch

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _run(args, log)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _run(args, log) -> dict:
    import torch
    from transformers import AutoTokenizer

    from sglang_eaas.balance import predictor as P
    from sglang_eaas.balance import traces as T

    began = time.monotonic()
    model = T.load_model(args.model)
    layers = T.moe_layers(model)
    if not layers:
        raise ValueError(f"{args.model} has no routed MoE layers to predict")
    if args.distance >= len(layers):
        raise ValueError(f"--distance {args.distance} leaves nothing to predict with "
                         f"{len(layers)} MoE layers (at most {len(layers) - 1})")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    requests = T.stdlib_requests(tokenizer, args.request_tokens, args.chunks_per_file,
                                 args.max_requests)
    if not requests:
        raise ValueError(f"no stdlib file has --request-tokens {args.request_tokens} tokens")
    counts = {s: sum(T.split_of(r.id) == s for r in requests) for s in T.SPLITS}
    log(f"[1/4] {len(requests)} requests of {args.request_tokens} tokens from the stdlib "
        f"sources: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    t0 = time.monotonic()
    trace = T.record(model, requests, args.record_batch, log=lambda line: log(f"  {line}"))
    record_seconds = time.monotonic() - t0
    log(f"[2/4] recorded {len(layers)} MoE layers in {record_seconds:.1f}s")
    if args.save_trace:
        trace.save(args.save_trace)
        log(f"  trace written to {args.save_trace}")
    gates = {i: model.model.layers[i].mlp.gate.weight.detach() for i in layers}
    cfg = TuneConfig(args.steps, args.lr, args.tune_batch, args.seed)
    log(f"[3/4] predictors at distance {args.distance}, accuracy over {args.mode} steps of "
        f"{args.batch_size} requests, threshold {args.threshold}")
    t0 = time.monotonic()
    predictors = P.build(trace, gates, args.distance, args.threshold, args.batch_size, args.mode,
                         cfg, log=lambda line: log(f"  {line}"))
    tune_seconds = time.monotonic() - t0
    log(f"[4/4] cost per step of {args.cost_tokens} tokens")
    cost = measure_cost(model, predictors, trace, args.cost_tokens, args.cost_repeat)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    predictors.save(args.out)
    report = {
        "command": " ".join(["python -m sglang_eaas.tools.train_predictors", *args.argv]),
        "model": str(args.model),
        "distance": args.distance, "threshold": args.threshold,
        "batch_size": args.batch_size, "mode": args.mode,
        "tune": asdict(cfg), "threads": args.threads,
        "requests": {**counts, "tokens_per_request": args.request_tokens,
                     "chunks_per_file": args.chunks_per_file},
        "split_rule": "crc32(file path) % 10: 0-5 train, 6 valid, 7-9 test",
        "layers": [asdict(r) for _, r in sorted(predictors.results.items())],
        "unpredicted": [{"layer": layer, "last_step_test": last_step(trace, layer, args)}
                        for layer in layers[:args.distance]],
        "cost": cost,
        "seconds": {"record": round(record_seconds, 1), "build": round(tune_seconds, 1),
                    "total": round(time.monotonic() - began, 1)},
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
    }
    report_path = args.report or args.out.with_suffix(".json")
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    log(table(report))
    log(f"done: wrote {args.out} and {report_path} in {report['seconds']['total']:.0f}s")
    return report


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        prog="python -m sglang_eaas.tools.train_predictors",
        description="Record routing traces of a MoE checkpoint on the Python standard library "
        "sources and build its layer-aware expert-load predictors (copied routers, fine-tuned "
        "where too inaccurate); see docs/balancing.md, 'Predictors'.")
    parser.add_argument("--model", type=Path, required=True,
                        help="checkpoint directory (Qwen3-MoE or Mixtral, HF format)")
    parser.add_argument("--out", type=Path,
                        help="predictors file to write (default MODEL/predictors/dD.safetensors: "
                        "not MODEL/*.safetensors, which SGLang would load as weights)")
    parser.add_argument("--report", type=Path,
                        help="JSON report to write (default: --out with the suffix .json)")
    parser.add_argument("--distance", type=int, default=1,
                        help="prediction distance d in MoE layers: layer l predicts layer l+d "
                        "(default 1)")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="fine-tune the layers whose copied router's accuracy on the valid "
                        f"split is below this, in [0, 1] (default {DEFAULT_THRESHOLD})")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="requests per step of the accuracy (default 32)")
    parser.add_argument("--mode", choices=("decode", "prefill"), default="decode",
                        help="steps of one token per request (decode, default) or of whole "
                        "requests (prefill)")
    parser.add_argument("--request-tokens", type=int, default=256,
                        help="tokens per request: one chunk of one stdlib file (default 256)")
    parser.add_argument("--chunks-per-file", type=int, default=2,
                        help="requests per stdlib file at most (default 2)")
    parser.add_argument("--max-requests", type=int, default=0,
                        help="use this many requests, spread evenly over the files (default 0: "
                        "all)")
    parser.add_argument("--record-batch", type=int, default=16,
                        help="requests per forward pass while recording (default 16)")
    parser.add_argument("--steps", type=int, default=1000,
                        help="fine-tuning steps (Adam) per fine-tuned layer (default 1000)")
    parser.add_argument("--lr", type=float, default=1e-2, help="fine-tuning learning rate "
                        "(default 0.01)")
    parser.add_argument("--tune-batch", type=int, default=4096,
                        help="tokens per fine-tuning minibatch (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the minibatches (default 0)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (default 2); results are reproducible for one count")
    parser.add_argument("--cost-tokens", type=int, default=32,
                        help="tokens per step when timing a predictor against its MoE block "
                        "(default 32, at most --request-tokens)")
    parser.add_argument("--cost-repeat", type=int, default=200,
                        help="calls per timed block when timing a predictor and its MoE block "
                        "(the median of 5 blocks; default 200)")
    parser.add_argument("--save-trace", type=Path,
                        help="also write the recorded trace (safetensors; about 1 GB at the "
                        "defaults)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    checks = [
        (args.distance >= 1, "--distance must be >= 1 (0 would be the router itself)"),
        (0.0 <= args.threshold <= 1.0, "--threshold must be in [0, 1]"),
        (args.lr > 0, "--lr must be > 0"),
        (args.steps >= 0, "--steps must be >= 0"),
        (args.max_requests >= 0, "--max-requests must be >= 0 (0 means all)"),
        (1 <= args.cost_tokens <= args.request_tokens,
         "--cost-tokens must be between 1 and --request-tokens"),
    ] + [(getattr(args, n) >= 1, f"--{n.replace('_', '-')} must be >= 1") for n in (
        "batch_size", "request_tokens", "chunks_per_file", "record_batch", "tune_batch",
        "threads", "cost_repeat")]
    for ok, sentence in checks:
        if not ok:
            parser.error(sentence)
    if not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model} is not a checkpoint directory (no config.json)")
    args.out = args.out or args.model / "predictors" / f"d{args.distance}.safetensors"
    if args.out.suffix == ".safetensors" and args.out.parent.resolve() == args.model.resolve():
        parser.error("--out must not be a .safetensors file directly in --model: SGLang would "
                     "load it as model weights")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
