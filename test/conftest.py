"""Shared fixtures: generated checkpoints (cached under .cache/models) and one SGLang server."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sglang_eaas.tools.make_tiny_model import PRESETS, ModelSpec, cached_model
from sglang_eaas.tools.server_process import CPU_ARGS, CPU_DEVICE_ARGS, SGLangServer

# The shared secret of every expert server the tests start (inherited by their processes).
os.environ.setdefault("SGLANG_EAAS_TOKEN", "sglang-eaas-test-token")

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
# the tests' logs; one folder per pytest-xdist worker (the session's servers are per worker)
TEST_LOGS = CACHE / "logs" / "test" / os.environ.get("PYTEST_XDIST_WORKER", "")
# the benchmarks' fault tools the tests share: a CPU hog (a neighbour's job on the same cores)
# and a TCP relay that can be cut (a partition)
sys.path.insert(0, str(ROOT / "scripts"))
from bench_lib.hog import Hog  # noqa: E402,F401
from bench_lib.partition import Partition  # noqa: E402,F401
PROMPTS = (
    "Hello world, the quick brown fox",
    "Expert parallelism routes tokens",
    "def add(a, b):",
)
MAX_NEW_TOKENS = 12


def model_path(spec: ModelSpec) -> Path:
    return cached_model(CACHE / "models", spec, log=lambda _: None)


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return model_path(PRESETS["tiny"])


@pytest.fixture(scope="session")
def info(tiny_qwen3):
    """The tiny Qwen3-MoE's MoE shape."""
    from sglang_eaas.model_info import MoeModelInfo

    return MoeModelInfo.from_model_path(tiny_qwen3)


@pytest.fixture(scope="session")
def hf_experts(tiny_qwen3):
    """The reference: transformers' own routed-expert modules of the tiny Qwen3-MoE, loaded by
    its own from_pretrained (hf_reference.py)."""
    from hf_reference import hf_routed_experts

    return hf_routed_experts(tiny_qwen3)


@pytest.fixture(scope="session")
def tiny_mixtral() -> Path:
    return model_path(replace(PRESETS["tiny"], arch="mixtral"))


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair (netns.py): (owner, peer)."""
    from netns import two_hosts as made

    with made() as hosts:
        yield hosts


@pytest.fixture(scope="module")
def etcd(request):
    """A one-member etcd cluster on loopback for the module (``etcd://HOST:PORT``: ``.url``),
    logging to .cache/logs/test/etcd-MODULE.log."""
    from sglang_eaas.tools.etcd_process import EtcdProcess

    module = request.module.__name__.removeprefix("test_")
    with EtcdProcess(TEST_LOGS / f"etcd-{module}.log") as process:
        yield process


def open_log(name: str):
    """A fresh log file .cache/logs/test/NAME.log for processes a test starts."""
    path = TEST_LOGS / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    return open(path, "w")


def start_server(model: Path, *args: str, name: str, env: dict[str, str] | None = None,
                 small_kv: bool = True) -> SGLangServer:
    """A float32 CPU server on ``model`` (``env`` added to this process's environment); its log
    goes to .cache/logs/test/NAME.log. ``small_kv=False`` leaves out ``--max-total-tokens 4096``:
    the KV pools sized as a user's server's would be (the CPU runtime's defaults)."""
    log_path = TEST_LOGS / f"{name}.log"
    cpu_args = CPU_ARGS if small_kv else CPU_DEVICE_ARGS
    return SGLangServer(model, *cpu_args, "--dtype", "float32", *args, log_path=log_path,
                        env=env).start()


def resident_bytes(server: SGLangServer) -> tuple[int, int]:
    """Resident memory of the server's process tree (launcher, ranks, detokenizer): the sum of
    their RSS (the pages of torch and the like that they share counted in each) and of their
    PSS (a shared page split between the processes sharing it: what the tree costs the host)."""
    import psutil

    root = psutil.Process(server.process.pid)
    rss = pss = 0
    for process in (root, *root.children(recursive=True)):
        try:
            full = process.memory_full_info()
        except psutil.NoSuchProcess:
            continue
        rss, pss = rss + full.rss, pss + full.pss
    return rss, pss


@pytest.fixture(scope="session")
def monolithic_qwen3(tiny_qwen3):
    """Plain SGLang (--tp 1, no --eaas) on the tiny Qwen3-MoE: the baseline of the suite, its
    KV pool sized by the CPU runtime's defaults (test_tp_ep weighs it)."""
    server = start_server(tiny_qwen3, name="monolithic-qwen3", small_kv=False)
    yield server
    server.stop()


TRAINED = ROOT / "models" / "tiny-moe-stdlib"  # committed: 32 experts, top-4, skewed routing


@pytest.fixture(scope="session")
def monolithic_trained():
    """Plain SGLang (--tp 1, no --eaas, float32) on the trained checkpoint: the baseline of
    the tests that serve it (trained model, PD deployments)."""
    server = start_server(TRAINED, name="trained-monolithic")
    yield server
    server.stop()


def greedy_tokens(server: SGLangServer, prompts=PROMPTS) -> list[list[int]]:
    return [server.generate(p, MAX_NEW_TOKENS)["output_ids"] for p in prompts]


# --- Hardware markers (pytest.ini): `gpu` tests run only where torch sees a CUDA device,
# `cpu_only` tests only where it sees none; elsewhere each is skipped with a reason. ---

GPU_SKIP = "gpu: needs a CUDA device, and torch.cuda.is_available() is False here"
CPU_ONLY_SKIP = "cpu_only: needs a machine without a CUDA device, and this one has one"


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: the order within a module stays
    import torch

    has_cuda = torch.cuda.is_available()  # looked up now, so a test can monkeypatch it
    for item in items:
        gpu, cpu_only = item.get_closest_marker("gpu"), item.get_closest_marker("cpu_only")
        if gpu and cpu_only:
            raise pytest.UsageError(f"{item.nodeid} is marked both gpu and cpu_only: keep one")
        if gpu and not has_cuda:
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP))
        elif cpu_only and has_cuda:
            item.add_marker(pytest.mark.skip(reason=CPU_ONLY_SKIP))


# --- Workers: scripts/test.sh runs the suite on pytest-xdist workers, one module at a time on
# each (--dist loadfile). The longest modules are handed out first, so the run does not end on
# one of them alone. ---

FIRST = ("test_deploy.py", "test_eaas_e2e.py", "test_eaas_equality.py", "test_tier_e2e.py",
         "test_esft_serving.py", "test_failover.py", "test_elastic_serving.py",
         "test_controller.py", "test_switch.py", "test_trained_model.py", "test_two_hosts.py")


def _module_rank(item) -> int:
    name = item.path.name
    return FIRST.index(name) if name in FIRST else len(FIRST)


# A test marked `alone` runs while no other worker runs a test (their fixtures' setup and
# teardown included): it looks at the whole host (every file in /dev/shm). Consecutive `alone`
# tests of a module hold the host from the first one's setup to the last one's teardown, so a
# module fixture they share sees no other test either. A readers-writer lock between the
# workers' processes: every other test holds it shared; a turnstile makes a waiting `alone` test
# go before tests that ask after it.

LOCKS = CACHE / "locks"
_alone_held: list = []  # the open lock files while this worker holds the host


def _flock(name: str, mode: int):
    import fcntl

    LOCKS.mkdir(parents=True, exist_ok=True)
    handle = open(LOCKS / name, "a")
    fcntl.flock(handle, mode)
    return handle


def _is_alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import fcntl

    if _is_alone(item):
        if not _alone_held:
            turnstile = _flock("turnstile", fcntl.LOCK_EX)
            _alone_held[:] = [turnstile, _flock("suite", fcntl.LOCK_EX)]
        try:
            yield
        finally:
            if not (_is_alone(nextitem) and nextitem.path == item.path):
                for handle in reversed(_alone_held):
                    handle.close()  # closing the file releases its lock
                _alone_held.clear()
        return
    _flock("turnstile", fcntl.LOCK_EX).close()  # waits while an `alone` test waits or runs
    shared = _flock("suite", fcntl.LOCK_SH)
    try:
        yield
    finally:
        shared.close()
