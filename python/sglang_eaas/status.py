"""``python -m sglang_eaas.status --monitor ADDR``: the live expert tier, as its monitor sees it.

Prints every expert server (status, incarnation, seconds since its last heartbeat, clients,
requests and tokens served, experts per MoE layer), then each MoE layer's coverage (how many
live holders each expert has, and which have none), what each server computed per MoE layer
(tokens, compute time, its busiest expert), then the attention clients and the latest
departures with why, the members suspected now and the monitor's suspicions and losses by
reason, and the tier controller's latest operations (the one holding the tier,
and each one's state and result). ``--json`` prints the monitor's snapshot and operations
instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

from ibgda import TransportError
from sglang_eaas import envs
from sglang_eaas.membership import connect, current_snapshot, parse_monitor
from sglang_eaas.protocol.monitor import Member, MonitorStats, Snapshot
from sglang_eaas.protocol.operations import OperationList, describe_target
from sglang_eaas.routing_table import lenient_table


def ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out, ids = [], sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out) or "-"


def render_detection(stats: MonitorStats) -> list[str]:
    """The monitor's failure detection since it started: suspicions (and how many heartbeats
    cleared), losses by reason; nothing where it keeps no counters (etcd)."""
    c = stats.counters
    losses = {k[len("losses_"):]: v for k, v in sorted(c.items()) if k.startswith("losses_")}
    if not (c.get("suspicions") or losses):
        return [] if not stats.counters else ["", "failure detection: no suspicion, no loss"]
    return ["", f"failure detection: {c.get('suspicions', 0)} suspicions "
            f"({c.get('suspicions_cleared', 0)} cleared by a heartbeat); losses by reason: "
            + (", ".join(f"{reason} {n}" for reason, n in losses.items()) or "none")]


def render_operations(listed: OperationList) -> list[str]:
    """The tier controller's latest operations, newest first (the one holding the tier
    marked)."""
    if not listed.operations:
        return ["", "operations: none yet"]
    lines = ["", f"operations (newest first; operation lease epoch {listed.epoch}"
             + (f", held by {listed.holder}" if listed.holder else ", free") + "):"]
    for op in listed.operations:
        when = time.strftime("%H:%M:%S", time.localtime(op.started_at)) if op.started_at \
            else "-"
        took = (f" in {op.finished_at - op.started_at:.1f}s" if op.final and op.started_at
                else "")
        text = op.result or op.progress
        lines.append(f"  {op.id}  {op.state}{took}  {describe_target(op.kind, op.target)}, "
                     f"asked {when} by {op.requester}" + (f": {text}" if text else ""))
    return lines


def render(snapshot: Snapshot, monitor: str) -> str:
    servers = sorted(snapshot.servers(), key=lambda m: m.id)
    lines = [f"monitor {monitor}, revision {snapshot.revision}: {len(servers)} expert servers, "
             f"{len(snapshot.clients())} attention clients", ""]
    rows = [("SERVER", "STATUS", "INCARNATION", "BEAT", "CLIENTS", "REQUESTS", "TOKENS",
             "EXPERTS PER MOE LAYER")]
    for m in servers:
        held = "; ".join(f"{layer}: {ranges(ids)}"
                         for layer, ids in m.holdings.model_experts(m.num_experts).items()
                         if ids or layer not in m.holdings.parts)
        if m.holdings.parts:
            held += ("; " if held else "") + "parts: " + "; ".join(
                f"{layer}: {_parts(cut.parts, cut.ids)}"
                for layer, cut in m.holdings.parts.items())
        adapters = Counter(d.adapter for by in m.holdings.adapters.values() for d in by.values())
        if adapters:
            held += "; ESFT adapter experts: " + ", ".join(
                f"{name} {n}" for name, n in sorted(adapters.items()))
        rows.append((m.id, m.status + (" SUSPECTED" if m.suspected else ""),
                     m.incarnation[:16], f"{m.beat_age:.2f}s",
                     str(m.load.get("clients", "-")), str(m.load.get("requests", "-")),
                     str(m.load.get("tokens", "-")), held))
    lines += _table(rows)
    lines += ["", "coverage (live serving holders per expert):"]
    for fingerprint, group in sorted(_by_model(servers).items()):
        serving = snapshot.holdings(fingerprint)
        layers = sorted({layer for m in group for layer in m.holdings})
        experts = range(max(m.num_experts for m in group))
        table = lenient_table(serving, layers, len(experts))
        for layer in layers:
            parts = table.parts(layer)
            count = Counter({e: len(holders)
                             for e, holders in serving.holders(layer).items()})
            if parts > 1:  # an expert's holders: the fewest of any of its parts'
                routed = table.layers[layer].replicas * (table.layers[layer].table[:, 0] >= 0)
                count = Counter({e: int(routed[e * parts:(e + 1) * parts].min())
                                 for e in experts})
            missing = [e for e in experts if count[e] == 0]
            spread = Counter(count[e] for e in experts if count[e])
            shape = ", ".join(f"{n} with {r} holder{'s' if r > 1 else ''}"
                              for r, n in sorted(spread.items()))
            layout = "" if parts == 1 else f" (TP over {parts} parts)"  # EP: said by nothing
            lines.append(f"  model {fingerprint[:12]} layer {layer}{layout}: {shape or 'none'}"
                         + (f"; NO LIVE HOLDER for experts {ranges(missing)}" if missing else ""))
    computed = [(m, m.load.get("expert_load") or {}) for m in servers]
    if any(per_layer for _, per_layer in computed):
        lines += ["", "expert compute since start (per server and MoE layer: tokens, compute "
                  "time, the expert that took the most):"]
        rows = [("SERVER", "LAYER", "TOKENS", "COMPUTE", "BUSIEST EXPERT")]
        for m, per_layer in computed:
            for layer, (tokens, ns, busiest, its_ns) in sorted(per_layer.items(),
                                                               key=lambda kv: int(kv[0])):
                rows.append((m.id, layer, str(tokens), f"{ns / 1e6:.3f} ms",
                             f"{busiest} ({its_ns / max(ns, 1):.0%} of the time)"))
        lines += _table(rows)
    if snapshot.clients():
        lines += ["", "clients: " + ", ".join(sorted(m.id for m in snapshot.clients()))]
    suspected = [m for m in snapshot.members if m.suspected]
    if suspected:
        lines += ["", "suspected (late heartbeats; lost only if the data path confirms or the "
                  "loss timeout passes):"]
        lines += [f"  {m.kind} {m.id}: no heartbeat for {m.beat_age:.2f}s"
                  for m in sorted(suspected, key=lambda m: m.key())]
    if snapshot.departures:
        lines += ["", "latest departures:"]
        lines += [f"  {d.kind} {d.id} ({d.incarnation[:16]}): {d.why}"
                  for d in snapshot.departures[-10:]]
    return "\n".join(lines)


def _parts(parts: int, ids: tuple[int, ...]) -> str:
    """Routed part ids as 'part P/N of experts A-B' per part index."""
    by_index: dict[int, list[int]] = {}
    for i in ids:
        by_index.setdefault(i % parts, []).append(i // parts)
    return ", ".join(f"part {p}/{parts} of {ranges(sorted(es))}"
                     for p, es in sorted(by_index.items()))


def _by_model(servers: list[Member]) -> dict[str, list[Member]]:
    out: dict[str, list[Member]] = {}
    for m in servers:
        out.setdefault(m.fingerprint, []).append(m)
    return out


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_eaas.status",
                                description="Print the live expert tier as a monitor sees it.")
    p.add_argument("--monitor", required=True, metavar="ADDR",
                   help="the monitor: HOST:PORT (an SGLang launcher's embedded monitor, shown in "
                   "its log, or a standalone one) or etcd://HOST:PORT")
    p.add_argument("--token", default=None,
                   help=f"the shared token (default: the {envs.TOKEN.name} environment variable)")
    p.add_argument("--operations", type=int, default=10, metavar="N",
                   help="the latest N operations of the tier controller (resizes, switches, "
                   "rebalances, ...), newest first; default %(default)s")
    p.add_argument("--json", action="store_true",
                   help="print the monitor's snapshot and operations as JSON")
    args = p.parse_args(argv)
    if not 1 <= args.operations <= 256:
        p.error(f"--operations must be 1-256, got {args.operations}")
    try:
        parse_monitor(args.monitor, embedded_ok=False)
    except ValueError as exc:
        p.error(f"--monitor: {exc}")
    token = envs.TOKEN.get() if args.token is None else args.token
    if not token:
        p.error(f"the monitor needs the shared token: pass --token or set {envs.TOKEN.name}")
    try:
        snapshot = current_snapshot(args.monitor, token)
        backend = connect(args.monitor, token)
        try:
            listed = backend.operations("", args.operations)
            stats = backend.stats()
        finally:
            backend.close()
    except TransportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({**snapshot.to_message(), "operations": listed.to_message(),
                          "monitor": stats.to_message()}, indent=2))
    else:
        print(render(snapshot, args.monitor) + "\n" + "\n".join(
            render_detection(stats) + render_operations(listed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
