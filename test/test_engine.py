"""``sglang_eaas.Engine``: the offline engine with the ``--eaas`` options as keywords. Its greedy
tokens (float32, the trained top-4 checkpoint, two local expert servers) equal, token for token,
those of ``python -m sglang.launch_server`` on the same checkpoint (the suite's monolithic
server, which the ``--eaas`` server equals in test_trained_model);
a bad keyword is one sentence naming it, before anything starts; ``shutdown()`` leaves no expert
server, monitor or shared-memory file of theirs behind while the process goes on.

One engine, in a process of its own (test/engine_run.py: SGLang's shutdown kills every child of
its process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import PROMPTS, TRAINED, open_log

from sglang_eaas.addresses import free_port

PROMPTS4 = (*PROMPTS, "class Stack:\n    def push(self, item):")
TOKENS = 24
EAAS = ("--eaas", "--eaas-expert-servers", "local:2")
# conftest.start_server's CPU_ARGS and --dtype float32 (the monolithic server's), then EAAS.
ENGINE_KWARGS = {"device": "cpu", "max_total_tokens": 4096, "dtype": "float32", "eaas": True,
                 "eaas_expert_servers": "local:2"}


@pytest.fixture(scope="module")
def runs(monolithic_trained):
    """(the engine script's result, the server's greedy tokens for PROMPTS4)."""
    nobody = f"127.0.0.1:{free_port()}"
    spec = {"model": str(TRAINED), "kwargs": ENGINE_KWARGS, "prompts": list(PROMPTS4),
            "tokens": TOKENS, "unreachable": nobody}
    with open_log("engine-run") as log:
        engine = subprocess.run([sys.executable, str(Path(__file__).with_name("engine_run.py")),
                                 json.dumps(spec)], stdout=subprocess.PIPE, stderr=log,
                                text=True, timeout=600)
    lines = [line for line in engine.stdout.splitlines() if line.startswith("RESULT ")]
    assert engine.returncode == 0 and lines, f"engine_run.py exited {engine.returncode}; see " \
                                             ".cache/logs/test/engine-run.log"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    expected = [monolithic_trained.generate(p, TOKENS)["output_ids"] for p in PROMPTS4]
    return {**result, "nobody": nobody}, expected


@pytest.mark.slow
@pytest.mark.cpu_only  # SGLang through the CPU runtime (device="cpu")
def test_engine_tokens_equal_the_servers(runs):
    """Greedy, float32: each prompt alone and all four as one batch give the server's tokens."""
    result, expected = runs
    assert all(len(tokens) == TOKENS for tokens in expected)
    assert result["alone"] == expected
    assert result["batched"] == expected


@pytest.mark.slow
@pytest.mark.cpu_only
def test_engine_shutdown_leaves_nothing_behind(runs):
    """After shutdown() (the engine's process still running): its two local expert servers and
    every other child gone, the embedded monitor's port closed, no /dev/shm file of a server's
    left. And a launch that fails (a shared monitor nobody answers at) is a RuntimeError naming
    the keyword, with no child process left."""
    result, _ = runs
    assert len(result["servers"]) == 2 and result["monitor_answered"]
    assert result["left"] == [] and result["servers_alive"] == []
    assert not result["monitor_answers_after"]
    assert result["shm_left"] == []
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in result["servers"])
    failed = result["failed_launch"]
    nobody = result["nobody"]
    assert failed["error"].startswith(f"eaas_monitor {nobody}: monitor {nobody} is unreachable")
    assert failed["children"] == []


@pytest.fixture(scope="module")
def options():
    """SGLang's options with the plugin's group, in this process (as test_plugin loads it)."""
    from sglang_eaas.launcher.engine import Options

    return Options()


@pytest.mark.parametrize(("kwargs", "sentence"), [
    ({"eaas_bogus": 1}, "unknown keyword eaas_bogus: the sglang-eaas options are eaas, "),
    ({"not_a_field": 1}, "unknown keyword not_a_field: neither one of SGLang's ServerArgs "
                         "fields nor an sglang-eaas option"),
    ({"eaas_expert_servers": "local:x"},
     "eaas_expert_servers: 'local:N' needs a whole number N >= 1, got 'local:x'"),
    ({"eaas_expert_servers": True}, "eaas_expert_servers takes what --eaas-expert-servers "
                                    "takes on the command line (a string or number), got True"),
    ({"eaas": "yes"}, "eaas takes True or False, got 'yes'"),
    ({"eaas": False}, "eaas_expert_servers only apply with eaas=True; add eaas=True or drop "
                      "them"),
    ({"eaas_heartbeat": 5}, "eaas_heartbeat 5.0 must be at most half of the suspect timeout "
                            "(1.0s, eaas_suspect_timeout)"),
    ({"eaas_transport": "carrier-pigeon"}, "eaas_transport: invalid choice: 'carrier-pigeon'"),
    ({"eaas_placement": "/nonexistent/placement.yaml"},
     "eaas_placement: '/nonexistent/placement.yaml' is not a readable file"),
    ({"eaas_autoscale": True}, "eaas_autoscale needs SGLang's HTTP server"),
    ({"server_args": object()}, "sglang_eaas.Engine builds its ServerArgs itself"),
], ids=["unknown-eaas-keyword", "unknown-keyword", "bad-value", "flag-value", "not-a-bool",
        "without-eaas", "config-check", "bad-choice", "missing-file", "needs-http",
        "server-args"])
def test_a_bad_keyword_is_one_sentence_naming_it_and_nothing_starts(options, kwargs, sentence):
    from sglang_eaas.launcher.engine import build_server_args

    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError) as refused:
        build_server_args({"model_path": str(TRAINED), **ENGINE_KWARGS, **kwargs}, options)
    assert str(refused.value).startswith(sentence)
    assert "\n" not in str(refused.value)
    assert psutil.Process().children(recursive=True) == before


def test_good_keywords_make_the_servers_record(options):
    """The keywords give the record the command line gives (the plugin's EaasConfig on it)."""
    from sglang.srt.server_args import prepare_server_args

    from sglang_eaas.launcher.engine import build_server_args

    built = build_server_args({"model_path": str(TRAINED), **ENGINE_KWARGS,
                               "eaas_heartbeat": 0.2, "log_level": "info"}, options)
    parsed = prepare_server_args(["--model-path", str(TRAINED), "--device", "cpu",
                                  "--max-total-tokens", "4096", "--dtype", "float32", *EAAS,
                                  "--eaas-heartbeat", "0.2"])
    assert built._eaas == parsed._eaas and built._eaas.heartbeat == 0.2
    assert built._eaas.expert_servers.count == 2
    assert str(built) == str(parsed)
    assert built.launch_command.startswith("sglang_eaas.Engine(model_path=")


def test_importing_the_package_stays_light():
    """``sglang_eaas.Engine`` is imported on first use: the package imports neither SGLang nor
    torch."""
    code = ("import sys, sglang_eaas; assert 'sglang' not in sys.modules and 'torch' not in "
            "sys.modules; print(sglang_eaas.Engine.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.split() == ["sglang_eaas.launcher.engine"]
