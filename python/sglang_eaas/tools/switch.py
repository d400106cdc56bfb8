"""``python -m sglang_eaas.tools.switch --monitor ADDR --model-path M --to tp|ep``: switch the live
expert tier's MoE layers between expert and tensor parallelism (docs/switching.md).

Layer by layer, adds before drops (``elastic/switch.py``): to TP, each server of ``--group``
adds its part of every expert (cut from its own rows, a holder's over the weight fabric, or the
checkpoint), then the whole experts are dropped; to EP, whole experts come back in contiguous
blocks, then the parts are dropped. Clients adopt each layer's new layout at their next step;
requests in flight complete. Prints each layer's switch and its time; exit status 0 done, 1
failed or refused (the message says which layer and why), 2 bad arguments.

The switch is an operation of the tier controller: refused in one sentence naming the running
one while another operation holds the tier (``--wait S`` waits for it), recorded in the
monitor (``python -m sglang_eaas.status``), and exit status 0 only once the monitor shows every
layer asked for in the new layout. Refused before anything starts: a checkpoint no server of
the tier serves, more parts than the group's servers or than the experts can be cut into.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.controller.controller import (
    Busy, Ended, Held, Known, RolledBack, TierController, requester_name,
)
from sglang_eaas.controller.end_state import read_end_state
from sglang_eaas.elastic.switch import LAYOUTS, SWITCH_GRACE, Switcher, SwitchError, layouts
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.operations import DONE, SWITCH, LeaseLost
from sglang_eaas.tools import operation_flags
from sglang_eaas.membership import parse_monitor
from sglang_eaas.model_info import ModelError, MoeModelInfo
from sglang_eaas.placement import PlacementError, parse_expert_list


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, MoeModelInfo]:
    p = argparse.ArgumentParser(prog="python -m sglang_eaas.tools.switch",
                                description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                epilog=__doc__.split("\n\n")[2].replace("``", ""))
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
    operation_flags.add(p, "refused at once, naming it")
    p.add_argument("--token", default=None,
                   help="the tier's shared token (default: $SGLANG_EAAS_TOKEN)")
    args = p.parse_args(argv)
    operation_flags.check(p, args)
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
    target = {"layers": args.layers, "to": args.to, "group": args.group, "parts": args.parts or 0,
              "grace": args.grace, "model": asdict(info), "fingerprint": info.fingerprint()}

    def body(held: Held) -> Ended:
        held.note(_from={str(layer): parts for layer, parts in
                         layouts(switcher.holdings(), info).items()})
        switcher.say = held.progress
        done = switcher.switch(args.layers, args.to, args.group or None, args.parts, held.fence)
        total = sum(r.seconds for r in done)
        return Ended(f"switched {len(done)} MoE layers in {total:.2f}s",
                     read_end_state(args.monitor, token, info.fingerprint()))

    controller = TierController(args.monitor, token, requester_name("tools.switch"), say=print)
    try:
        switcher.check(args.layers, args.to, args.group or None, args.parts)
        record = controller.run(SWITCH, target, body, args.id, args.wait)
    except Known as exc:
        record = exc.record
        print(f"operation {record.id} was asked for already", flush=True)
    except (Busy, SwitchError, TransportError, ControlError, OSError, RolledBack,
            LeaseLost) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if record.state != DONE:
        print(f"error: operation {record.id} {record.state}: {record.result}", file=sys.stderr)
        return 1
    try:
        now = layouts(switcher.holdings(), info)
    except (TransportError, OSError) as exc:
        print(f"error: the tier cannot be read back: {exc}", file=sys.stderr)
        return 1
    wrong = [layer for layer in args.layers if (now[layer] == 1) != (args.to == "ep")]
    print(f"operation {record.id}: {record.result}; layouts now (parts per layer, 1 = EP): "
          f"{now}", flush=True)
    if wrong:
        print(f"error: MoE layers {wrong} are not {args.to.upper()} now (another operation "
              "changed them since)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
