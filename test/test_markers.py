"""The `gpu` / `cpu_only` markers (pytest.ini, test/conftest.py): each test runs where its hardware
is and is skipped with a reason elsewhere. A small suite runs in a fresh pytest with this repo's
hook, under a faked ``torch.cuda.is_available``, once as a CPU host and once as a GPU host."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

import conftest

pytest_plugins = ["pytester"]

TEST_DIR = Path(__file__).resolve().parent
INI = TEST_DIR.parent / "pytest.ini"

# The repo's hook, loaded from test/conftest.py under another module name (the inner run's own
# conftest is called ``conftest`` too), with CUDA faked from the environment.
INNER_CONFTEST = f"""
import importlib.util, os
import torch

torch.cuda.is_available = lambda: os.environ["FAKE_CUDA"] == "1"
spec = importlib.util.spec_from_file_location("eaas_conftest", {str(TEST_DIR / "conftest.py")!r})
eaas_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eaas_conftest)
pytest_collection_modifyitems = eaas_conftest.pytest_collection_modifyitems
"""

SUITE = """
import pytest

def test_anywhere():
    pass

@pytest.mark.gpu
def test_on_a_gpu():
    pass

@pytest.mark.cpu_only
def test_without_a_gpu():
    pass

@pytest.mark.cpu_only
class TestWithoutAGpu:
    def test_method(self):
        pass
"""


def _registered_markers() -> dict[str, str]:
    parser = configparser.ConfigParser()
    parser.read(INI)
    lines = parser["pytest"]["markers"].strip().splitlines()
    return dict(line.strip().split(": ", 1) for line in lines)


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini(INI.read_text().replace("testpaths = test\n", ""))  # the markers
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, cuda: bool,
         *args: str) -> pytest.RunResult:
    monkeypatch.setenv("FAKE_CUDA", "1" if cuda else "0")  # the inner run inherits it
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers", "-rs",
                                         "-v", *args)


def test_both_markers_are_registered():
    markers = _registered_markers()
    assert "torch.cuda.is_available()" in markers["gpu"]
    assert "without a CUDA device" in markers["cpu_only"]


def test_a_cpu_host_skips_gpu_tests_and_runs_the_rest(suite, monkeypatch):
    result = _run(suite, monkeypatch, cuda=False)
    result.assert_outcomes(passed=3, skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED [[]1[]] test_suite.py*: {conftest.GPU_SKIP}"])
    assert "test_on_a_gpu SKIPPED" in result.stdout.str()


def test_a_gpu_host_skips_cpu_only_tests_and_runs_the_rest(suite, monkeypatch):
    result = _run(suite, monkeypatch, cuda=True)
    result.assert_outcomes(passed=2, skipped=2)
    result.stdout.fnmatch_lines([f"SKIPPED [[]1[]] test_suite.py*: {conftest.CPU_ONLY_SKIP}"] * 2)
    out = result.stdout.str()
    assert "test_without_a_gpu SKIPPED" in out and "test_method SKIPPED" in out
    assert "test_on_a_gpu PASSED" in out


def test_a_test_marked_for_both_is_refused(suite, monkeypatch):
    suite.makepyfile(test_both="""
        import pytest

        @pytest.mark.gpu
        @pytest.mark.cpu_only
        def test_confused():
            pass
    """)
    result = _run(suite, monkeypatch, False, "test_both.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_both.py::test_confused is marked both gpu and cpu_only*"])
