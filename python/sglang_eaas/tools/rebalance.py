"""``python -m sglang_eaas.tools.rebalance --monitor ADDR``: balance the live expert tier.

Reads the attention clients' load windows from the monitor (each client sends its last one
with its heartbeats; start SGLang with ``--eaas``, load recording is on), sums the latest
``--windows`` of each, places replicas with the scaler and placer (MoEless, warm from the
current placement) or SGLang's EPLB (``--policy eplb``), prints each MoE layer's busiest-server
load over the mean before and after, and applies the moves live (``balance/apply.py``: adds
from a peer first, then drops; clients switch tables between steps). ``--dry-run`` only prints.
``--interval S`` repeats every S seconds until interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.balance.apply import apply_placement
from sglang_eaas.balance.live import POLICIES, LoadHistory, plan, tier_holdings
from sglang_eaas.balance.scaler import DEFAULT_CV_TARGET
from sglang_eaas.holdings import Holdings
from sglang_eaas.membership import connect, parse_monitor
from sglang_eaas.placement import PlacementError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_eaas.tools.rebalance",
                                description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--monitor", required=True, metavar="ADDR",
                   help="the tier's monitor: HOST:PORT (an --eaas-monitor embedded:HOST:PORT "
                   "or python -m sglang_eaas.monitor) or etcd://HOST:PORT")
    p.add_argument("--token", default=None,
                   help="the tier's shared token (default: $SGLANG_EAAS_TOKEN)")
    p.add_argument("--slots", type=int, default=None,
                   help="experts of one MoE layer one server may hold (its memory budget); "
                   "default: what the fullest server holds now, plus a quarter of the even "
                   "share (at least one spare slot)")
    p.add_argument("--policy", choices=POLICIES, default="moeless",
                   help="moeless: the scaler and placer (replicas until the per-replica load's "
                   "coefficient of variation is at most --cv-target, warm reuse); eplb: SGLang's "
                   "EPLB on the same load; default moeless")
    p.add_argument("--cv-target", type=float, default=DEFAULT_CV_TARGET,
                   help=f"the scaler's target (default {DEFAULT_CV_TARGET})")
    p.add_argument("--windows", type=int, default=8,
                   help="latest load windows of each client to sum (default 8)")
    p.add_argument("--min-tokens", type=int, default=1,
                   help="do nothing until the summed windows hold this many tokens per MoE "
                   "layer (default 1)")
    p.add_argument("--grace", type=float, default=2.0,
                   help="seconds a server keeps answering for dropped experts once no request "
                   "used them (default 2)")
    p.add_argument("--interval", type=float, default=0.0,
                   help="repeat every this many seconds (default 0: one pass)")
    p.add_argument("--wait", type=float, default=10.0,
                   help="seconds the first pass waits for load windows (default 10)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, move nothing")
    args = p.parse_args(argv)
    try:
        parse_monitor(args.monitor, embedded_ok=False)
    except ValueError as exc:
        p.error(str(exc))
    if args.slots is not None and args.slots < 1:
        p.error(f"--slots must be >= 1, got {args.slots}")
    if args.windows < 1 or args.min_tokens < 1 or args.interval < 0 or args.wait < 0:
        p.error("--windows and --min-tokens must be >= 1, --interval and --wait >= 0")
    if not 0 < args.cv_target < 10:
        p.error(f"--cv-target must be between 0 and 10, got {args.cv_target}")
    if not 0 <= args.grace <= 600:
        p.error(f"--grace must be 0-600 seconds, got {args.grace}")
    return args


def default_slots(current: Holdings, num_experts: int) -> int:
    servers = max(1, len(current))
    fullest = max((len(ids) for layers in current.values() for ids in layers.values()),
                  default=0)
    return max(fullest + max(1, -(-num_experts // servers) // 4), -(-num_experts // servers))


def least(load) -> int:
    """The fewest tokens any MoE layer has in ``load`` ([L, E]; 0 with no layer)."""
    return int(load.sum(axis=1).min()) if load.size else 0


def one_pass(monitor, history: LoadHistory, args, token: str, first: bool) -> None:
    deadline = time.monotonic() + (args.wait if first else 0.0)
    while True:
        snapshot = monitor.watch(-1, 0.0)
        history.take(snapshot)
        current, num_experts = tier_holdings(snapshot)
        layers = list(current.layers())
        load = history.total(layers, num_experts)
        if least(load) >= args.min_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if least(load) < args.min_tokens:
        print(f"rebalance: not enough load yet ({load.sum()} tokens in the clients' windows; "
              f"--min-tokens {args.min_tokens} per MoE layer); nothing moved", flush=True)
        return
    slots = args.slots or default_slots(current, num_experts)
    options = {"cv_target": args.cv_target} if args.policy == "moeless" else {}
    decided = plan(current, load, layers, slots, args.policy, **options)
    print(f"rebalance: {len(current)} expert servers, {slots} slots per MoE layer each, "
          f"{int(load.sum())} tokens in the clients' last windows; policy {args.policy}",
          flush=True)
    for layer, before, after in zip(decided.layers, decided.before, decided.after):
        adds = sum(len(m.adds) for m in decided.moves if m.layer == layer)
        print(f"  MoE layer {layer}: busiest server {before:.2f}x the mean -> {after:.2f}x "
              f"({adds} replicas to add)", flush=True)
    if not decided.moves:
        print("rebalance: the placement stays as it is", flush=True)
        return
    if args.dry_run:
        print(f"rebalance: --dry-run: {len(decided.moves)} changes not made", flush=True)
        return
    done = apply_placement(decided.current, decided.target, token, args.grace,
                           say=lambda line: print("  " + line, flush=True))
    print(f"rebalance: {sum(len(m.adds) for m in done.changes)} replicas added "
          f"({done.from_peer} from peers, {done.from_disk} from disk), "
          f"{sum(len(m.drops) for m in done.changes)} dropped, in {done.seconds:.1f}s",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = args.token if args.token is not None else envs.TOKEN.get()
    history = LoadHistory(args.windows)
    try:
        monitor = connect(args.monitor, token)
        first = True
        while True:
            one_pass(monitor, history, args, token, first)
            first = False
            if not args.interval:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except (TransportError, PlacementError, ValueError) as exc:
        print(f"rebalance: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
