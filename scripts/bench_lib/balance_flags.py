"""The flags bench_balance and bench_balance_scale share (the checkpoint, the placement window,
EPLB's cadence, the scaler's CV target, how the kernel is timed), defined and checked once."""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def add_placement_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-moe-stdlib",
                   help="the trained checkpoint (its experts are what the kernel runs); "
                   "default models/tiny-moe-stdlib")
    p.add_argument("--window", type=int, default=16,
                   help="decode steps per placement window; default 16")
    p.add_argument("--eplb-period", type=int, default=1000,
                   help="decode steps between two rebalances of the eplb-sglang policy, on the "
                   "load of the steps since the last; default 1000, SGLang's "
                   "--eplb-rebalance-num-iterations default (its recorder's buffer is as long)")
    p.add_argument("--cv-target", type=float, default=None,
                   help="the scaler's CV target; default the scaler's (0.2)")
    p.add_argument("--measure-windows", type=int, default=8,
                   help="windows per trace (and setting) whose straggler time is measured with "
                   "the kernel (spread over the trace, the first after the shift among them); "
                   "default 8")
    p.add_argument("--repeat", type=int, default=5,
                   help="timed calls per server share (the fastest counts); default 5")


def check_placement_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` (exit 2, one sentence) on the first of those flags that cannot be used."""
    if not args.model.is_dir():
        p.error(f"--model {args.model} is not a directory (models/tiny-moe-stdlib comes with "
                "the repository)")
    if args.cv_target is not None and not args.cv_target >= 0:
        p.error("--cv-target must be a number >= 0")
    if min(args.window, args.measure_windows, args.repeat, args.eplb_period) < 1:
        p.error("--window, --measure-windows, --repeat and --eplb-period must be >= 1")
