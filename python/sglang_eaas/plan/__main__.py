"""``python -m sglang_eaas.plan``: the cheapest deployment that meets an SLO, by simulation."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from sglang_eaas.plan.deployment import EP, TP
from sglang_eaas.plan.errors import PlanInputError
from sglang_eaas.plan.load import dump_load, fit_zipf, zipf_load
from sglang_eaas.plan.model import ModelSpec
from sglang_eaas.plan.profile import load_profile
from sglang_eaas.plan.search import SLO, Space, cheapest, parse_slo, search
from sglang_eaas.plan.sim import Failure, SimSettings
from sglang_eaas.plan.traffic import parse_lengths, poisson, read_trace

DESCRIPTION = """\
Simulate deployments of an MoE model on the disaggregated tier (attention instances as the
tier's clients, expert servers, the P2P fabric between them) on a hardware profile, on the
given traffic, and print the cheapest one whose share of requests within both SLO targets is at
least --attainment, with a table of every deployment simulated. Writes, in --out: the chosen
deployment as a config for python -m sglang_eaas.deploy (deploy.yaml, checked by that command's
own checks; placement.yaml with hot replicas), Kubernetes sizes for deploy/k8s/
(k8s-sizes.yaml), and the curve of cost against SLO attainment (cost-curve.png). The model,
its assumptions, and where it is calibrated: docs/planning.md. A projection, not a measurement.
"""


def int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        out: list[int] = []
        try:
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                out += range(int(lo), int(hi or lo) + 1)
        except ValueError:
            out = [-1]
        if not out or min(out) < (0 if flag in ("--hot-replicas", "--standby") else 1):
            raise argparse.ArgumentTypeError(
                f"{flag} must be whole numbers such as 1,2,4 or 1-8, got {text!r}")
        return tuple(sorted(set(out)))
    return parse


def choices(flag: str, allowed: dict):
    def parse(text: str) -> tuple:
        try:
            return tuple(dict.fromkeys(allowed[t.strip()] for t in text.split(",")))
        except KeyError:
            raise argparse.ArgumentTypeError(
                f"{flag} must be a comma list of {', '.join(allowed)}, got {text!r}") from None
    return parse


def failure(text: str) -> Failure:
    """AT (one server), AT:N (N servers), AT:node, or AT:monitor:SECONDS."""
    parts = text.split(":")
    try:
        at = float(parts[0])
        if len(parts) == 1:
            return Failure(at)
        if parts[1] == "node" and len(parts) == 2:
            return Failure(at, node=True)
        if parts[1] == "monitor" and len(parts) == 3 and float(parts[2]) > 0:
            return Failure(at, monitor=float(parts[2]))
        if len(parts) == 2 and int(parts[1]) >= 1:
            return Failure(at, servers=int(parts[1]))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"--fail must be AT, AT:SERVERS, AT:node or "
                                     f"AT:monitor:SECONDS (seconds), got {text!r}")


class _Parser(argparse.ArgumentParser):
    """A bad flag is one sentence on stderr and exit status 2 (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m sglang_eaas.plan", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    need = p.add_argument_group("what to plan for")
    need.add_argument("--model", required=True, metavar="CONFIG.json",
                      help="the checkpoint's config.json (or its folder): layers, experts, "
                      "top-k, sizes and dtype are read from it (examples/plan/ has some); "
                      "a DeepSeek-V2/V3 config (MLA, shared experts) is a projection only, "
                      "with no deploy config written")
    need.add_argument("--hardware", required=True, metavar="PROFILE.yaml",
                      help="a hardware profile, or a shipped one by name: h100, h200, "
                      "cpu-here (format: sglang_eaas/plan/profile.py)")
    need.add_argument("--slo", required=True, metavar="ttft=S,tpot=S",
                      help="the targets: time to first token and time per output token, in "
                      "seconds (or with an ms suffix)")
    need.add_argument("--attainment", type=float, default=0.9, metavar="X",
                      help="share of requests that must meet both targets (default 0.9)")
    need.add_argument("--traffic", required=True, metavar="RATE|TRACE.jsonl",
                      help="requests per second (Poisson arrivals for --duration), or a trace "
                      'file of JSON lines {"arrival": S, "prompt": N, "output": N}')
    t = p.add_argument_group("traffic from a rate")
    t.add_argument("--duration", type=float, default=120.0, metavar="S",
                   help="seconds of arrivals simulated per deployment (default 120)")
    t.add_argument("--prompt-tokens", type=int, default=1024, metavar="N",
                   help="mean prompt length (default 1024)")
    t.add_argument("--output-tokens", type=int, default=256, metavar="N",
                   help="mean output length (default 256)")
    t.add_argument("--prompt-dist", default="lognormal:0.8", metavar="KIND",
                   help="prompt lengths: fixed, exponential or lognormal[:SIGMA] (default "
                   "lognormal:0.8)")
    t.add_argument("--output-dist", default="lognormal:0.8", metavar="KIND",
                   help="output lengths, as --prompt-dist (default lognormal:0.8)")
    t.add_argument("--seed", type=int, default=0, help="seed of arrivals, lengths and the "
                   "Zipf layers (default 0)")
    ld = p.add_argument_group("expert load").add_mutually_exclusive_group()
    ld.add_argument("--load", metavar="DUMP.jsonl",
                    help="a load dump (--eaas-load-dump's JSON lines of load windows): each "
                    "layer's share per expert")
    ld.add_argument("--zipf", type=float, default=0.8, metavar="S",
                    help="without --load: Zipf exponent of the per-expert load, the hot "
                    "experts different in each layer (default 0.8; 0: uniform)")
    s = p.add_argument_group("the deployments searched")
    s.add_argument("--attention", type=int_list("--attention"), default=(1, 2, 4, 8, 16, 32),
                   metavar="LIST", help="attention instances tried, e.g. 1,2,4 or 1-16 "
                   "(default 1,2,4,8,16,32; the fewest that meet the SLO are bisected)")
    s.add_argument("--attention-gpus", type=int_list("--attention-gpus"), default=(1,),
                   metavar="LIST", help="devices per attention instance (its --tp; default 1)")
    s.add_argument("--expert-servers", type=int_list("--expert-servers"),
                   default=(4, 8, 16, 32, 64), metavar="LIST",
                   help="expert server counts tried, one device each, at most the model's "
                   "experts (default 4,8,16,32,64)")
    s.add_argument("--hot-replicas", type=int_list("--hot-replicas"), default=(0, 8),
                   metavar="LIST", help="the hottest experts of each layer given one more "
                   "copy: counts tried (default 0,8)")
    s.add_argument("--layouts", type=choices("--layouts", {"ep": EP, "tp": TP}),
                   default=(EP, TP), metavar="ep,tp", help="expert tier layouts tried: ep "
                   "(whole experts spread), tp (every server a part of every expert); default "
                   "both")
    s.add_argument("--overlap", type=choices("--overlap", {"off": False, "on": True}),
                   default=(False, True), metavar="off,on",
                   help="two-batch overlap tried off, on, or both (default both)")
    s.add_argument("--standby", type=int_list("--standby"), default=None, metavar="LIST",
                   help="warm standby servers tried (default 0, or 0,1 with --fail)")
    s.add_argument("--max-running", type=int, default=256, metavar="N",
                   help="requests one attention instance decodes at once, at most (default "
                   "256; less where its KV memory holds fewer)")
    f = p.add_argument_group("failures")
    f.add_argument("--fail", type=failure, action="append", default=[], metavar="SPEC",
                   help="a failure in every simulation: AT (one expert server lost at AT "
                   "seconds), AT:N (N servers), AT:node (every server of a node), "
                   "AT:monitor:S (the monitor out S seconds: no change of holdings); repeatable")
    f.add_argument("--join-s", type=float, default=30.0, metavar="S",
                   help="a standby server takes a lost one's experts after S (default 30)")
    f.add_argument("--cold-s", type=float, default=120.0, metavar="S",
                   help="without a standby, a new server does after S (default 120)")
    f.add_argument("--timeout-s", type=float, default=60.0, metavar="S",
                   help="requests waiting S for an expert without a holder fail (default 60)")
    o = p.add_argument_group("simulation and output")
    o.add_argument("--sim-layers", type=int, default=4, metavar="N",
                   help="MoE layers simulated, spread over the model's, each standing for its "
                   "share of the rest (default 4)")
    o.add_argument("--out", type=Path, default=Path(".cache/plan"), metavar="DIR",
                   help="where deploy.yaml, k8s-sizes.yaml and cost-curve.png go (default "
                   ".cache/plan)")
    o.add_argument("--progress", action="store_true",
                   help="a line on stderr after each tier shape and server count searched")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        return run(args, argv if argv is not None else sys.argv[1:])
    except PlanInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from sglang_eaas.deploy.config import DeployConfigError, load_config
    from sglang_eaas.plan.output import plot_curve, table, write_outputs

    model = ModelSpec.from_config(args.model)
    profile = load_profile(args.hardware)
    slo: SLO = parse_slo(args.slo, args.attainment)
    for flag, value in (("--duration", args.duration), ("--join-s", args.join_s),
                        ("--cold-s", args.cold_s), ("--timeout-s", args.timeout_s)):
        if not value > 0:
            raise PlanInputError(f"{flag} must be > 0, got {value:g}")
    if args.sim_layers < 1 or args.max_running < 1:
        raise PlanInputError("--sim-layers and --max-running must be >= 1")
    try:
        rate = float(args.traffic)
    except ValueError:
        traffic = read_trace(args.traffic)
    else:
        traffic = poisson(rate, args.duration,
                          parse_lengths("--prompt-dist", args.prompt_dist, args.prompt_tokens),
                          parse_lengths("--output-dist", args.output_dist, args.output_tokens),
                          args.seed)
    if args.load:
        load = dump_load(args.load, model.info.num_experts, model.info.moe_layers)
        load = replace(load, source=f"{load.source} (Zipf fit s={fit_zipf(load.shares[0]):.2f} "
                       "in its first layer)")
    else:
        load = zipf_load(model.info.num_experts, model.info.moe_layers, args.zipf, args.seed)
    standby = args.standby if args.standby is not None else ((0, 1) if args.fail else (0,))
    space = Space(args.attention, args.expert_servers, args.hot_replicas, args.layouts,
                  standby, args.overlap, args.attention_gpus, args.max_running)
    settings = SimSettings(join_s=args.join_s, cold_s=args.cold_s, timeout_s=args.timeout_s)
    progress = (lambda line: print(f"plan: {line}", file=sys.stderr, flush=True)
                ) if args.progress else None
    candidates = search(space, model, profile, load.subset(args.sim_layers), traffic, slo,
                        settings, tuple(args.fail), progress)
    chosen = cheapest(candidates, slo)
    command = "python -m sglang_eaas.plan " + shlex.join(argv)
    print(f"model {model.folder} ({model.info.model_type}, {model.moe_layers} MoE layers of "
          f"{model.info.num_experts} experts, top-{model.info.top_k}, {model.info.dtype}); "
          f"profile {profile.name}; traffic: {traffic.source} ({len(traffic)} requests); "
          f"load: {load.source}; SLO: TTFT <= {slo.ttft:g}s and TPOT <= {slo.tpot * 1e3:g}ms "
          f"for {slo.attainment:.0%} of requests. A projection from the profile's numbers "
          f"({profile.sources['device']}), not a measurement.\n")
    print(table(candidates, slo, chosen))
    curve = args.out / "cost-curve.png"
    if plot_curve(candidates, slo, curve, f"{model.folder.name} on {profile.name}"):
        print(f"\ncost against SLO attainment: {curve}")
    else:
        print("\nno cost curve: matplotlib is missing (pip install -e '.[bench]')")
    if chosen is None:
        print(f"no deployment searched meets the SLO; the best reached "
              f"{max(c.attainment for c in candidates):.1%} (widen --attention or "
              "--expert-servers)")
        return 1
    if not model.servable:
        print(f"\ncheapest meeting the SLO: {chosen.deployment.label()}: "
              f"{chosen.deployment.gpus} devices, {chosen.cost_per_hour:.2f}/h, attainment "
              f"{chosen.attainment:.1%}; no deploy config written: the expert servers do not "
              f"serve {model.info.model_type} (MLA and shared experts), so this is a "
              "projection only")
        return 0
    header = f"# written by: {command}\n"
    written = write_outputs(args.out, chosen, model, load, header)
    try:
        load_config(written["deploy"])
    except DeployConfigError as exc:  # a bug of the writer, said as the deploy command would
        print(f"error: the written {written['deploy']} does not pass the deploy command's "
              f"checks: {exc}", file=sys.stderr)
        return 1
    print(f"\ncheapest meeting the SLO: {chosen.deployment.label()}: {chosen.deployment.gpus} "
          f"devices, {chosen.cost_per_hour:.2f}/h, attainment {chosen.attainment:.1%}")
    for name, path in written.items():
        print(f"  {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
