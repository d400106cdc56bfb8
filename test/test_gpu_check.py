"""scripts/gpu_check.sh without a GPU: one sentence saying so, every module and script of the GPU
run imported with the packages the lent GPU machine lacks hidden (SGLang first), the test
selection collected, a report listing the steps a GPU run takes; and the check fails for real
when a module does not import. On a GPU host the same checks run through ``--imports-only``
(the GPU steps themselves run only by hand, on a lent GPU: docs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
_spec = importlib.util.spec_from_file_location("gpu_check_imports",
                                               ROOT / "scripts" / "gpu_lib" / "imports.py")
IMPORTS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(IMPORTS)
MODULES = len(IMPORTS.MODULES)  # what the no-GPU mode imports
GPU_STEPS = ("selection", "atomics", "register", "native", "cpu-kernel", "gpu-tests", "ipc",
             "graph", "nvshmem", "triton-tests", "device-step-tests", "timings")


def run_check(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OUT": str(out),
                                            "PYTHON": sys.executable, **env})


def report_rows(report: str) -> dict[str, str]:
    """Markdown table rows by their first cell."""
    return {cells[0]: cells[1] for line in report.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip("|").split(" | ")]]}


def test_without_a_gpu_it_says_so_and_checks_every_import(tmp_path):
    no_gpu = not torch.cuda.is_available()  # else the GPU steps would run: imports only
    result = run_check(tmp_path, *(() if no_gpu else ("--imports-only",)))
    assert result.returncode == 0, result.stdout + result.stderr
    first, *_ = result.stdout.splitlines()
    assert first.startswith("gpu_check: no GPU here (" if no_gpu else
                            "gpu_check: --imports-only, so nothing runs on the GPU: ")
    assert first.endswith("checking that every piece imports and that the test selection "
                          "collects.")
    assert "\n".join(result.stdout.splitlines()[1:]).count("no GPU") == 0  # one sentence
    report = (tmp_path / "gpu_check.md").read_text()
    assert "**no GPU: nothing ran on a GPU; imports checked.**" in report
    checks, steps = report.split("## Steps a GPU run takes (none ran here)")
    rows = report_rows(checks)
    for check in ("selection", "imports", "scripts", "collect-gpu", "collect-rest"):
        assert rows[check] == "passed", check
    assert f"imports: {MODULES} of {MODULES} modules import" in report
    assert "ok sglang_eaas.client.device_step" in result.stdout
    assert list(report_rows(steps)) == ["step", *GPU_STEPS]  # each with what it proves
    assert "test_device_step.py::test_a_staged_table_reaches_the_device_tensors_in_place" in (
        tmp_path / "gpu_check.log").read_text()  # the selection collected


def test_a_module_that_does_not_import_fails_the_check(tmp_path):
    """A module missing everywhere, and one that imports SGLang (installed on this CPU machine,
    absent on the lent GPU one, so the check hides it): both reported, exit 1."""
    result = run_check(tmp_path, "--imports-only", "--steps", "imports",
                       GPU_CHECK_EXTRA_IMPORTS="no_such_module_here sglang_eaas.launcher.engine")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAILED no_such_module_here: ModuleNotFoundError" in result.stdout
    engine = next(line for line in result.stdout.splitlines()
                  if line.startswith("FAILED sglang_eaas.launcher.engine: "))
    assert engine.endswith("(sglang is hidden: the lent GPU machine has none)"), engine
    report = (tmp_path / "gpu_check.md").read_text()
    assert "imports checked, and a check FAILED (below)" in report
    assert report_rows(report)["imports"] == "FAILED (exit 1)"
    assert f"imports: {MODULES} of {MODULES + 2} modules import, 2 do not" in report


def test_bad_arguments_are_refused_in_one_sentence(tmp_path):
    for args, message in [(("--nope",), "gpu_check: unknown argument '--nope' (see --help)"),
                          (("--steps", "graph,warp"), "gpu_check: --steps: 'warp' is not a step")]:
        result = run_check(tmp_path, *args)
        assert result.returncode == 2 and result.stderr.startswith(message), result.stderr
        assert "Traceback" not in result.stderr
    result = run_check(tmp_path, "--help")
    assert result.returncode == 0
    for word in ("--imports-only", "--steps", "GPU_CHECK_BUDGET", "OUT", *GPU_STEPS):
        assert word in result.stdout, word
