"""``python -m sglang_eaas.tools.switch --monitor ADDR --model-path M --to tp|ep``: switch the live
expert tier's MoE layers between expert and tensor parallelism (docs/switching.md).

Layer by layer, adds before drops (``elastic/switch.py``): to TP, each server of ``--group``
adds its part of every expert (cut from its own rows, a holder's over the weight fabric, or the
checkpoint), then the whole experts are dropped; to EP, whole experts come back in contiguous
blocks, then the parts are dropped. Clients adopt each layer's new layout at their next step;
requests in flight complete. Prints each layer's switch and its time; exit status 0 done, 1
failed (the message says which layer and why), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.elastic.switch import LAYOUTS, SWITCH_GRACE, Switcher, SwitchError, layouts
from sglang_eaas.membership import parse_monitor
from sglang_eaas.model_info import ModelError, MoeModelInfo
from sglang_eaas.placement import PlacementError, parse_expert_list


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, MoeModelInfo]:
    p = argparse.ArgumentParser(prog="python -m sglang_eaas.tools.switch",
                                description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--monitor", required=True, metavar="ADDR",
                   help="the tier's monitor: HOST:PORT (an --eaas-monitor embedded:HOST:PORT "
                   "or python -m sglang_eaas.monitor) or etcd://HOST:PORT")
    p.add_argument("--model-path", required=True,
                   help="the checkpoint the tier serves (its config says the MoE layers, the "
                   "experts and their intermediate size)")
    p.add_argument("--to", required=True, choices=LAYOUTS,
                   help="'tp': every expert cut into --parts parts over the group; 'ep': whole "
                   "experts again")
    p.add_argument("--layers", default="all", metavar="SPEC",
                   help="MoE layers to switch, '1,3' or '0-2' (default: all)")
    p.add_argument("--group", default="", metavar="A,B,...",
                   help="the servers, in order (server i holds part i %% parts); default: every "
                   "serving server of the tier")
    p.add_argument("--parts", type=int, default=None,
                   help="with --to tp: parts per expert (default: one per server of the group; "
                   "a group of twice as many servers holds every part twice)")
    p.add_argument("--grace", type=float, default=SWITCH_GRACE,
                   help="seconds a server keeps answering for what it dropped once no request "
                   "used it (default %(default)s)")
    p.add_argument("--token", default=None,
                   help="the tier's shared token (default: $SGLANG_EAAS_TOKEN)")
    args = p.parse_args(argv)
    try:
        parse_monitor(args.monitor, embedded_ok=False)
    except ValueError as exc:
        p.error(f"--monitor: {exc}")
    try:
        info = MoeModelInfo.from_model_path(args.model_path)
    except ModelError as exc:
        p.error(f"--model-path: {exc}")
    if args.layers == "all":
        args.layers = list(info.moe_layers)
    else:
        try:
            args.layers = parse_expert_list(args.layers)
        except PlacementError as exc:
            p.error(f"--layers: {exc}")
    if args.parts is not None and (args.to != "tp" or args.parts < 2):
        p.error("--parts applies with --to tp and is at least 2")
    if not 0 <= args.grace <= 600:
        p.error(f"--grace must be 0-600 seconds, got {args.grace}")
    args.group = [s.strip() for s in args.group.split(",") if s.strip()]
    return args, info


def main(argv: list[str] | None = None) -> int:
    args, info = parse_args(argv)
    token = args.token if args.token is not None else envs.TOKEN.get()
    switcher = Switcher(args.monitor, token, info, args.grace, say=print)
    try:
        done = switcher.switch(args.layers, args.to, args.group or None, args.parts)
        now = layouts(switcher.holdings(), info)
    except (SwitchError, TransportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = sum(r.seconds for r in done)
    print(f"switched {len(done)} MoE layers in {total:.2f}s; layouts now (parts per layer, 1 = "
          f"EP): {now}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
