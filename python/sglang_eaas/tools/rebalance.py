"""``python -m sglang_eaas.tools.rebalance --monitor ADDR``: balance the live expert tier.

Plans on the entries each serving expert server computed per (MoE layer, expert) since this
tool's last pass (``--load servers``, the default: the servers' own counters, remembered at
each pass in a small state file, ``--state``), or on the attention clients' last load windows
(``--load clients``); places replicas with the scaler and placer (MoEless, warm from the
current placement) or SGLang's EPLB (``--policy eplb``); prints per MoE layer the busiest
server over the mean as the servers measured it since the last pass, as the load models the
current placement, and as it models the plan; and applies the moves live
(``balance/apply.py``: adds from a peer first, then drops; clients switch tables between
steps). ``--dry-run`` only prints. ``--interval S`` repeats every S seconds until interrupted.

Each pass that moves something is an operation of the tier controller: refused in one sentence
naming the running one while another operation holds the tier (``--wait S`` waits for it; with
``--interval`` the pass is skipped and the next one tries again), planned again under the lease
if the tier changed since the plan, recorded in the monitor, and read back: the exit status is
0 only when the tier holds the plan.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.balance.live import POLICIES, LoadHistory, Plan, fullest, plan, tier_holdings
from sglang_eaas.controller.rebalance import least_entries, rebalance
from sglang_eaas.balance.scaler import DEFAULT_CV_TARGET
from sglang_eaas.balance.server_load import (Counters, Since, default_state_path, expert_load,
                                             measured_ratio, read_counters, read_state, since,
                                             write_state)
from sglang_eaas.client.load_recorder import DEFAULT_WINDOW_STEPS
from sglang_eaas.controller.bounds import Refusal, check_whole_experts
from sglang_eaas.controller.controller import (
    Busy, TierController, requester_name,
)
from sglang_eaas.holdings import Holdings
from sglang_eaas.protocol.lines import ControlError
from sglang_eaas.protocol.operations import DONE
from sglang_eaas.tools import operation_flags
from sglang_eaas.membership import connect, parse_monitor
from sglang_eaas.placement import PlacementError
from sglang_eaas.routing_table import lenient_table

SERVERS, CLIENTS = "servers", "clients"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_eaas.tools.rebalance",
                                description=__doc__.split("\n\n")[1].replace("``", ""),
                                epilog=__doc__.split("\n\n")[2].replace("``", ""))
    p.add_argument("--monitor", required=True, metavar="ADDR",
                   help="the tier's monitor: HOST:PORT (an --eaas-monitor embedded:HOST:PORT "
                   "or python -m sglang_eaas.monitor) or etcd://HOST:PORT")
    p.add_argument("--token", default=None,
                   help="the tier's shared token (default: $SGLANG_EAAS_TOKEN)")
    p.add_argument("--load", choices=(SERVERS, CLIENTS), default=SERVERS,
                   help="what to plan on. servers (default): the entries each serving expert "
                   "server computed per (MoE layer, expert) since this tool's last pass on "
                   "this tier (the servers' own counters, read with 'stats'; a TP layer's "
                   "sum divided by its parts); without a remembered pass, or for a server "
                   "that restarted since, everything since the server started. clients: the "
                   "attention clients' load windows; a client's heartbeat carries only its "
                   f"last closed window ({DEFAULT_WINDOW_STEPS} scheduler steps by default, "
                   "--eaas-load-window), so a pass sums, per client, the windows the monitor "
                   "showed while the tool watched it: the first pass watches until the windows "
                   "hold --min-tokens per MoE layer (at most --load-wait seconds), each later "
                   "--interval pass adds the window each client carries then (windows closed "
                   "while the tool sleeps are never seen), keeping each client's latest "
                   "--windows; a one-shot pass therefore plans on about one window per client, "
                   "whatever --windows says. The measured ratios come from the servers' "
                   "counters with either load")
    p.add_argument("--state", type=Path, default=None, metavar="PATH",
                   help="the JSON file where each pass remembers the servers' counters (for "
                   "the next pass's 'since the last pass'); default "
                   "$XDG_CACHE_HOME/sglang-eaas/rebalance/<digest of --monitor>.json (else "
                   "~/.cache/...); --dry-run reads it but does not write it")
    p.add_argument("--stats-timeout", type=float, default=5.0, metavar="S",
                   help="seconds each expert server has to answer for its load counters (all "
                   "are asked at once; one that does not answer is left out of the pass); "
                   "default 5")
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
                   help="--load clients: at most this many of each client's windows are "
                   "summed (default 8; see --load for which windows a pass sees)")
    p.add_argument("--min-tokens", type=int, default=1,
                   help="do nothing until the load (of either --load) holds this many entries "
                   "in every MoE layer (default 1); with --load servers the counters are not "
                   "remembered then, so the next pass adds to this load")
    p.add_argument("--grace", type=float, default=2.0,
                   help="seconds a server keeps answering for dropped experts once no request "
                   "used them (default 2)")
    p.add_argument("--interval", type=float, default=0.0,
                   help="repeat every this many seconds (default 0: one pass); each pass plans "
                   "on the load since the one before")
    p.add_argument("--load-wait", type=float, default=10.0, metavar="S",
                   help="--load clients: seconds the first pass waits for load windows "
                   "(default 10)")
    operation_flags.add(p, "a one-shot pass is refused naming it, an --interval pass is "
                        "skipped", with_id=False)
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan, move nothing, and leave the state file as it is (a "
                   "real pass after it plans on the same load)")
    args = p.parse_args(argv)
    try:
        args.monitor_url = parse_monitor(args.monitor, embedded_ok=False).url
    except ValueError as exc:
        p.error(str(exc))
    if args.slots is not None and args.slots < 1:
        p.error(f"--slots must be >= 1, got {args.slots}")
    if args.windows < 1 or args.min_tokens < 1 or args.interval < 0 or args.load_wait < 0:
        p.error("--windows and --min-tokens must be >= 1, --interval and --load-wait >= 0")
    if not 0 < args.cv_target < 10:
        p.error(f"--cv-target must be between 0 and 10, got {args.cv_target}")
    if not 0 < args.stats_timeout <= 600:
        p.error(f"--stats-timeout must be more than 0 and at most 600 seconds, got "
                f"{args.stats_timeout}")
    if not 0 <= args.grace <= 600:
        p.error(f"--grace must be 0-600 seconds, got {args.grace}")
    operation_flags.check(p, args)
    if args.state is not None and args.state.is_dir():
        p.error(f"--state {args.state} is a directory; give a file path")
    return args


def say(line: str) -> None:
    print(line, flush=True)


def default_slots(current: Holdings, num_experts: int) -> int:
    servers = max(1, len(current))
    return max(fullest(current) + max(1, -(-num_experts // servers) // 4),
               -(-num_experts // servers))


class Remembered:
    """The servers' counters at this tool's last pass: in the state file, and in memory for
    the passes of one run (a dry run remembers only in memory)."""

    def __init__(self, path: Path, monitor: str, dry_run: bool, timeout: float = 5.0):
        self.path, self.monitor, self.dry_run, self.timeout = path, monitor, dry_run, timeout
        self.counters, warning = read_state(path)
        if warning:
            say(f"rebalance: warning: {warning}")

    def measure(self, servers: list[str], token: str) -> tuple[list[Counters], list[Since]]:
        """Each server's counters now and its entries since the last pass; one line per
        server that did not answer, and for those counted from their start."""
        now, failed = read_counters(servers, token, self.timeout)
        for server, why in failed.items():
            say(f"rebalance: expert server {server} did not answer for its load counters "
                f"({why}); the pass goes on without its load")
        measured = [since(c, self.counters.get(c.server)) for c in now]
        fresh = [m for m in measured if m.start is None]
        if fresh and len(fresh) == len(measured) and not self.counters:
            say(f"rebalance: no earlier pass remembered ({self.path}): the servers' entries "
                "are counted since they started")
        else:
            for m in fresh:
                why = "restarted" if m.why == "restarted" else "is not in the state file"
                say(f"rebalance: expert server {m.server} {why}: its entries are counted since "
                    "it started")
        return now, measured

    def remember(self, now: list[Counters], servers: list[str]) -> None:
        """Keep ``now``, and the last counters of the other ``servers`` (those that did not
        answer); servers no longer in the tier are forgotten."""
        kept = {**self.counters, **{c.server: c for c in now}}
        self.counters = {s: kept[s] for s in servers if s in kept}
        if self.dry_run:
            return
        try:
            write_state(self.path, self.monitor, self.counters.values())
        except OSError as exc:
            say(f"rebalance: warning: cannot write the state file {self.path} "
                f"({exc.strerror or exc}); the next pass plans on the load since this one's "
                "last remembered pass")


@dataclass(frozen=True)
class PassLoad:
    """What one pass plans on, and the servers' entries since the last pass."""

    current: Holdings
    num_experts: int
    layers: list[int]
    load: np.ndarray  # [L, E] entries
    what: str  # how the header says which load it is
    counters: list[Counters]  # the servers' counters now
    measured: list[Since]  # their entries since the last pass


def clients_load(monitor, history: LoadHistory, args, first: bool):
    deadline = time.monotonic() + (args.load_wait if first else 0.0)
    while True:
        snapshot = monitor.watch(-1, 0.0)
        history.take(snapshot)
        current, num_experts = tier_holdings(snapshot)
        layers = list(current.layers())
        load = history.total(layers, num_experts)
        if least_entries(load) >= args.min_tokens or time.monotonic() > deadline:
            return current, num_experts, layers, load
        time.sleep(0.2)


def servers_phrase(measured: list[Since], total: int) -> str:
    starts = [m.start for m in measured if m.start is not None]
    if not starts:
        return f"{total} entries the servers computed since they started"
    at = time.strftime("%H:%M:%S", time.localtime(min(starts)))
    fresh = len(measured) - len(starts)
    return (f"{total} entries the servers computed since the last pass at {at}"
            + (f" ({fresh} of them since they started)" if fresh else ""))


def read_load(monitor, history, remembered: Remembered, args, token, first) -> PassLoad:
    if args.load == CLIENTS:
        current, num_experts, layers, load = clients_load(monitor, history, args, first)
        what = f"{int(load.sum())} entries in the clients' last windows"
        counters, measured = remembered.measure(sorted(current), token)
        return PassLoad(current, num_experts, layers, load, what, counters, measured)
    current, num_experts = tier_holdings(monitor.watch(-1, 0.0))
    layers = list(current.layers())
    counters, measured = remembered.measure(sorted(current), token)
    if not counters:
        raise ValueError(f"none of the {len(current)} expert servers answered for their load "
                         "counters; nothing moved")
    table = lenient_table(current, layers, num_experts)
    load = expert_load(measured, layers, num_experts, {la: table.parts(la) for la in layers})
    return PassLoad(current, num_experts, layers, load, servers_phrase(measured, int(load.sum())),
                    counters, measured)


def one_pass(monitor, history: LoadHistory, remembered: Remembered, args, token: str,
             first: bool, controller: TierController) -> None:
    got = read_load(monitor, history, remembered, args, token, first)
    current, load, layers = got.current, got.load, got.layers
    if least_entries(load) < args.min_tokens:
        say(f"rebalance: not enough load yet ({got.what}; --min-tokens {args.min_tokens} per "
            "MoE layer); nothing moved")
        return
    slots = args.slots or default_slots(current, got.num_experts)
    options = {"cv_target": args.cv_target} if args.policy == "moeless" else {}
    decided = plan(current, load, layers, slots, args.policy, **options)
    remembered.remember(got.counters, sorted(current))
    say(f"rebalance: {len(current)} expert servers, {slots} slots per MoE layer each, "
        f"{got.what}; policy {args.policy}")
    for layer, before, after in zip(decided.layers, decided.before, decided.after):
        adds = sum(len(m.adds) for m in decided.moves if m.layer == layer)
        ratio = measured_ratio(got.measured, layer, got.num_experts)
        measured = "-" if ratio is None else f"{ratio:.2f}x the mean"
        say(f"  MoE layer {layer}: busiest server measured {measured}, modelled {before:.2f}x "
            f"-> plan {after:.2f}x ({adds} replicas to add)")
    if not decided.moves:
        say("rebalance: the placement stays as it is")
        return
    check_whole_experts(current, got.num_experts, "the balancer")
    if args.dry_run:
        say(f"rebalance: --dry-run: {len(decided.moves)} changes not made")
        return

    def replan(now: Holdings) -> Plan:
        return plan(now, load, layers, args.slots or default_slots(now, got.num_experts),
                    args.policy, **options)

    target = {"policy": args.policy, "num_experts": got.num_experts, "grace": args.grace}
    try:
        record = rebalance(controller, monitor, args.monitor_url, token, decided,
                           got.num_experts, replan, target, args.grace, args.wait, say)
    except Busy as exc:
        if not args.interval:
            raise
        say(f"rebalance: this pass is skipped: {exc}")
        return
    if record.state != DONE:
        raise ValueError(f"operation {record.id} {record.state}: {record.result}")
    say(f"rebalance: {record.result} (operation {record.id})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = args.token if args.token is not None else envs.TOKEN.get()
    history = LoadHistory(args.windows)
    remembered = Remembered(args.state or default_state_path(args.monitor_url),
                            args.monitor_url, args.dry_run, args.stats_timeout)
    controller = TierController(args.monitor_url, token, requester_name("tools.rebalance"),
                                say=say)
    try:
        monitor = connect(args.monitor, token)
        first = True
        while True:
            one_pass(monitor, history, remembered, args, token, first, controller)
            first = False
            if not args.interval:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except (TransportError, PlacementError, ValueError, ControlError, Busy, Refusal) as exc:
        print(f"rebalance: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
