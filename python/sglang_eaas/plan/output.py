"""What the planner writes: the candidates' table, the cost-against-attainment curve (PNG), the
chosen deployment as a deploy config (``examples/deploy/`` format, checked by the deploy
command's own ``load_config``) and as Kubernetes sizes for the roles ``deploy/k8s/`` names."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from sglang_eaas.plan.deployment import TP, Deployment
from sglang_eaas.plan.load import ExpertLoad
from sglang_eaas.plan.model import ModelSpec
from sglang_eaas.plan.search import SLO, Candidate, cost_curve
from sglang_eaas.plan.tier import hot_placement


def table(candidates: list[Candidate], slo: SLO, chosen: Candidate | None) -> str:
    rows = ["| deployment | devices | cost/h | attainment | p90 TTFT s | p90 TPOT ms | failed "
            "| meets |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in sorted(candidates, key=lambda c: (c.cost_per_hour, -c.attainment)):
        mark = "**chosen**" if c is chosen else ("yes" if c.meets(slo) else
                                                  "no" if c.fits else "no (memory)")
        rows.append(f"| {c.deployment.label()} | {c.deployment.gpus} | {c.cost_per_hour:.2f} | "
                    f"{c.attainment:.1%} | {_num(c.p90_ttft, 1)} | {_num(c.p90_tpot, 1e3)} | "
                    f"{c.failed} | {mark} |")
    return "\n".join(rows)


def _num(x: float, scale: float) -> str:
    return "-" if not math.isfinite(x) else f"{x * scale:.2f}"


def plot_curve(candidates: list[Candidate], slo: SLO, path: Path, title: str) -> bool:
    """The cost curve as a PNG; False (nothing written) where matplotlib is not installed (it
    comes with the bench extra: pip install -e '.[bench]')."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    fits = [c for c in candidates if c.fits]
    ax.scatter([c.cost_per_hour for c in fits], [100 * c.attainment for c in fits], s=12,
               alpha=0.6, label="candidates")
    curve = cost_curve(candidates)
    if curve:
        ax.step([p[0] for p in curve], [100 * p[1] for p in curve], where="post",
                label="best attainment at this cost")
    ax.axhline(100 * slo.attainment, color="gray", linestyle="--", label="target")
    ax.set_xlabel("cost per hour (profile's price per device-hour)")
    ax.set_ylabel(f"% requests within TTFT {slo.ttft:g}s, TPOT {slo.tpot * 1e3:g}ms")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def placement_file(dep: Deployment, model: ModelSpec, load: ExpertLoad) -> dict:
    """Every MoE layer's placement with the hot replicas (the placement file format)."""
    servers = [f"local:{i}" for i in range(dep.expert_servers)]
    out: dict[str, dict[int, list[int]]] = {s: {} for s in servers}
    for layer in model.info.moe_layers:
        for s, ids in hot_placement(load.row(layer), servers, dep.hot_replicas).items():
            out[s][layer] = ids
    return {"servers": out}


def deploy_config(dep: Deployment, model: ModelSpec, placement: Path | None) -> dict:
    """The ``python -m sglang_eaas.deploy`` config of ``dep`` (plain instances, a standalone
    monitor, local expert servers)."""
    experts: dict = {"count": dep.expert_servers} if placement is None else {
        "placement": str(placement)}  # hot replicas, or more servers than experts
    if dep.standby:
        experts["standby"] = dep.standby
    args = []
    if dep.attention_gpus > 1:
        args += ["--tp", str(dep.attention_gpus)]
    if dep.layout == TP:
        args += ["--eaas-layout", "tp"]
    if not dep.overlap:
        args += ["--eaas-disable-overlap"]
    sglang: dict = {"plain": {"count": dep.attention}}
    if args:
        sglang["args"] = args
    return {"model": str(model.folder), "monitor": "standalone", "expert_servers": experts,
            "sglang": sglang}


def k8s_sizes(dep: Deployment) -> dict:
    """Replicas and device requests per role of ``deploy/k8s/`` (the attention instances as
    decode instances; prefill is not sized by this planner)."""
    def gpu():  # a new mapping each time: YAML would write a shared one as an anchor
        return {"nvidia.com/gpu": dep.attention_gpus}
    return {
        "eaas-expert": {  # expert-pool.yaml (StatefulSet) and expert-pool-hpa.yaml
            "replicas": dep.expert_servers + dep.standby,
            "env": {"SEED_SERVERS": dep.expert_servers, "EXPERT_REPLICAS": 1},
            "hpa": {"minReplicas": dep.expert_servers + max(dep.standby, 1)},
            "resources": {"limits": {"nvidia.com/gpu": 1}},
        },
        "eaas-decode-lead": {"replicas": 1, "resources": {"limits": gpu()},
                             "args": {"--eaas-autoscale-min-servers": dep.expert_servers}},
        "eaas-decode": {"replicas": dep.attention - 1, "resources": {"limits": gpu()}},
    }


def write_outputs(out: Path, chosen: Candidate, model: ModelSpec, load: ExpertLoad,
                  header: str) -> dict[str, Path]:
    """The chosen deployment's files in ``out``: deploy.yaml (and placement.yaml with hot
    replicas), k8s-sizes.yaml."""
    out.mkdir(parents=True, exist_ok=True)
    dep, written = chosen.deployment, {}
    placement = None
    if dep.hot_replicas or dep.expert_servers > model.info.num_experts:
        placement = (out / "placement.yaml").resolve()
        placement.write_text(header + yaml.safe_dump(placement_file(dep, model, load),
                                                     default_flow_style=None))
        written["placement"] = placement
    config = out / "deploy.yaml"
    config.write_text(header + "#   python -m sglang_eaas.deploy " + str(config) + "\n"
                      + yaml.safe_dump(deploy_config(dep, model, placement), sort_keys=False,
                                       default_flow_style=None))
    written["deploy"] = config
    sizes = out / "k8s-sizes.yaml"
    note = ("# The hot replicas are per-layer placement (placement.yaml): the pool's "
            "EXPERT_REPLICAS shards cannot say it; give the pool that placement.\n"
            if dep.hot_replicas else "")
    sizes.write_text(header + "# Sizes for the roles in deploy/k8s/ (set them there).\n" + note
                     + yaml.safe_dump(k8s_sizes(dep), sort_keys=False))
    written["k8s"] = sizes
    return written
