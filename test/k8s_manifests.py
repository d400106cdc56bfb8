"""The manifests in deploy/k8s as data, for test_k8s_manifests.py: every resource read once,
lookups by kind and name, the pods a selector picks, a container's command line with its
``$(VAR)`` references expanded, a strict argument parser, and a way to run a command with
``python -m sglang_eaas.expert_server`` recorded instead of run."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
HELM_VALUES = "prometheus-adapter-values.yaml"  # the Prometheus Adapter's, not a resource
# what the downward API would give the container, for the references to it
FAKE_POD = {"status.podIP": "10.1.2.3", "metadata.namespace": "eaas",
            "metadata.name": "eaas-etcd-0"}


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


FILES = sorted(p.name for p in K8S.glob("*.yaml")
               if p.name not in ("kustomization.yaml", HELM_VALUES))
DOCS = [(name, doc) for name in FILES for doc in load(name)]
WORKLOADS = [d for _, d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]


def get(kind: str, name: str) -> dict:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} in deploy/k8s"
    return found[0]


def container(workload: dict) -> dict:
    (one,) = workload["spec"]["template"]["spec"]["containers"]
    return one


def argv(workload: dict) -> list[str]:
    """The container's command line with every ``$(VAR)`` replaced by its value (each must be
    defined in the container's env, as Kubernetes expands only those)."""
    spec = container(workload)
    env = {e["name"]: e.get("value", FAKE_POD.get(e.get("valueFrom", {}).get(
        "fieldRef", {}).get("fieldPath"), "x")) for e in spec.get("env", [])}

    def expand(arg: str) -> str:
        for var in re.findall(r"\$\((\w+)\)", arg):
            assert var in env, f"{workload['metadata']['name']}: $({var}) is not in its env"
            arg = arg.replace(f"$({var})", env[var])
        return arg

    return [expand(a) for a in spec.get("command", []) + spec.get("args", [])]


def program(workload: dict) -> str:
    """The program a container runs: the module of ``python -m``, else the command."""
    spec = container(workload)
    line = spec.get("command", []) + spec.get("args", [])
    return line[2] if line[:2] == ["python", "-m"] else line[0]


def pods_selected(selector: dict) -> list[dict]:
    """The workloads whose pods carry every label of ``selector``."""
    return [w for w in WORKLOADS
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]


class Refused(Exception):
    pass


class StrictParser(argparse.ArgumentParser):
    """No abbreviations (a manifest spells every flag out), errors raised, not exited on."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        raise Refused(message)


def run_recorded(command: list[str], env: dict[str, str], tmp: Path
                 ) -> tuple[int, list[str], str]:
    """Run ``command`` with ``python -m sglang_eaas.expert_server ...`` recorded instead of run
    (any other ``python`` is the real one): (exit status, the recorded arguments after the
    module, stderr)."""
    bin_dir, out = tmp / "bin", tmp / "argv"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = sglang_eaas.expert_server ]; then\n'
        f"  shift 2; for a in \"$@\"; do printf '%s\\0' \"$a\"; done > {out}; exit 0\n"
        f"fi\nexec {sys.executable} \"$@\"\n")
    (bin_dir / "python").chmod(0o755)
    out.unlink(missing_ok=True)
    done = subprocess.run(command, env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    recorded = out.read_bytes().decode().split("\0")[:-1] if out.exists() else []
    return done.returncode, recorded, done.stderr
