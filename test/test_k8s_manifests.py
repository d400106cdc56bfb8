"""deploy/k8s: the Kubernetes manifests pass Kubernetes' own schema and agree with the code.

Schema: every resource is validated with kubernetes-validate (the OpenAPI schemas of Kubernetes
``KUBERNETES``, strict: an unknown field is an error). Code: every container command line is
parsed by the real parser of its program (SGLang's ``ServerArgs`` with the plugin's ``--eaas``
group, sglang-router's ``RouterArgs``, the expert server's ``parse_args``; etcd's flags against
``etcd --help``), without abbreviations; the expert pool's entrypoint script is run with ``sh``
for each pod index (``python -m sglang_eaas.expert_server`` replaced by a recorder, the
committed checkpoint standing for /models/M) and its command lines parsed too. Then: Services
select pods whose ports they name, the router's selectors, ports and bootstrap annotation match
the SGLang pods, every ``$(VAR)``, Secret, PVC and volume referenced exists, and the HPA drives
the pool from the autoscaler's gauge with the bounds the autoscaler is given. Nothing is applied
to a cluster and no server starts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import math
import re
import shlex
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import k8s_manifests as k8s
import kubernetes_validate
import pytest
import yaml

KUBERNETES = "1.35.0"  # the schemas validated against; the HPA's scaleUp.tolerance is 1.33+
MODEL = k8s.ROOT / "models" / "tiny-moe-stdlib"  # stands for /models/M when the script runs
GAUGE = "sglang_eaas_autoscale_desired_servers"


@pytest.fixture(scope="module")
def sglang_parser() -> argparse.ArgumentParser:
    """``python -m sglang.launch_server``'s parser: SGLang's flags and the --eaas group, as the
    plugin's hook on ``ServerArgs.add_cli_args`` builds it (the hooks applied in this process,
    as SGLang's launcher applies them; idempotent, whatever ran before in it)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = k8s.StrictParser()
    ServerArgs.add_cli_args(parser)
    assert any("--eaas" in a.option_strings for a in parser._actions), "the plugin is not live"
    return parser


def _sglang(parser, workload: dict):
    """(argparse namespace, EaasConfig) of a launch_server container."""
    from sglang_eaas import config

    argv = k8s.argv(workload)
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    try:
        args = parser.parse_args(argv[3:])
    except k8s.Refused as exc:
        pytest.fail(f"{workload['metadata']['name']}: launch_server refuses its args: {exc}")
    return args, config.from_cli_args(args)


SGLANG = [w for w in k8s.WORKLOADS if k8s.program(w) == "sglang.launch_server"]


def test_every_resource_passes_the_kubernetes_schema():
    for name, doc in k8s.DOCS:
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at "
                        f"{'.'.join(map(str, exc.path))}")
    assert {d["kind"] for _, d in k8s.DOCS} >= {
        "Secret", "PersistentVolumeClaim", "Service", "StatefulSet", "Deployment",
        "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy", "ServiceAccount",
        "Role", "RoleBinding"}


@pytest.mark.parametrize("breakage", ["misspelled field", "wrong type", "missing selector"])
def test_the_schema_check_refuses_a_broken_manifest(breakage):
    pool = copy.deepcopy(k8s.get("StatefulSet", "eaas-expert"))
    if breakage == "misspelled field":
        container = k8s.container(pool)
        container["volumeMount"] = container.pop("volumeMounts")
    elif breakage == "wrong type":
        pool["spec"]["replicas"] = "five"
    else:
        del pool["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pool, KUBERNETES, strict=True)


def test_kustomization_lists_every_manifest_and_the_image():
    kustomization = yaml.safe_load((k8s.K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == k8s.FILES
    images = {i["name"] for i in kustomization["images"]}
    for w in k8s.WORKLOADS:
        image = k8s.container(w)["image"].split(":")[0]
        assert image in images or image.startswith("quay.io/coreos/etcd"), image


def test_sglang_instances_parse_with_launch_server_and_share_the_tier(sglang_parser):
    assert {w["metadata"]["name"] for w in SGLANG} == {
        "eaas-prefill", "eaas-decode-lead", "eaas-decode"}
    pool = _pool_env()
    for w in SGLANG:
        args, cfg = _sglang(sglang_parser, w)
        name = w["metadata"]["name"]
        assert cfg is not None and cfg.monitor.kind == "etcd", name
        assert cfg.monitor.address == "eaas-etcd:2379" and cfg.transport == "mooncake", name
        assert args.model_path == pool["MODEL_PATH"], name
        mode = "prefill" if name == "eaas-prefill" else "decode"
        assert args.disaggregation_mode == mode and args.disaggregation_ib_device, name
        assert args.disaggregation_transfer_backend == "mooncake", name
        assert (cfg.autoscale is not None) == (name == "eaas-decode-lead"), name
        ports = {p["name"]: p["containerPort"] for p in k8s.container(w)["ports"]}
        assert args.port == ports["http"] and args.host == "0.0.0.0", name
        _mounts_model(w, args.model_path)


def _mounts_model(workload: dict, model_path: str) -> None:
    spec = workload["spec"]["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
              if "persistentVolumeClaim" in v}
    mounts = [m for m in k8s.container(workload)["volumeMounts"]
              if claims.get(m["name"]) == "eaas-models"]
    assert mounts and model_path.startswith(mounts[0]["mountPath"] + "/"), workload
    k8s.get("PersistentVolumeClaim", "eaas-models")


def test_the_expert_servers_have_a_client_slot_for_every_rank(sglang_parser):
    slots = int(_pool_env()["MAX_CLIENTS"])
    ranks = sum(w["spec"]["replicas"] * _sglang(sglang_parser, w)[0].tp_size for w in SGLANG)
    assert slots >= 2 * ranks  # two per rank with two-batch overlap


def _pool_env() -> dict[str, str]:
    pool = k8s.container(k8s.get("StatefulSet", "eaas-expert"))
    return {e["name"]: e["value"] for e in pool["env"] if "value" in e}


def test_router_flags_parse_and_find_the_prefill_and_decode_pods(sglang_parser):
    from sglang_router.router_args import RouterArgs

    router = k8s.get("Deployment", "eaas-router")
    argv = k8s.argv(router)
    assert argv[:3] == ["python", "-m", "sglang_router.launch_router"]
    parser = k8s.StrictParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    try:
        args = RouterArgs.from_cli_args(parser.parse_args(argv[3:]), use_router_prefix=False)
    except k8s.Refused as exc:
        pytest.fail(f"launch_router refuses its args: {exc}")
    assert args.pd_disaggregation and args.service_discovery
    assert args.service_discovery_namespace == k8s.FAKE_POD["metadata.namespace"]
    found = {"prefill": k8s.pods_selected(args.prefill_selector),
             "decode": k8s.pods_selected(args.decode_selector)}
    assert [w["metadata"]["name"] for w in found["prefill"]] == ["eaas-prefill"]
    assert {w["metadata"]["name"] for w in found["decode"]} == {"eaas-decode-lead", "eaas-decode"}
    for w in SGLANG:
        assert _sglang(sglang_parser, w)[0].port == args.service_discovery_port
    (prefill,) = found["prefill"]
    bootstrap = prefill["spec"]["template"]["metadata"]["annotations"][
        args.bootstrap_port_annotation]
    assert int(bootstrap) == _sglang(sglang_parser, prefill)[0].disaggregation_bootstrap_port
    assert int(bootstrap) in [p["containerPort"] for p in k8s.container(prefill)["ports"]]
    _may_watch_pods(router["spec"]["template"]["spec"]["serviceAccountName"])


def _may_watch_pods(account: str) -> None:
    binding = k8s.get("RoleBinding", "eaas-router")
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    k8s.get("ServiceAccount", account)
    role = k8s.get("Role", binding["roleRef"]["name"])
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"])
               for r in role["rules"])


@functools.cache
def _expert_server_flags() -> set[str]:
    """Every option string of ``python -m sglang_eaas.expert_server`` (from its --help)."""
    from sglang_eaas.expert_server.__main__ import parse_args

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args(["--help"])
    return set(re.findall(r"(--[a-z][a-z0-9-]+)", out.getvalue()))


def _pool_pod(index: int, role_dir: Path, **overrides: str) -> tuple[list[str], dict]:
    """The pool container's command line and env for pod ``index``, its role marker in
    ``role_dir`` instead of the emptyDir."""
    pool = k8s.get("StatefulSet", "eaas-expert")
    container = k8s.container(pool)
    volumes = {v["name"]: v for v in pool["spec"]["template"]["spec"]["volumes"]}
    (role,) = [m["mountPath"] for m in container["volumeMounts"]
               if "emptyDir" in volumes[m["name"]] and m["mountPath"] != "/dev/shm"]
    env = {"SGLANG_EAAS_TOKEN": "test-token", "MODEL_PATH": str(MODEL)}
    for e in container["env"]:
        ref = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        if "value" in e:
            env.setdefault(e["name"], e["value"])
        elif ref.startswith("metadata.labels['apps.kubernetes.io/pod-index']"):
            env[e["name"]] = str(index)
        elif ref in k8s.FAKE_POD:
            env[e["name"]] = k8s.FAKE_POD[ref]
    argv = container["command"] + container["args"]
    assert f"{role}/" in argv[-1], "the role marker is on the pod's emptyDir"
    return [a.replace(f"{role}/", f"{role_dir}/") for a in argv], {**env, **overrides}


def _parse_server(recorded: list[str]):
    from sglang_eaas.expert_server.__main__ import parse_args

    try:
        return parse_args(recorded)
    except SystemExit:
        pytest.fail(f"python -m sglang_eaas.expert_server refuses {recorded}")


@pytest.mark.parametrize("seed,replicas", [(None, None), ("3", "1"), ("5", "3")])
def test_the_pool_entrypoint_seeds_every_expert_and_then_starts_standby(tmp_path, seed,
                                                                         replicas):
    from sglang_eaas.model_info import MoeModelInfo

    experts = MoeModelInfo.from_model_path(MODEL).num_experts
    env = _pool_env()
    seeds = int(seed or env["SEED_SERVERS"])
    times = int(replicas or env["EXPERT_REPLICAS"])
    overrides = {"SEED_SERVERS": str(seeds), "EXPERT_REPLICAS": str(times)}
    flags, held = _expert_server_flags(), Counter()
    pods = max(seeds + 1, k8s.get("StatefulSet", "eaas-expert")["spec"]["replicas"])
    for index in range(pods):
        (tmp_path / str(index)).mkdir()
        argv, env = _pool_pod(index, tmp_path / str(index), **overrides)
        status, recorded, err = k8s.run_recorded(argv, env, tmp_path)
        assert status == 0 and recorded, err
        assert {a for a in recorded if a.startswith("--")} <= flags
        args, cfg = _parse_server(recorded)
        assert (cfg.host, cfg.transport) == (k8s.FAKE_POD["status.podIP"], "mooncake")
        assert cfg.monitor == "etcd://eaas-etcd:2379" and args.standby == (index >= seeds)
        held.update(cfg.experts)
        if index >= seeds:
            assert args.spare_experts == math.ceil(times * experts / seeds)
    assert held == Counter({e: times for e in range(experts)})
    # a container restarted in the same pod (drained by a scale-in, or crashed) comes back empty
    status, recorded, err = k8s.run_recorded(*_pool_pod(0, tmp_path / "0", **overrides), tmp_path)
    assert status == 0 and _parse_server(recorded)[0].standby, err


def test_the_pool_entrypoint_refuses_more_replicas_than_seeds(tmp_path):
    status, recorded, err = k8s.run_recorded(*_pool_pod(0, tmp_path, SEED_SERVERS="2",
                                                     EXPERT_REPLICAS="3"), tmp_path)
    assert status == 1 and not recorded and "EXPERT_REPLICAS" in err


def test_the_pool_listens_where_its_services_and_drain_say(tmp_path):
    pool = k8s.get("StatefulSet", "eaas-expert")
    container = k8s.container(pool)
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "control"]
    status, recorded, err = k8s.run_recorded(*_pool_pod(9, tmp_path), tmp_path)
    assert status == 0 and _parse_server(recorded)[1].port == port, err
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    env = {"POD_IP": k8s.FAKE_POD["status.podIP"], "SGLANG_EAAS_TOKEN": "test-token",
           "EAAS_ADMIN_URL": "http://127.0.0.1:1"}  # nothing listens: the drain's fallback
    # the hook retires the pod through the lead's admin API (the tier controller), keeping the
    # active count, and waits for an operation in flight
    retire = shlex.split(hook[-1].split("||")[0].replace("\n", " "))
    assert retire[:3] == ["python", "-m", "sglang_eaas.tools.scale"], hook
    from sglang_eaas.tools import scale

    asked = scale.parse_args([a.replace("$EAAS_ADMIN_URL", _pool_env()["EAAS_ADMIN_URL"])
                              .replace("$POD_IP", env["POD_IP"]) for a in retire[3:]])
    assert asked.action == "retire" and asked.args == [f"{env['POD_IP']}:{port}"]
    assert asked.replace and asked.wait > 0
    lead = k8s.get("Service", "eaas-decode-lead")
    assert asked.url == f"http://{lead['metadata']['name']}:{lead['spec']['ports'][0]['port']}"
    status, recorded, err = k8s.run_recorded(hook, env, tmp_path)
    args, _ = _parse_server(recorded)
    assert status == 0 and args.drain == f"{k8s.FAKE_POD['status.podIP']}:{port}", err
    assert pool["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > max(
        asked.wait + asked.timeout, args.drain_timeout + 30)  # the longest waits
    _mounts_model(pool, _pool_env()["MODEL_PATH"])
    governing = k8s.get("Service", pool["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    assert k8s.pods_selected(governing["spec"]["selector"]) == [pool]


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed "
                    "(scripts/setup.sh installs Debian's etcd-server)")
def test_etcd_flags_exist_and_name_its_own_pod():
    etcd = k8s.get("StatefulSet", "eaas-etcd")
    known = subprocess.run(["etcd", "--help"], capture_output=True, text=True,
                           timeout=60).stdout
    argv = k8s.argv(etcd)
    assert argv[0] == "etcd"
    flags = dict(a.split("=", 1) for a in argv[1:])
    for flag in flags:
        assert re.search(rf"^\s*{re.escape(flag)}\b", known, re.M), f"etcd has no {flag}"
    service = etcd["spec"]["serviceName"]
    ports = {p["name"]: p["containerPort"] for p in k8s.container(etcd)["ports"]}
    pod0 = f"{etcd['metadata']['name']}-0"
    assert flags["--initial-cluster"] == f"{pod0}=http://{pod0}.{service}:{ports['peer']}"
    assert flags["--advertise-client-urls"].endswith(f".{service}:{ports['client']}")


def test_services_select_pods_that_have_their_ports():
    for _, service in k8s.DOCS:
        if service["kind"] != "Service":
            continue
        pods = k8s.pods_selected(service["spec"]["selector"])
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for w in pods:
                names = {p["name"]: p["containerPort"] for p in k8s.container(w)["ports"]}
                assert port["targetPort"] in names or port["targetPort"] in names.values(), (
                    service["metadata"]["name"], port)


def test_workloads_select_their_own_pods_only():
    for w in k8s.WORKLOADS:
        selector = w["spec"]["selector"]["matchLabels"]
        assert k8s.pods_selected(selector) == [w], w["metadata"]["name"]


def test_every_reference_resolves():
    for w in k8s.WORKLOADS:
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"] for v in spec.get("volumes", [])} | {
            t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        container = k8s.container(w)
        assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                k8s.get("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
        for e in container.get("env", []):
            if "secretKeyRef" in e.get("valueFrom", {}):
                ref = e["valueFrom"]["secretKeyRef"]
                assert ref["key"] in k8s.get("Secret", ref["name"])["stringData"]
        uses_tier = any("etcd://" in a or "sglang_eaas" in a for a in k8s.argv(w))
        token = [e for e in container.get("env", []) if e["name"] == "SGLANG_EAAS_TOKEN"]
        assert bool(token) == uses_tier, w["metadata"]["name"]
        if uses_tier:  # and only pods the etcd NetworkPolicy lets in talk to etcd
            policy = k8s.get("NetworkPolicy", "eaas-etcd")["spec"]["ingress"][0]["from"][0]
            assert w in k8s.pods_selected(policy["podSelector"]["matchLabels"])


def test_the_hpa_drives_the_pool_from_the_autoscalers_gauge(sglang_parser):
    from sglang_eaas.client import autoscale_hooks

    hpa = k8s.get("HorizontalPodAutoscaler", "eaas-expert")["spec"]
    target = hpa["scaleTargetRef"]
    pool = k8s.get(target["kind"], target["name"])
    assert (target["kind"], target["apiVersion"]) == ("StatefulSet", "apps/v1")
    (metric,) = hpa["metrics"]
    described = metric["object"]["describedObject"]
    service = k8s.get(described["kind"], described["name"])
    (lead,) = k8s.pods_selected(service["spec"]["selector"])
    args, cfg = _sglang(sglang_parser, lead)
    assert lead["spec"]["replicas"] == 1 and args.enable_metrics
    assert cfg.autoscale.act == "resize"
    assert [w for w in SGLANG if _sglang(sglang_parser, w)[1].autoscale] == [lead]
    # replicas = ceil(metric / 1) = the adapter's metric: the desired count + 1 standby
    assert metric["object"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    (rule,) = yaml.safe_load((k8s.K8S / k8s.HELM_VALUES).read_text())["rules"]["custom"]
    assert rule["name"]["as"] == metric["object"]["metric"]["name"]
    assert re.match(rf"^'?{GAUGE}\{{", rule["seriesQuery"]) and rule["metricsQuery"].endswith(
        "+ 1")
    assert f'Gauge("{GAUGE}"' in Path(autoscale_hooks.__file__).read_text()
    seed = int(_pool_env()["SEED_SERVERS"])
    assert seed == cfg.autoscale.min_servers
    assert hpa["minReplicas"] == pool["spec"]["replicas"] == cfg.autoscale.min_servers + 1
    assert hpa["maxReplicas"] == cfg.autoscale.max_servers + 1
    # a pod the HPA removes retires itself through the tier controller (its preStop hook),
    # one at a time (docs, "A cluster (Kubernetes)")
    assert hpa["behavior"]["scaleDown"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": 120}]
    assert pool["spec"]["updateStrategy"]["type"] == "OnDelete"
    assert hpa["behavior"]["scaleUp"]["tolerance"] == "0"
    pdb = k8s.get("PodDisruptionBudget", "eaas-expert")["spec"]
    assert k8s.pods_selected(pdb["selector"]["matchLabels"]) == [pool]
