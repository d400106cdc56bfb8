"""Heatmaps of recorded expert load and of replica placements, before and after balancing.

    python -m sglang_eaas.tools.expert_load DUMP [--out DIR] [--source NAME]
        [--placement FILE] [--after FILE | --balance [--servers N] [--slots N] [--cv-target X]
        [--warm-slack X] [--save-after FILE]]

DUMP is a load dump (JSON lines of ``balance.load.LoadWindow``); its windows are summed. Writes
``load.png`` (layers x experts: each expert's share of its layer's tokens) and, given a
placement, ``placement.png`` (layers x experts: replicas per expert; layers x servers: each
server's tokens over the mean), before and after. A placement file is the one format
``placement.load_placement_file`` reads (``--eaas-placement``'s, with any server names):
``{"servers": {server: {layer: [experts]}}}`` (a list instead of the layer map: the same
experts in every layer; the ``"servers"`` key may be left out), and ``--save-after`` writes it.
Prints the files written and one line per layer. docs/balancing.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

import numpy as np

from sglang_eaas.balance.evaluate import layer_load, replica_counts
from sglang_eaas.balance.load import read_dump
from sglang_eaas.balance.placer import DEFAULT_WARM_SLACK, balance_model
from sglang_eaas.balance.scaler import DEFAULT_CV_TARGET
from sglang_eaas.holdings import Holdings
from sglang_eaas.placement import PlacementError, even_placement, load_placement_file
from sglang_eaas.routing_table import RoutingTable

PROG = "python -m sglang_eaas.tools.expert_load"


def read_holdings(path: Path, layers: list[int], num_experts: int) -> Holdings:
    """A placement file over the dump's ``layers``, every expert of each held somewhere;
    ``PlacementError`` with one sentence naming the file (and the entry) otherwise."""
    holdings = load_placement_file(path, server_names=False).holdings(layers, num_experts)
    try:
        RoutingTable.build(0, holdings, layers, num_experts)
    except PlacementError as exc:
        raise PlacementError(f"{path}: {exc}") from None
    return holdings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Draw PNG heatmaps (layers x experts) of recorded expert load and of the "
        "replica placement before and after balancing, and print one summary line per layer.")
    parser.add_argument("dump", type=Path, help="load dump: JSON lines of load windows "
                        "(sglang_eaas.balance.load); all its windows are summed")
    parser.add_argument("--out", type=Path, default=Path("."),
                        help="directory for load.png and placement.png (default: .)")
    parser.add_argument("--source", help="only the windows of this source (a client id or a "
                        "trace name); default: all")
    parser.add_argument("--placement", type=Path, help="JSON file of the placement before "
                        "balancing, {server: {layer: [experts]}}; default with --balance: "
                        "contiguous blocks of experts over --servers servers")
    after = parser.add_mutually_exclusive_group()
    after.add_argument("--after", type=Path, help="JSON file of the placement after balancing")
    after.add_argument("--balance", action="store_true", help="compute the placement after "
                       "balancing with the scaler and placer (warm from the one before)")
    parser.add_argument("--servers", type=int, help="with --balance and no --placement: "
                        "number of expert servers (default 4)")
    parser.add_argument("--slots", type=int, help="with --balance: experts of one layer a "
                        "server may hold (default: twice an even share)")
    parser.add_argument("--cv-target", type=float, default=DEFAULT_CV_TARGET,
                        help=f"with --balance: the scaler's CV target (default "
                        f"{DEFAULT_CV_TARGET})")
    parser.add_argument("--warm-slack", type=float, default=DEFAULT_WARM_SLACK,
                        help="with --balance: how much busier (relative) than a placement from "
                        "scratch the busiest server may be, to keep copies where they are "
                        f"(default {DEFAULT_WARM_SLACK}; 0: balance first)")
    parser.add_argument("--save-after", type=Path, help="with --balance: also write the "
                        "computed placement to this JSON file")
    args = parser.parse_args(argv)
    if not args.dump.is_file():
        parser.error(f"load dump {args.dump}: no such file")
    if args.servers is not None and args.servers < 1:
        parser.error("--servers must be >= 1")
    if args.servers is not None and args.placement:
        parser.error("--servers is taken from --placement when one is given; drop one of them")
    if args.slots is not None and args.slots < 1:
        parser.error("--slots must be >= 1")
    if not args.cv_target >= 0:
        parser.error("--cv-target must be a number >= 0")
    if not args.warm_slack >= 0:
        parser.error("--warm-slack must be a number >= 0")
    if (args.servers or args.slots or args.save_after) and not args.balance:
        parser.error("--servers, --slots and --save-after go with --balance")
    return args


def fail(message: str) -> NoReturn:
    """Exit with status 2 and ``message``, as ``argparse`` does for a bad flag."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        windows = [w for w in read_dump(args.dump) if args.source in (None, w.source)]
    except (OSError, ValueError) as exc:
        fail(str(exc))
    if not windows:
        fail(f"{args.dump}: no load windows" + (f" of source {args.source!r}"
                                                      if args.source else ""))
    shapes = {(tuple(w.layers), w.num_experts) for w in windows}
    if len(shapes) > 1:
        fail(f"{args.dump}: windows differ in layers or experts; pick one --source")
    layers = list(windows[0].layers)
    loads = np.sum([w.array() for w in windows], axis=0).astype(np.float64)
    num_experts = loads.shape[1]
    try:
        before = read_holdings(args.placement, layers, num_experts) if args.placement else None
        after = read_holdings(args.after, layers, num_experts) if args.after else None
    except PlacementError as exc:
        fail(str(exc))
    if args.balance:
        if before is None:
            servers = args.servers or 4
            if servers > num_experts:
                fail(f"--servers {servers} is more than the {num_experts} experts")
            before = Holdings.uniform({f"local:{i}": b for i, b in
                                       enumerate(even_placement(num_experts, servers))}, layers)
        servers = list(before)
        slots = args.slots or 2 * -(-num_experts // len(servers))
        if slots * len(servers) < num_experts:
            fail(f"--slots {slots} on {len(servers)} servers cannot hold each of the "
                       f"{num_experts} experts once")
        after = balance_model(loads, layers, servers, slots, before, args.cv_target,
                              warm_slack=args.warm_slack)
        if args.save_after:
            try:
                args.save_after.write_text(json.dumps(after.to_message(), indent=1) + "\n")
            except OSError as exc:
                fail(f"--save-after {args.save_after}: cannot write it "
                     f"({exc.strerror or exc})")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--out {args.out}: cannot make that directory ({exc.strerror or exc})")
    written = [draw_load(args.out / "load.png", loads, layers, len(windows))]
    if before or after:
        written.append(draw_placement(args.out / "placement.png", loads, layers, before, after))
    for path in written:
        print(f"wrote {path}")
    for line in summary(loads, layers, before, after):
        print(line)
    return 0


def summary(loads: np.ndarray, layers: list[int], before: Holdings | None,
            after: Holdings | None) -> list[str]:
    """One line per layer: expert max/mean, server max/mean before and after, replicas."""
    lines = []
    for row, layer in enumerate(layers):
        mean = loads[row].mean()
        line = f"layer {layer}: expert max/mean {loads[row].max() / mean if mean else 1:.2f}"
        for name, model in (("before", before), ("after", after)):
            if model:
                placed = model.layer(layer)
                line += (f" | servers max/mean {name} "
                         f"{layer_load(placed, loads[row]).max_over_mean:.3f} "
                         f"({sum(map(len, placed.values()))} replicas)")
        lines.append(line)
    return lines


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        fail("drawing needs matplotlib: pip install 'sglang-eaas[bench]'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_load(path: Path, loads: np.ndarray, layers: list[int], windows: int) -> Path:
    plt = _pyplot()
    totals = loads.sum(axis=1, keepdims=True)
    share = np.divide(loads, totals, out=np.zeros_like(loads), where=totals > 0)
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * loads.shape[1] + 2), 1 + 0.5 * len(layers)))
    image = ax.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    _axes(ax, layers, "expert")
    ax.set_title(f"share of each layer's tokens ({windows} windows, "
                 f"{int(loads.sum())} token-entries)")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def draw_placement(path: Path, loads: np.ndarray, layers: list[int],
                   before: Holdings | None, after: Holdings | None) -> Path:
    plt = _pyplot()
    panels = [(name, m) for name, m in (("before", before), ("after", after)) if m]
    fig, axes = plt.subplots(2, len(panels), squeeze=False, figsize=(
        len(panels) * max(5, 0.25 * loads.shape[1] + 2), 2 + 1.0 * len(layers)))
    replicas = [np.stack([replica_counts(m.layer(layer), loads.shape[1]) for layer in layers])
                for _, m in panels]
    ratios = [np.stack([_server_ratio(m.layer(layer), loads[row])
                        for row, layer in enumerate(layers)]) for _, m in panels]
    top = max(int(r.max()) for r in replicas)  # one scale for before and after
    worst = max(2.0, max(float(r.max()) for r in ratios))  # 1.0 (even) in the middle
    for col, (name, model) in enumerate(panels):
        image = axes[0, col].imshow(replicas[col], aspect="auto", interpolation="nearest",
                                    cmap=plt.get_cmap("viridis", top + 1), vmin=-0.5,
                                    vmax=top + 0.5)
        _axes(axes[0, col], layers, "expert")
        axes[0, col].set_title(f"{name}: replicas per expert")
        fig.colorbar(image, ax=axes[0, col], ticks=range(top + 1))
        image = axes[1, col].imshow(ratios[col], aspect="auto", cmap="coolwarm", vmin=0,
                                    vmax=worst, interpolation="nearest")
        _axes(axes[1, col], layers, "server")
        axes[1, col].set_xticks(range(len(model)), list(model), rotation=90, fontsize=7)
        axes[1, col].set_title(f"{name}: server tokens / mean")
        fig.colorbar(image, ax=axes[1, col])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _server_ratio(placed: dict[str, tuple[int, ...]], load: np.ndarray) -> np.ndarray:
    tokens = layer_load(placed, load).tokens
    return tokens / tokens.mean() if tokens.mean() > 0 else np.ones_like(tokens)


def _axes(ax, layers: list[int], x_label: str) -> None:
    ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_ylabel("MoE layer")
    ax.set_xlabel(x_label)


if __name__ == "__main__":
    sys.exit(main())
