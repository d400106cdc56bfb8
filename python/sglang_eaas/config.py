"""``--eaas`` command-line options and the ``EaasConfig`` record they produce.

The record rides on SGLang's ``ServerArgs`` as the bookkeeping attribute ``_eaas`` (a plugin
cannot add struct fields), which SGLang pickles into every scheduler/detokenizer process. Before
the workers start, the launcher replaces it with the concrete server addresses
(``launcher.prepare``). Everything that can be checked before the launch is checked here, where
a bad value is one sentence and an exit (``from_cli_args``): the placement file is read and
checked against the model once, ESFT adapters are checked against the model and the budget.
What ties the record to the plugin (the ``--eaas`` flag refused, and a worker stopped, where the
plugin is not active) is the plugin's: ``plugin.py`` sits on top of this module.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from sglang_eaas import transports
from sglang_eaas.addresses import AddressError, parse_address
from sglang_eaas.balance.policy import MODES as BALANCE_MODES, BalanceSettings
from sglang_eaas.elastic.autoscaler import ACTS, AutoscalePolicy, AutoscaleSettings
from sglang_eaas.elastic.layout_policy import LAYOUT_MODES, LayoutPolicy, LayoutSettings
from sglang_eaas.esft.adapter import AdapterError, default_max_experts, load_adapter
from sglang_eaas.membership import (
    HEARTBEAT, LOSS_TIMEOUT, SUSPECT_TIMEOUT, MonitorSpec, parse_monitor, suspect_timeout,
)
from sglang_eaas.model_info import ModelError, MoeModelInfo
from sglang_eaas.placement import PlacementError, PlacementFile, load_placement_file
from sglang_eaas.protocol.slot import POLL_SPIN_US
from sglang_eaas.routing_table import RoutingTable

RESULT_TIMEOUT = 2.0  # seconds a server may take to answer one layer before it is dropped
WAIT_FOR_SERVERS = 300.0  # seconds to wait at launch for every expert to have a live holder
LOAD_WINDOW = 16  # steps per load window (client/load_recorder.py's DEFAULT_WINDOW_STEPS)


@dataclass(frozen=True)
class LocalServers:
    """Spawn ``count`` expert servers on this host (``local:N``)."""

    count: int


@dataclass(frozen=True)
class RemoteServers:
    """Connect to expert servers started separately (``host:port,host:port``)."""

    addresses: tuple[str, ...]


def parse_expert_servers(spec: str) -> LocalServers | RemoteServers:
    """Parse ``--eaas-expert-servers``; raises ``argparse.ArgumentTypeError`` on bad input."""
    spec = spec.strip()
    if spec.startswith("local:"):
        count = spec[len("local:") :]
        if not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"'local:N' needs a whole number N >= 1, got {spec!r}")
        return LocalServers(int(count))
    addresses = tuple(a.strip() for a in spec.split(",") if a.strip())
    for address in addresses:
        try:
            parse_address(address)
        except AddressError as exc:
            raise argparse.ArgumentTypeError(
                f"{exc}; expected 'local:N' or HOST:PORT expert-server addresses") from None
    if len(set(addresses)) != len(addresses):
        raise argparse.ArgumentTypeError(f"{spec!r} names an expert server twice")
    if not addresses:
        raise argparse.ArgumentTypeError("expected 'local:N' or a list of host:port addresses")
    return RemoteServers(addresses)


def _non_negative(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of microseconds >= 0, got "
                                         f"{value!r}")
    return int(value)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {value!r}")
    return seconds


def _monitor(spec: str) -> MonitorSpec:
    try:
        return parse_monitor(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def existing_file(path: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"{path!r} is not a readable file")
    return p


def _steps(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps >= 1, got {value!r}")
    return int(value)


def writable_file(path: str) -> Path:
    """A file that can be appended to (created if missing); refuses what cannot."""
    p = Path(path)
    folder = p.parent
    why = (f"{path!r} is a directory" if p.is_dir() else
           f"its folder {str(folder)!r} does not exist" if not folder.is_dir() else
           f"{path!r} is not writable" if p.exists() and not os.access(p, os.W_OK) else
           f"its folder {str(folder)!r} is not writable"
           if not p.exists() and not os.access(folder, os.W_OK | os.X_OK) else None)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write to {path!r}: {why}")
    return p


def _adapters(spec: str) -> tuple[tuple[str, str], ...]:
    """Parse ``--eaas-esft-adapters NAME=PATH,...``: each PATH an adapter directory."""
    out: list[tuple[str, str]] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=PATH[,NAME=PATH...], got {item!r}")
        if ":" in name:
            raise argparse.ArgumentTypeError(f"adapter name {name!r} may not contain ':' (a "
                                             "request's model 'base:adapter' splits on it)")
        if not Path(path.strip()).is_dir():
            raise argparse.ArgumentTypeError(f"adapter {name.strip()}: {path.strip()!r} is not "
                                             "a directory")
        if name.strip() in dict(out):
            raise argparse.ArgumentTypeError(f"adapter name {name.strip()!r} is given twice")
        out.append((name.strip(), str(Path(path.strip()).resolve())))
    return tuple(out)


def _count(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return number


DEFAULT_LOCAL_SERVERS = 2  # --eaas without --eaas-expert-servers, placement or shared monitor


@dataclass(frozen=True)
class LocalSpawn:
    """How the launcher started its local expert servers, so that more can be started alike
    (a resize: launcher/admin.py): their dtype, client slots and flags (but --monitor)."""

    dtype: str
    max_clients: int
    flags: tuple[str, ...]


@dataclass(frozen=True)
class EaasConfig:
    """What the attention client needs to know about its expert servers."""

    expert_servers: LocalServers | RemoteServers | None = None  # None: local:2 or the placement
    placement: PlacementFile | None = None  # --eaas-placement, read and checked
    token: str | None = field(default=None, repr=False)  # else SGLANG_EAAS_TOKEN
    transport: str = transports.AUTO
    # Busy-poll for a result this long, then sleep; None: automatic (the launcher's
    # client_poll_spin_us: 0 when local expert servers share the cores, else POLL_SPIN_US).
    poll_spin_us: int | None = None
    # The monitor: as given (embedded by default); the launcher replaces an embedded one by
    # the address it listens on, so workers get a HOST:PORT or etcd:// URL.
    monitor: MonitorSpec | str = field(default_factory=lambda: parse_monitor("embedded"))
    heartbeat: float = HEARTBEAT
    loss_timeout: float = LOSS_TIMEOUT  # an embedded monitor's
    result_timeout: float = RESULT_TIMEOUT
    wait_for_servers: float = WAIT_FOR_SERVERS
    kernel: str | None = None  # local expert servers' --kernel; None: theirs (fast)
    shrink: bool = True  # False: local expert servers get --disable-shrink
    overlap: bool = True  # False (--eaas-disable-overlap): no two-batch overlap
    load_dump: Path | None = None  # --eaas-load-dump: each rank's load windows, appended
    load_window: int = LOAD_WINDOW  # steps per load window
    esft: bool = False  # serve ESFT adapters (--eaas-esft, or --eaas-esft-adapters given)
    esft_adapters: tuple[tuple[str, str], ...] = ()  # (name, directory) loaded at launch
    esft_slots: int | None = None  # adapter expert ids per MoE layer; None: 4 x the experts
    esft_max_experts: int | None = None  # per adapter and MoE layer; None: a quarter of them
    esft_replicas: int = 1  # servers holding each adapter expert
    spawn: LocalSpawn | None = None  # set by the launcher where it started the servers
    autoscale: AutoscaleSettings | None = None  # --eaas-autoscale
    layout: LayoutSettings | None = None  # --eaas-layout tp|auto (None: ep, as started)
    balance: BalanceSettings | None = None  # --eaas-balance reactive|predictive (None: off)
    max_servers: int | None = None  # --eaas-max-servers (None: what the placement can use)
    suspect_timeout: float = SUSPECT_TIMEOUT  # an embedded monitor's
    # Torch intra-op threads of each SGLang rank; None: SGLang's (all usable cores). Set by the
    # launcher where it starts local expert servers (cores.rank_threads).
    rank_threads: int | None = None

    def adapter_slots(self, num_experts: int) -> int:
        """Expert ids per MoE layer past the model's ``num_experts`` (0 without ESFT)."""
        if not self.esft:
            return 0
        return self.esft_slots if self.esft_slots is not None else 4 * num_experts

    def adapter_budget(self, num_experts: int) -> int:
        """The most experts one adapter may replace in one MoE layer."""
        return (self.esft_max_experts if self.esft_max_experts is not None
                else default_max_experts(num_experts))


class _EnableEaas(argparse.Action):
    """``--eaas``: refuses at parse time what ``refusal()`` says (the plugin not active)."""

    def __init__(self, *args, refusal: Callable[[], str | None] = lambda: None, **kwargs):
        super().__init__(*args, **kwargs)
        self.refusal = refusal

    def __call__(self, parser, namespace, values, option_string=None):
        why = self.refusal()
        if why:
            parser.error(why)
        setattr(namespace, self.dest, True)


def add_cli_args(parser: argparse.ArgumentParser,
                 refusal: Callable[[], str | None] = lambda: None) -> None:
    """Add the ``--eaas`` option group to SGLang's server parser; ``refusal()``: why ``--eaas``
    cannot be served in this process, if it cannot (the plugin's check)."""
    group = parser.add_argument_group(
        "sglang-eaas", "Expert-as-a-Service: routed MoE experts on separate expert servers."
    )
    group.add_argument(
        "--eaas",
        action=_EnableEaas,
        refusal=refusal,
        nargs=0,
        default=False,
        help="Serve the routed experts of every MoE layer on separate, stateless expert servers; "
        "attention, router and shared experts stay in this server.",
    )
    group.add_argument(
        "--eaas-expert-servers",
        type=parse_expert_servers,
        default=None,
        metavar="SPEC",
        help="Where the expert servers are: 'local:N' spawns N expert servers on this host with an "
        "even expert placement (default: local:2, or the servers of --eaas-placement); "
        "'host:port,host:port,...' connects to servers started separately with "
        "'python -m sglang_eaas.expert_server'.",
    )
    group.add_argument(
        "--eaas-placement",
        type=existing_file,
        default=None,
        metavar="FILE",
        help="File mapping each expert server to the experts it holds (replicas allowed), "
        "instead of the even placement; format in docs/plugin.md. Read and checked against the "
        "model (every expert of every MoE layer held somewhere) before anything starts.",
    )
    group.add_argument(
        "--eaas-token",
        default=None,
        metavar="TOKEN",
        help="Shared secret of the expert servers' control endpoints (default: the "
        "SGLANG_EAAS_TOKEN environment variable, which keeps it off the command line; "
        "generated when local servers are spawned and none is set).",
    )
    group.add_argument(
        "--eaas-transport",
        default=None,
        choices=transports.CHOICES,
        help="How this server reaches the expert servers' slots: " + transports.HELP + "take "
        "what each server offers, and start local servers with 'shm' (default: auto).",
    )
    group.add_argument(
        "--eaas-poll-spin-us",
        type=_non_negative,
        default=None,
        metavar="US",
        help="After sending a layer's requests, busy-poll for the results this long (yielding "
        "the core to other runnable processes between polls) before sleeping on the result "
        "doorbell; 0 sleeps at once. Local expert servers get the same value for their wait "
        f"between requests. Default: {POLL_SPIN_US} (servers: theirs), but 0 for SGLang's "
        "ranks when local expert servers and the ranks together outnumber the cores (a "
        "spinning rank would take a core from the servers it waits for).",
    )
    group.add_argument(
        "--eaas-monitor",
        type=_monitor,
        default=None,
        metavar="ADDR",
        help="The monitor that expert servers and this server's ranks register and heartbeat "
        "with, and that tells every client of joins, drains and losses: 'embedded' (default: "
        "started by this launcher on a free loopback port), 'embedded:HOST:PORT' (the same, "
        "where separately started servers can reach it: --monitor HOST:PORT), 'HOST:PORT' (a "
        "standalone 'python -m sglang_eaas.monitor' or another SGLang's embedded one, to share "
        "one pool of expert servers; without --eaas-expert-servers, the servers registered "
        "there are used) or 'etcd://HOST:PORT' (an etcd cluster, for multi-host deployments).",
    )
    group.add_argument(
        "--eaas-heartbeat",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help=f"Seconds between heartbeats to the monitor, for this server's ranks and its local "
        f"expert servers (default: {HEARTBEAT}; at most half the suspect timeout).",
    )
    group.add_argument(
        "--eaas-suspect-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help=f"An embedded monitor suspects a member that has not heartbeated for this long: "
        f"clients send its experts' tokens to their other holders until it heartbeats again "
        f"(default: {SUSPECT_TIMEOUT}, or the loss timeout if shorter; a standalone monitor has "
        "its own --suspect-timeout).",
    )
    group.add_argument(
        "--eaas-loss-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help=f"An embedded monitor loses a member that has not heartbeated for this long "
        f"(default: {LOSS_TIMEOUT}). A killed process is lost at once (its connections close) "
        "and a hung expert server at a client's --eaas-result-timeout, so this only bounds "
        "what nothing else sees, such as a partition from the monitor alone; a standalone "
        "monitor has its own --loss-timeout.",
    )
    group.add_argument(
        "--eaas-result-timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help=f"An expert server that has not answered one layer's request after this long is "
        f"dropped from the routing table and the tokens go to other holders of their experts "
        f"(default: {RESULT_TIMEOUT}); sizing it: docs/fault-tolerance.md.",
    )
    group.add_argument(
        "--eaas-wait-for-servers",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="With a shared monitor and no --eaas-expert-servers: how long the launch waits "
        f"for every expert to have a live holder there (default: {WAIT_FOR_SERVERS:.0f}).",
    )
    group.add_argument(
        "--eaas-kernel",
        default=None,
        choices=("fast", "reference"),  # expert_server.compute.KERNELS
        help="The expert math of the local expert servers this launcher starts (their "
        "--kernel): 'fast' runs a layer's active experts in one C++ grouped kernel (float32 "
        "sums, every active expert's weights read once), 'reference' runs SGLang's "
        "moe_forward_native ops expert by expert, bit for bit as without --eaas (default: fast).",
    )
    group.add_argument(
        "--eaas-disable-shrink",
        action="store_true",
        default=None,
        help="Ablation: the local expert servers' fast kernel walks every expert of a layer, "
        "empty ones included, instead of only the active ones (their --disable-shrink); the "
        "outputs are the same.",
    )
    group.add_argument(
        "--eaas-disable-overlap",
        action="store_true",
        default=None,
        help="Ablation: serve without two-batch overlap. By default --eaas turns on SGLang's "
        "--enable-two-batch-overlap where it runs with the expert servers (Qwen3-MoE at --tp 1, "
        "without LoRA, speculative decoding, --pp or attention DP): while one micro-batch's "
        "tokens are at the servers, the other's attention runs. Not by default when local "
        "expert servers and SGLang's ranks outnumber the cores: there is no idle core to hide "
        "the second pass over the experts' weights in (--enable-two-batch-overlap still turns "
        "it on). The outputs are the same.",
    )
    group.add_argument(
        "--eaas-load-dump",
        type=writable_file,
        default=None,
        metavar="PATH",
        help="Append every load window (tokens each rank routed to each expert of each MoE "
        "layer over --eaas-load-window steps) to this JSON-lines file, one window per line "
        "(sglang_eaas.balance.load.read_dump reads it); with --tp > 1 each rank writes its own "
        "file, with '.rankN' inserted before the extension.",
    )
    group.add_argument(
        "--eaas-load-window",
        type=_steps,
        default=None,
        metavar="STEPS",
        help=f"Scheduler steps per load window: the unit of the expert-load counts on /metrics, "
        f"in --eaas-load-dump and in the heartbeat to the monitor (default: {LOAD_WINDOW}).",
    )
    group.add_argument(
        "--eaas-esft",
        action="store_true",
        default=None,
        help="Serve ESFT (expert-specialised fine-tuning) adapters over the base model: their "
        "experts go to the expert servers, and each request's tokens are rerouted to its "
        "adapter's experts. Implied by --eaas-esft-adapters; alone, adapters are loaded at "
        "runtime through SGLang's /load_lora_adapter. Requests pick one as SGLang's LoRA "
        "adapters (OpenAI model 'BASE:NAME' or 'NAME', or lora_path). See docs/esft.md.",
    )
    group.add_argument(
        "--eaas-esft-adapters",
        type=_adapters,
        default=None,
        metavar="NAME=PATH[,NAME=PATH...]",
        help="ESFT adapters to serve from the start: each PATH a directory with "
        "expert_config.json and adapter.safetensors (python -m sglang_eaas.tools.esft). The "
        "launch fails if one cannot be placed.",
    )
    group.add_argument(
        "--eaas-esft-slots",
        type=_count,
        default=None,
        metavar="N",
        help="Expert ids per MoE layer for adapters' experts, past the model's own (the "
        "routing table's width; memory grows only with the experts adapters really replace). "
        "Loading an adapter fails when a layer has too few left (default: 4 x the model's "
        "routed experts).",
    )
    group.add_argument(
        "--eaas-esft-max-experts",
        type=_count,
        default=None,
        metavar="N",
        help="The most experts one adapter may replace in one MoE layer; an adapter with more "
        "is refused (at launch for --eaas-esft-adapters, at /load_lora_adapter later); default: "
        "a quarter of the model's routed experts, what 'python -m sglang_eaas.tools.esft random' "
        "replaces at most by default.",
    )
    group.add_argument(
        "--eaas-esft-replicas",
        type=_count,
        default=None,
        metavar="N",
        help="Expert servers holding each adapter expert (default 1): with 2 or more, a "
        "server holding adapter experts can die without failing the adapter's requests.",
    )
    group.add_argument(
        "--eaas-max-servers",
        type=_count,
        default=None,
        metavar="N",
        help="The most active expert servers a resize of the tier may ask for (the admin API, "
        "python -m sglang_eaas.tools.scale, the autoscaler); more is refused before anything "
        "starts. Default, and always at most: what the placement can use, the fewest expert "
        "replicas of any MoE layer (more servers would hold nothing there).",
    )
    group.add_argument(
        "--eaas-autoscale",
        action="store_true",
        default=None,
        help="Size the expert tier to the load (docs/elastic.md): the scheduler judges the "
        "SLO attainment of finished requests every window against --eaas-autoscale-ttft and "
        "--eaas-autoscale-tpot (both needed), asks for one more expert server after persistent "
        "violation (with the expert servers busy enough) and one fewer after persistent "
        "slack (p90 latencies at most half the targets, the other servers not too busy "
        "after), at most once per cooldown. Off by default.",
    )
    for flag, kind, meta, text in (
            ("ttft", float, "SECONDS", "target time to first token"),
            ("tpot", float, "SECONDS", "target time per output token"),
            ("attainment", float, "SHARE", "share of requests that must meet both targets "
             "(default 0.9)"),
            ("window", float, "SECONDS", "finished requests judged together (default 20)"),
            ("cooldown", float, "SECONDS", "least time between two decisions (default 60)"),
            ("min-servers", _count, "N", "fewest active expert servers (default 1)"),
            ("max-servers", _count, "N", "most active expert servers (default 8)"),
            ("busy-out", float, "SHARE", "scale out only with the active expert servers at "
             "least this busy (their mean share of time serving batches over the window; "
             "default 0.2; 0 turns the check off): where they idle, the latency is not theirs"),
            ("busy-in", float, "SHARE", "scale in only if the servers left would be at most "
             "this busy (default 0.6)")):
        group.add_argument(f"--eaas-autoscale-{flag}", type=kind, default=None, metavar=meta,
                           help=f"With --eaas-autoscale: {text}.")
    group.add_argument(
        "--eaas-autoscale-act",
        choices=ACTS,
        default=None,
        help="With --eaas-autoscale: 'resize' (default) resizes the tier itself (standby "
        "servers first, then local processes where this launcher started the tier); "
        "'publish' only publishes the desired count (/metrics, GET /eaas/tier) for an "
        "orchestrator that owns the servers to act on.",
    )

    group.add_argument(
        "--eaas-layout",
        choices=LAYOUT_MODES,
        default=None,
        help="How the expert tier lays its experts out (docs/switching.md): 'ep' (default) "
        "whole experts, each token's entry sent to one holder; 'tp' every expert cut into one "
        "part per expert server, every entry sent to all of them (the tier is switched to it "
        "at start, in place); 'auto' switches between the two while serving, when a cost model "
        "fitted on this machine (scripts/bench_switch.py) predicts the other layout saves at "
        "least --eaas-layout-margin of the MoE time per step for --eaas-layout-patience load "
        "windows in a row, at most once per --eaas-layout-dwell. 'tp' and 'auto' need a "
        "monitor (the embedded one counts).",
    )
    for flag, kind, meta, text in (
            ("margin", float, "SHARE", "least predicted saving that switches (default 0.1)"),
            ("patience", _count, "N", "load windows in a row that must predict it (default 2)"),
            ("dwell", float, "SECONDS", "least time between two switches (default 30)"),
            ("cost", Path, "FILE", "the cost model, as scripts/bench_switch.py writes it "
             "(default: the one fitted on the project's machine, in the package)")):
        group.add_argument(f"--eaas-layout-{flag}", type=kind, default=None, metavar=meta,
                           help=f"With --eaas-layout auto: {text}.")


    group.add_argument(
        "--eaas-balance",
        choices=BALANCE_MODES,
        default=None,
        help="Re-place replicated experts while serving (docs/balancing.md, 'In the serving "
        "stack'): every --eaas-balance-period seconds attention rank 0 looks at a load "
        "estimate and, when its busiest expert server is above --eaas-balance-trigger times "
        "the mean and a plan on the same slots lowers it, re-places (after the estimate "
        "settled, at most once per --eaas-balance-cooldown, at most --eaas-balance-budget "
        "replicas at once), as an operation of the tier controller over the weight fabric. "
        "'predictive' plans on a forecast of the next --eaas-balance-horizon seconds of decode "
        "load from the running requests' own routing (their prefill's first); 'reactive' on "
        "the entries the expert servers computed over the last --eaas-balance-horizon "
        "seconds; 'off' (default) does neither. Needs a monitor (the embedded one counts); "
        "with --enable-metrics, /metrics shows the forecast's accuracy and cost.",
    )
    for flag, kind, meta, text in (
            ("period", float, "SECONDS", "seconds between looks (default 1)"),
            ("horizon", float, "SECONDS", "seconds of load an estimate covers (default 5)"),
            ("trigger", float, "RATIO", "busiest server over the mean above which a MoE layer "
             "is imbalanced (default 1.15)"),
            ("cooldown", float, "SECONDS", "least time between two re-placements, unless the "
             "mix shifted (default 15)"),
            ("shift", float, "OVERLAP", "within the cooldown, an estimate that overlaps the "
             "load the last re-placement planned on by less than this (0-1) is a new mix, and "
             "ends the cooldown (default 0.8; 0: never)"),
            ("budget", _count, "N", "most replicas one re-placement adds (default 64)"),
            ("slots", _count, "N", "experts of one MoE layer an expert server may hold "
             "(default: what the fullest one holds now, so memory does not grow)")):
        group.add_argument(f"--eaas-balance-{flag}", type=kind, default=None, metavar=meta,
                           help=f"With --eaas-balance reactive|predictive: {text}.")


LOCAL_ONLY = ("--eaas-kernel and --eaas-disable-shrink apply to the local expert servers this "
              "launcher starts; give servers started separately --kernel and --disable-shrink "
              "instead")


def from_cli_args(args: argparse.Namespace) -> EaasConfig | None:
    """Build the config from parsed args; ``None`` without ``--eaas``.

    Raises ``ValueError`` when an ``--eaas-*`` option is given without ``--eaas``, or with
    SGLang options that expert servers replace.
    """
    if not getattr(args, "eaas", False):
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("eaas_expert_servers", "eaas_placement", "eaas_token", "eaas_transport",
                         "eaas_poll_spin_us", "eaas_monitor", "eaas_heartbeat",
                         "eaas_loss_timeout", "eaas_suspect_timeout", "eaas_result_timeout",
                         "eaas_wait_for_servers",
                         "eaas_kernel", "eaas_disable_shrink", "eaas_disable_overlap",
                         "eaas_load_dump", "eaas_load_window", "eaas_esft",
                         "eaas_esft_adapters", "eaas_esft_slots", "eaas_esft_max_experts",
                         "eaas_esft_replicas", "eaas_max_servers", *AUTOSCALE_FLAGS,
                         *LAYOUT_FLAGS, *BALANCE_FLAGS)
            if getattr(args, name, None) is not None
        ]
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --eaas; add --eaas or drop them")
        return None
    if getattr(args, "ep_size", 1) > 1 or getattr(args, "moe_a2a_backend", "none") != "none":
        raise ValueError("--eaas replaces expert parallelism: drop --ep/--moe-a2a-backend "
                         "(attention keeps --tp)")
    spin = args.eaas_poll_spin_us
    monitor = args.eaas_monitor or parse_monitor("embedded")
    heartbeat = args.eaas_heartbeat or HEARTBEAT
    loss = args.eaas_loss_timeout or LOSS_TIMEOUT
    suspect = suspect_timeout(loss, args.eaas_suspect_timeout)
    for name in ("loss", "suspect"):
        if monitor.kind != "embedded" and getattr(args, f"eaas_{name}_timeout") is not None:
            raise ValueError(f"--eaas-{name}-timeout applies to an embedded monitor; a "
                             f"standalone one has its own --{name}-timeout")
    if suspect > loss:
        raise ValueError(f"--eaas-suspect-timeout {suspect} must be at most the loss timeout "
                         f"({loss}s, --eaas-loss-timeout)")
    if monitor.kind == "embedded" and heartbeat > suspect / 2:
        raise ValueError(f"--eaas-heartbeat {heartbeat} must be at most half of the suspect "
                         f"timeout ({suspect}s, --eaas-suspect-timeout)")
    if args.eaas_wait_for_servers is not None and (
            args.eaas_expert_servers is not None or monitor.kind == "embedded"):
        raise ValueError("--eaas-wait-for-servers applies to a shared monitor "
                         "(--eaas-monitor HOST:PORT or etcd://) without --eaas-expert-servers")
    kernel, shrink = args.eaas_kernel, not args.eaas_disable_shrink
    if args.eaas_disable_overlap and getattr(args, "enable_two_batch_overlap", False):
        raise ValueError("--eaas-disable-overlap turns off the two-batch overlap "
                         "--enable-two-batch-overlap asks for: drop one of them")
    esft = bool(args.eaas_esft or args.eaas_esft_adapters)
    if not esft and any(getattr(args, name, None) is not None for name in (
            "eaas_esft_slots", "eaas_esft_max_experts", "eaas_esft_replicas")):
        raise ValueError("--eaas-esft-slots, --eaas-esft-max-experts and --eaas-esft-replicas "
                         "apply with --eaas-esft or --eaas-esft-adapters")
    if esft and getattr(args, "enable_two_batch_overlap", False):
        raise ValueError("ESFT adapters (--eaas-esft) do not run with two-batch overlap yet: "
                         "drop --enable-two-batch-overlap")
    if not shrink and kernel == "reference":
        raise ValueError("--eaas-disable-shrink applies to --eaas-kernel fast only")
    if (kernel is not None or not shrink) and (
            isinstance(args.eaas_expert_servers, RemoteServers)
            or (monitor.kind != "embedded" and args.eaas_expert_servers is None
                and args.eaas_placement is None)):
        raise ValueError(LOCAL_ONLY)
    cfg = EaasConfig(args.eaas_expert_servers, None, args.eaas_token,
                     args.eaas_transport or transports.AUTO,
                     spin, monitor, heartbeat, loss,
                     args.eaas_result_timeout or RESULT_TIMEOUT,
                     args.eaas_wait_for_servers or WAIT_FOR_SERVERS, kernel, shrink,
                     not args.eaas_disable_overlap, args.eaas_load_dump,
                     args.eaas_load_window or LOAD_WINDOW, esft,
                     tuple(args.eaas_esft_adapters or ()), args.eaas_esft_slots,
                     args.eaas_esft_max_experts, args.eaas_esft_replicas or 1)
    cfg = replace(cfg, suspect_timeout=suspect, autoscale=autoscale_settings(args),
                  layout=layout_settings(args), balance=balance_settings(args),
                  max_servers=getattr(args, "eaas_max_servers", None))
    from sglang_eaas.protocol.operations import lease_ttl

    lease_ttl()  # SGLANG_EAAS_OPERATION_LEASE, refused now rather than at the first operation
    if args.eaas_placement is None and not cfg.esft_adapters:
        return cfg
    try:
        info = MoeModelInfo.from_model_path(args.model_path)
    except ModelError as exc:
        raise ValueError(f"--eaas: {exc}") from None
    placement = args.eaas_placement and checked_placement(args.eaas_placement, info)
    budget = cfg.adapter_budget(info.num_experts)
    for name, path in cfg.esft_adapters:
        try:
            adapter = load_adapter(path, info, model_path=args.model_path)
        except AdapterError as exc:
            raise ValueError(f"--eaas-esft-adapters {name}: {exc}") from None
        layer, count = max(((layer, len(ids)) for layer, ids in adapter.experts.items()),
                           key=lambda item: item[1], default=(0, 0))
        if count > budget:
            raise ValueError(f"--eaas-esft-adapters {name}: {path} replaces {count} experts in "
                             f"MoE layer {layer}, more than --eaas-esft-max-experts {budget} "
                             f"allows; raise it or serve an adapter with fewer")
    return replace(cfg, placement=placement)


LAYOUT_FLAGS = ("eaas_layout", "eaas_layout_margin", "eaas_layout_patience", "eaas_layout_dwell",
                "eaas_layout_cost")


def layout_settings(args: argparse.Namespace) -> LayoutSettings | None:
    """``--eaas-layout*``; None for 'ep' (nothing to do); ``ValueError`` (one sentence) for a
    bad value."""
    mode = getattr(args, "eaas_layout", None) or "ep"
    given = [f"--{n.replace('_', '-')}" for n in LAYOUT_FLAGS[1:]
             if getattr(args, n, None) is not None]
    if given and mode != "auto":
        raise ValueError(f"{', '.join(given)} only apply with --eaas-layout auto")
    if mode == "ep":
        return None
    optional = {name: getattr(args, f"eaas_layout_{name}")
                for name in ("margin", "patience", "dwell")}
    try:
        policy = LayoutPolicy(**{k: v for k, v in optional.items() if v is not None})
    except ValueError:
        raise ValueError("--eaas-layout-margin must be in (0, 1) and --eaas-layout-dwell "
                         ">= 0") from None
    cost = None
    if mode == "auto":
        from sglang_eaas.elastic.layout_cost import DEFAULT_COST, LayerCost

        path = args.eaas_layout_cost or DEFAULT_COST
        try:
            cost = LayerCost.load(path)
        except ValueError as exc:
            raise ValueError(f"--eaas-layout-cost: {exc}") from None
    return LayoutSettings(mode, policy, cost)


BALANCE_FLAGS = ("eaas_balance", "eaas_balance_period", "eaas_balance_horizon",
                 "eaas_balance_trigger", "eaas_balance_cooldown", "eaas_balance_shift",
                 "eaas_balance_budget", "eaas_balance_slots")


def balance_settings(args: argparse.Namespace) -> BalanceSettings | None:
    """``--eaas-balance*``; None for 'off'; ``ValueError`` (one sentence) for a bad value."""
    mode = getattr(args, "eaas_balance", None) or "off"
    given = [f"--{n.replace('_', '-')}" for n in BALANCE_FLAGS[1:]
             if getattr(args, n, None) is not None]
    if mode == "off":
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --eaas-balance reactive or "
                             "predictive")
        return None
    optional = {name: getattr(args, f"eaas_balance_{name}") for name in (
        "period", "horizon", "trigger", "cooldown", "shift", "budget", "slots")}
    try:
        return BalanceSettings(mode, **{k: v for k, v in optional.items() if v is not None})
    except ValueError:
        raise ValueError("--eaas-balance-period and --eaas-balance-horizon must be > 0, "
                         "--eaas-balance-trigger >= 1, --eaas-balance-cooldown >= 0 and "
                         "--eaas-balance-shift within 0-1") from None


AUTOSCALE_FLAGS = ("eaas_autoscale", "eaas_autoscale_ttft", "eaas_autoscale_tpot",
                   "eaas_autoscale_attainment", "eaas_autoscale_window",
                   "eaas_autoscale_cooldown", "eaas_autoscale_min_servers",
                   "eaas_autoscale_max_servers", "eaas_autoscale_busy_out",
                   "eaas_autoscale_busy_in", "eaas_autoscale_act")


def autoscale_settings(args: argparse.Namespace) -> AutoscaleSettings | None:
    """``--eaas-autoscale*``; ``ValueError`` (one sentence) for a bad or missing value."""
    given = [f"--{n.replace('_', '-')}" for n in AUTOSCALE_FLAGS[1:]
             if getattr(args, n, None) is not None]
    if not getattr(args, "eaas_autoscale", None):
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --eaas-autoscale")
        return None
    if args.eaas_autoscale_ttft is None or args.eaas_autoscale_tpot is None:
        raise ValueError("--eaas-autoscale needs its targets: --eaas-autoscale-ttft SECONDS "
                         "and --eaas-autoscale-tpot SECONDS")
    optional = {name: getattr(args, f"eaas_autoscale_{name}") for name in (
        "attainment", "window", "cooldown", "busy_out", "busy_in")}
    try:
        policy = AutoscalePolicy(args.eaas_autoscale_ttft, args.eaas_autoscale_tpot,
                                 **{k: v for k, v in optional.items() if v is not None})
    except ValueError:
        raise ValueError("--eaas-autoscale: the targets and the window must be > 0, the "
                         "attainment in (0, 1], the cooldown >= 0, --eaas-autoscale-busy-out "
                         "in [0, 1] and --eaas-autoscale-busy-in > 0") from None
    low, high = args.eaas_autoscale_min_servers or 1, args.eaas_autoscale_max_servers or 8
    if low > high:
        raise ValueError(f"--eaas-autoscale-min-servers {low} is above "
                         f"--eaas-autoscale-max-servers {high}")
    return AutoscaleSettings(policy, low, high, args.eaas_autoscale_act or "resize")


def checked_placement(path: Path, info: MoeModelInfo) -> PlacementFile:
    """``--eaas-placement``: the file read, its layers and experts checked against the model
    and every expert of every MoE layer held by one of its servers; ``ValueError`` (one
    sentence naming the file) otherwise."""
    try:
        placement = load_placement_file(path)
        RoutingTable.build(0, placement.holdings(info.moe_layers, info.num_experts),
                           list(info.moe_layers), info.num_experts)
    except PlacementError as exc:
        where = "" if str(exc).startswith(str(path)) else f"{path}: "
        raise ValueError(f"--eaas-placement {where}{exc}") from None
    return placement


def current() -> EaasConfig | None:
    """The config of the server this process belongs to, or ``None`` when ``--eaas`` is off."""
    from sglang.srt.runtime_context import get_server_args

    return getattr(get_server_args(), "_eaas", None)
