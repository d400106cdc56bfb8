"""``python -m sglang_eaas.expert_server --model-path M --experts SPEC [options]``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

from ibgda import TransportError
from sglang_eaas import envs, transports
from sglang_eaas.addresses import AddressError, parse_address
from sglang_eaas.model_info import ModelError, MoeModelInfo
from sglang_eaas.membership import HEARTBEAT, parse_monitor
from sglang_eaas.placement import PlacementError, parse_expert_list
from sglang_eaas.protocol.slot import POLL_SPIN_US


def parse_args(argv: list[str] | None = None):
    from sglang_eaas.expert_server.server import ExpertServerConfig
    from sglang_eaas.protocol.slot import DTYPE_SPELLINGS

    p = argparse.ArgumentParser(
        prog="python -m sglang_eaas.expert_server",
        description="A stateless expert server: holds some routed experts of each MoE layer "
        "of a checkpoint (the same in every layer, or per layer) and serves attention clients "
        "(SGLang with --eaas) over one-sided slots.",
    )
    p.add_argument("--model-path", help="HF checkpoint folder (config.json + safetensors); "
                   "only this server's experts are read from it; required unless --drain")
    p.add_argument("--experts", metavar="SPEC",
                   help="global expert ids to hold in every MoE layer: '0-3,6' or 'all' (layers "
                   "named by --layer-experts excepted)")
    p.add_argument("--layer-experts", action="append", default=[], metavar="LAYER=SPEC",
                   help="the experts to hold in one MoE layer instead ('1=4-7'; 'none' holds "
                   "none there); repeat for more layers")
    p.add_argument("--part", metavar="P/N", default=None,
                   help="hold part P of N of each expert --experts and --layer-experts name, "
                   "instead of the whole expert: rows P*I/N to (P+1)*I/N-1 of its gate and up "
                   "projections and those columns of its down projection (tensor parallelism: "
                   "N servers holding parts 0 to N-1 serve the layer together, each token's "
                   "entry sent to all of them and their sums added; docs/switching.md). N must "
                   "divide the experts' intermediate size; default: whole experts")
    p.add_argument("--standby", action="store_true",
                   help="start holding no experts, warm (model config read, kernels built, "
                   "registered with --monitor, which it needs), to be filled by a placement: a "
                   "resize (python -m sglang_eaas.tools.scale) takes standby servers before it "
                   "starts new ones")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="control endpoint where clients join (port 0: pick a free one and print "
                   "it); default %(default)s")
    p.add_argument("--ready-file", default=None, metavar="PATH",
                   help="once serving (and registered with --monitor), write the control "
                   "endpoint's HOST:PORT to PATH, whole (a rename): how a launcher that gave "
                   "--listen port 0 learns which port this server took (the launcher's "
                   "local:N servers are started so, leaving no moment in which another "
                   "process could take a port picked for them)")
    p.add_argument("--token", default=None,
                   help="shared secret clients must present (default: the SGLANG_EAAS_TOKEN "
                   "environment variable, which keeps it off the command line); required")
    p.add_argument("--dtype", default="auto", type=str.lower,
                   choices=["auto", *DTYPE_SPELLINGS],
                   help="weights dtype, spelled as SGLang's --dtype ('half' = float16, 'float' = "
                   "float32); 'auto' keeps the checkpoint's. A client with another dtype is "
                   "served with conversion")
    p.add_argument("--transport", "--eaas-transport", default=transports.AUTO,
                   choices=transports.CHOICES,
                   help="how clients reach the slots (--eaas-transport: the same flag under "
                   "SGLang's name): " + transports.HELP + "'shm' when --listen is a loopback "
                   "address, else 'mooncake'; default %(default)s")
    p.add_argument("--max-clients", type=int, default=8,
                   help="client slots (one per attention rank, two per rank with two-batch "
                   "overlap); default %(default)s")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="tokens per request a slot holds; clients split larger batches; "
                   "default %(default)s")
    p.add_argument("--min-batch-tokens", type=int, default=1,
                   help="wait for at least this many ready tokens (across clients and layers) "
                   "before computing, up to --max-wait-us; default %(default)s")
    p.add_argument("--max-wait-us", type=int, default=0,
                   help="longest wait for --min-batch-tokens, in microseconds; default %(default)s")
    p.add_argument("--poll-spin-us", type=int, default=POLL_SPIN_US,
                   help="after serving, busy-poll the slots this long (yielding the core to "
                   "other runnable processes between polls) before sleeping on the doorbell: "
                   "saves the tens of microseconds of a wake-up per request; 0 sleeps at "
                   "once; default %(default)s")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (the server's whole CPU budget); default "
                   "%(default)s")
    p.add_argument("--kernel", default="fast", choices=["fast", "reference"],
                   help="the expert math: 'fast' runs each layer's active experts in one C++ "
                   "grouped kernel (float32 sums, every active expert's weights read once; built "
                   "by scripts/setup.sh, else on first start); 'reference' runs SGLang's "
                   "moe_forward_native ops one expert at a time, bit for bit as monolithic "
                   "SGLang computes them; default %(default)s")
    p.add_argument("--disable-shrink", action="store_true",
                   help="with --kernel fast: hand the kernel every expert of the layer, empty "
                   "ones included, instead of only the active ones (group shrink), for "
                   "ablations; the outputs are the same")
    p.add_argument("--weight-fabric", default="map", choices=["map", "copy", "off"],
                   help="where the weights live and how replicas are filled from a peer: 'map' "
                   "keeps every layer in a region of the weight fabric (shared memory with "
                   "--transport shm, Mooncake with mooncake) that peers read one-sidedly, and "
                   "maps a peer's layer in place, without a copy, where this server holds none "
                   "of that layer yet and the peer is on this host with the same dtype; 'copy' "
                   "always reads a peer's rows into its own region; 'off' keeps weights in "
                   "plain memory and moves them over the control channel (the slow path; "
                   "docs/elastic.md); default %(default)s")
    p.add_argument("--spare-experts", type=int, default=None, metavar="N",
                   help="rows of room per MoE layer past the experts held, in the layer's "
                   "fabric region, faulted in at start: replicas added later are written there "
                   "in place (warm memory, nothing else copied) until they run out, then the "
                   "layer is compacted into a new region with N spare rows again (a standby "
                   "server reserves a region of N rows per MoE layer for its first fill); "
                   "default: a quarter of the most experts held in a layer (at least 2), for a "
                   "standby server a quarter of the model's experts")
    p.add_argument("--fill-threads", type=int, default=None, metavar="N",
                   help="threads that copy a fill's rows from a peer on this host (a copy of "
                   "this size is bound by how many cores write); default: this machine's "
                   "cores, at most 8")
    p.add_argument("--monitor", default="", metavar="ADDR",
                   help="register with this monitor, so that clients find this server, start "
                   "sending to it at their next step and fail over when it is lost: an SGLang "
                   "launcher's embedded monitor or a standalone one (HOST:PORT; python -m "
                   "sglang_eaas.monitor), or etcd://HOST:PORT; default: none (clients must be "
                   "given this server's address)")
    p.add_argument("--heartbeat", type=float, default=HEARTBEAT, metavar="SECONDS",
                   help="seconds between heartbeats to --monitor (at most half its loss "
                   "timeout); default %(default)s")
    p.add_argument("--drain", metavar="HOST:PORT",
                   help="instead of serving: make the running expert server at HOST:PORT leave "
                   "gracefully (its clients stop sending to it at their next step, in-flight "
                   "work finishes, then it exits) and wait until it has exited; it needs a "
                   "--monitor. Refused where it is the last live holder of an expert, unless "
                   "--force")
    p.add_argument("--force", action="store_true",
                   help="with --drain: drain even the last live holder of an expert (requests "
                   "that need it then fail)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="with --drain: exit after this long even if clients still use the "
                   "server; default %(default)s")
    p.add_argument("--log-level", default="info", help="logging level; default %(default)s")
    args = p.parse_args(argv)
    token = envs.TOKEN.get() if args.token is None else args.token
    if args.drain is not None:
        try:
            parse_address(args.drain)
        except AddressError as exc:
            p.error(f"--drain: {exc}")
        if not token:
            p.error(f"--drain needs the shared token: pass --token or set {envs.TOKEN.name}")
        return args, token
    if args.model_path is None:
        p.error("--model-path is required (unless --drain)")
    if args.standby and (args.experts is not None or args.layer_experts):
        p.error("--standby starts holding no experts: leave out --experts and --layer-experts")
    if args.standby and args.part is not None:
        p.error("--standby starts holding nothing: leave out --part")
    if args.standby and not args.monitor:
        p.error("--standby needs --monitor: a standby server is found through its monitor")
    if args.monitor:
        try:
            parse_monitor(args.monitor, embedded_ok=False)
        except ValueError as exc:
            p.error(f"--monitor: {exc}")
    if args.disable_shrink and args.kernel != "fast":
        p.error("--disable-shrink applies to --kernel fast only")
    if not args.heartbeat > 0:
        p.error("--heartbeat must be > 0")
    try:
        host, port = parse_address(args.listen, allow_port_zero=True)
    except AddressError as exc:
        p.error(f"--listen: {exc}")
    if args.ready_file is not None and not Path(args.ready_file).parent.is_dir():
        p.error(f"--ready-file: {Path(args.ready_file).parent} is not a folder")
    if not token:
        p.error(f"an expert server needs a shared token: pass --token or set {envs.TOKEN.name}")
    for flag in ("max_clients", "max_tokens", "min_batch_tokens", "threads"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.spare_experts is not None and args.spare_experts < 0:
        p.error("--spare-experts must be >= 0")
    if args.fill_threads is not None and args.fill_threads < 1:
        p.error("--fill-threads must be >= 1")
    for flag in ("max_wait_us", "poll_spin_us"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0")
    try:
        info = MoeModelInfo.from_model_path(args.model_path)
        experts = [] if args.experts is None else parse_expert_list(args.experts,
                                                                    info.num_experts)
        layer_experts = _layer_experts(args.layer_experts, info)
        held = {e for ids in [experts, *layer_experts.values()] for e in ids}
        if not held and not args.standby:
            raise PlacementError("an expert server holds at least one expert: give --experts "
                                 "or --layer-experts (or start it empty with --standby)")
        if held and max(held) >= info.num_experts:
            raise PlacementError(f"expert {max(held)} does not exist: the model has "
                                 f"{info.num_experts}")
        part = None if args.part is None else _part(args.part, info)
    except (ModelError, PlacementError) as exc:
        p.error(str(exc))
    return args, ExpertServerConfig(
        model_path=args.model_path, experts=tuple(experts), host=host, port=port, token=token,
        dtype=args.dtype, transport=args.transport, max_clients=args.max_clients,
        max_tokens=args.max_tokens, min_batch_tokens=args.min_batch_tokens,
        max_wait_us=args.max_wait_us, poll_spin_us=args.poll_spin_us, threads=args.threads,
        layer_experts=layer_experts, monitor=args.monitor, heartbeat=args.heartbeat,
        kernel=args.kernel, shrink=not args.disable_shrink, weight_fabric=args.weight_fabric,
        spare_experts=-1 if args.spare_experts is None else args.spare_experts,
        fill_threads=args.fill_threads or 0, part=part,
    )


def _part(spec: str, info: MoeModelInfo) -> tuple[int, int]:
    """``--part P/N`` -> ``(P, N)``; ``PlacementError`` in one sentence for anything else."""
    from sglang_eaas.slices import Part

    index, sep, parts = spec.partition("/")
    if not sep or not index.strip().isdigit() or not parts.strip().isdigit():
        raise PlacementError(f"--part {spec!r} is not P/N, part P of N (e.g. 0/2)")
    if int(parts) < 2:
        raise PlacementError(f"--part {spec!r}: an expert is cut into at least 2 parts (a "
                             "whole expert needs no --part)")
    try:
        Part(int(index), int(parts)).check(info.moe_intermediate_size)
    except ValueError as exc:
        raise PlacementError(f"--part {spec!r}: {exc}") from None
    return int(index), int(parts)


def _layer_experts(specs: list[str], info: MoeModelInfo) -> dict[int, tuple[int, ...]]:
    """``--layer-experts LAYER=SPEC`` values -> ``{layer: experts}``."""
    out: dict[int, tuple[int, ...]] = {}
    for spec in specs:
        layer, sep, ids = spec.partition("=")
        if not sep or not layer.strip().isdigit():
            raise PlacementError(f"--layer-experts {spec!r} is not LAYER=SPEC (e.g. 1=4-7)")
        layer_id = int(layer)
        if layer_id not in info.moe_layers:
            raise PlacementError(f"--layer-experts {spec!r}: layer {layer_id} is not an MoE "
                                 f"layer (those are {list(info.moe_layers)})")
        if layer_id in out:
            raise PlacementError(f"--layer-experts names layer {layer_id} twice")
        out[layer_id] = (() if ids.strip() == "none" else
                         tuple(parse_expert_list(ids, info.num_experts)))
    return out


def drain(address: str, token: str, force: bool, timeout: float) -> int:
    """``--drain``: ask the server at ``address`` to leave, then wait until it has exited."""
    from sglang_eaas.protocol.control import Drain, Stats
    from sglang_eaas.protocol.lines import Channel

    try:
        channel = Channel(address, token)
        clients = channel.call(Drain(force, timeout)).clients
    except TransportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"expert server {address} is draining ({clients} clients joined)", flush=True)
    deadline = time.monotonic() + timeout + 30
    try:
        while time.monotonic() < deadline:  # its connections close when it exits
            channel.call(Stats())
            time.sleep(0.2)
        print(f"error: expert server {address} is still up after {timeout + 30:.0f}s",
              file=sys.stderr)
        return 1
    except TransportError:
        print(f"expert server {address} has left", flush=True)
        return 0
    finally:
        channel.close()


def _write_whole(path: Path, text: str) -> None:
    """``text`` in ``path``, which a reader finds absent or whole, never half written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text + "\n")
    partial.replace(path)


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.drain is not None:
        return drain(args.drain, config, args.force, args.drain_timeout)  # config: the token
    logging.basicConfig(level=args.log_level.upper(),
                        format="[%(asctime)s expert-server] %(message)s")
    from sgl_kernel_ext.cpu_ops import KernelUnavailable
    from sglang_eaas.expert_server.server import ExpertServer

    try:
        server = ExpertServer(config)
    except (KernelUnavailable, TransportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    try:
        server.start()
    except TransportError as exc:
        server.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    held = ("standby: no experts (filled by a placement)" if args.standby else
            f"part {config.part[0]} of {config.part[1]} of experts per MoE layer "
            f"{ {layer: held.experts() for layer, held in server.held.holdings.parts.items()} }"
            if config.part else
            f"experts {list(config.experts)}" if not config.layer_experts else
            f"experts per MoE layer {server.held.holdings}")
    print(f"sglang-eaas expert server ready on {server.address}: {held} of "
          f"{server.info.num_experts}, "
          f"{len(server.info.moe_layers)} MoE layers, "
          f"{server.held.weight_bytes() / 2**20:.1f} MiB of weights"
          + (f", registered with {config.monitor}" if config.monitor else ""), flush=True)
    if args.ready_file:
        _write_whole(Path(args.ready_file), server.address)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
